#include "testing.h"

#include <shardtensor/core/comm.h>
#include <shardtensor/core/stats.h>
#include <torch/torch.h>

#include "comm/transport.h"
#include "core/channel.h"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

namespace shardtensor::testing {

bool is_mesh_2x2() {
  const char* env = std::getenv("SHARDTENSOR_TEST_MESH");
  return env != nullptr && std::string(env) == "2x2";
}

at::Tensor rnd(c10::IntArrayRef shape, uint64_t seed, double scale, double shift) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn(shape, gen, at::kFloat);
  if (scale != 1.0) x.mul_(scale);
  if (shift != 0.0) x.add_(shift);
  return x;
}

RefInput sharded_input(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                       bool requires_grad) {
  return RefInput{full, fit_placements(mesh, wanted), requires_grad};
}

RefInput empty_first_input(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                           bool requires_grad) {
  auto p = fit_placements(mesh, wanted);
  return RefInput{full, p, requires_grad, sizes_with_empty_first(mesh, p, full.sizes())};
}

RefInput empty_input_at(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                        EmptyAt where, bool requires_grad) {
  auto p = fit_placements(mesh, wanted);
  return RefInput{full, p, requires_grad, sizes_with_empty_at(mesh, p, full.sizes(), where)};
}

::testing::AssertionResult throws_everywhere(const std::function<void()>& fn,
                                             const std::vector<std::string>& needles) {
  bool threw = false, named = false;
  std::string what;
  try {
    fn();
  } catch (const c10::Error& e) {
    threw = true;
    what = e.what_without_backtrace();
    named = true;
    for (const auto& n : needles) named = named && what.find(n) != std::string::npos;
  }
  if (all_ranks(threw && named)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << (threw ? "error without the expected words: " + what
                                                 : std::string("no error on this rank"));
}

DeviceMesh test_mesh() {
  if (is_mesh_2x2()) {
    return DeviceMesh::create({2, 2}, {"dim0", "dim1"});
  }
  return DeviceMesh::create({-1}, {"domain"});
}

Placements fit_placements(const DeviceMesh& mesh, const Placements& wanted) {
  Placements out;
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    out.push_back(i < static_cast<int64_t>(wanted.size()) ? wanted[i] : Placement(Replicate{}));
  }
  return out;
}

std::vector<int64_t> split_with_empty(int64_t n, int64_t parts, int64_t empty_at) {
  TORCH_CHECK(parts >= 1 && empty_at >= 0 && empty_at < parts, "split_with_empty: coordinate ",
              empty_at, " outside a mesh dim of ", parts);
  if (parts == 1) return {n};
  std::vector<int64_t> out = balanced_sizes(n, parts - 1);
  out.insert(out.begin() + empty_at, 0);
  return out;
}

int64_t empty_coordinate(EmptyAt where, int64_t parts) {
  switch (where) {
    case EmptyAt::kFirst:
      return 0;
    case EmptyAt::kMiddle:
      return parts / 2;
    case EmptyAt::kLast:
      break;
  }
  return parts - 1;
}

ShardSizes sizes_with_empty_at(const DeviceMesh& mesh, const Placements& placements,
                               c10::IntArrayRef global_shape, EmptyAt where) {
  ShardSizes sizes(mesh.ndim());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!is_shard(placements[m])) continue;
    int64_t d = shard_dim(placements[m]);
    if (d < 0) d += static_cast<int64_t>(global_shape.size());
    const int64_t p = mesh.size(m);
    sizes[m] = split_with_empty(global_shape[d], p, empty_coordinate(where, p));
  }
  return sizes;
}

ShardSizes sizes_with_empty_first(const DeviceMesh& mesh, const Placements& placements,
                                  c10::IntArrayRef global_shape) {
  return sizes_with_empty_at(mesh, placements, global_shape, EmptyAt::kFirst);
}

// The harness's own agreement: over the whole job under either transport
// (MPI_COMM_WORLD or the c10d world), and not counted in comm_stats.
int64_t max_over_ranks(int64_t value) {
  detail::UncountedComm uncounted;
  std::vector<int64_t> v{value};
  comm::transport::diagnostic_max_(v, detail::world_comm());
  return v[0];
}

at::Tensor reduce_over_ranks(const at::Tensor& t, ReduceOp op) {
  detail::UncountedComm uncounted;
  at::Tensor out = t.contiguous().clone();
  comm::transport::all_reduce_(out, op, detail::world_comm());
  return out;
}

bool all_ranks(bool ok) { return max_over_ranks(ok ? 0 : 1) == 0; }

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     double rtol, double atol) {
  // Local verdict first, then agree on the worst one.
  double worst = 0.0;  // max over elements of |a-b| / (atol + rtol*|b|); > 1 fails
  std::string why;
  if (!actual.defined() || !expected.defined()) {
    if (actual.defined() != expected.defined()) {
      worst = 1e300;
      why = actual.defined() ? "expected is undefined" : "actual is undefined";
    }
  } else if (actual.sizes() != expected.sizes()) {
    worst = 1e300;
    std::ostringstream os;
    os << "shape " << actual.sizes() << " vs expected " << expected.sizes();
    why = os.str();
  } else if (actual.is_complex() != expected.is_complex()) {
    worst = 1e300;
    std::ostringstream os;
    os << "dtype " << actual.scalar_type() << " vs expected " << expected.scalar_type();
    why = os.str();
  } else if (actual.numel() > 0) {
    // Complex values compare as (real, imag) pairs: .to(kDouble) would drop
    // the imaginary part.
    auto as_real = [](const at::Tensor& t) {
      return t.is_complex() ? at::view_as_real(t.detach().to(torch::kComplexDouble).resolve_conj())
                            : t.detach().to(torch::kDouble);
    };
    auto a = as_real(actual);
    auto b = as_real(expected);
    auto diff = (a - b).abs();
    // diff / tolerance, with exact matches counting 0 even when the tolerance is 0.
    auto err = torch::where(diff == 0, torch::zeros_like(diff), diff / (atol + rtol * b.abs()));
    // NaN and +-Inf must sit at exactly the same positions (a NaN is not
    // "close" to an Inf, nor +Inf to -Inf).
    const auto nan_a = torch::isnan(a), nan_b = torch::isnan(b);
    const auto pinf_a = torch::isposinf(a), pinf_b = torch::isposinf(b);
    const auto ninf_a = torch::isneginf(a), ninf_b = torch::isneginf(b);
    if (!nan_a.equal(nan_b) || !pinf_a.equal(pinf_b) || !ninf_a.equal(ninf_b)) {
      worst = 1e300;
      std::ostringstream os;
      os << "non-finite values differ: NaN at " << nan_a.sum().item<int64_t>() << " vs "
         << nan_b.sum().item<int64_t>() << " positions (" << (nan_a != nan_b).sum().item<int64_t>()
         << " differ), +Inf " << pinf_a.sum().item<int64_t>() << " vs "
         << pinf_b.sum().item<int64_t>() << ", -Inf " << ninf_a.sum().item<int64_t>() << " vs "
         << ninf_b.sum().item<int64_t>();
      why = os.str();
    } else {
      auto fin = torch::isfinite(b);
      auto e = torch::where(fin, err, torch::zeros_like(err));
      worst = e.max().item<double>();
      if (fin.any().item<bool>()) {
        std::ostringstream os;
        os << "max |a-b| = " << (a - b).abs().masked_select(fin).max().item<double>()
           << ", max |b| = " << b.abs().masked_select(fin).max().item<double>();
        why = os.str();
      }
    }
  }
  // The worst ratio over ranks (non-negative doubles order like their bits),
  // the lowest rank that has it, and that rank's message.
  struct {
    double v;
    int rank;
  } out{0.0, 0};
  int64_t bits = 0;
  const double mine = std::isnan(worst) ? std::numeric_limits<double>::infinity() : worst;
  std::memcpy(&bits, &mine, sizeof(bits));
  const int64_t worst_bits = max_over_ranks(bits);
  std::memcpy(&out.v, &worst_bits, sizeof(bits));
  const int me = world_rank();
  out.rank = static_cast<int>(-max_over_ranks(bits == worst_bits ? -me : INT64_MIN));
  {
    detail::UncountedComm uncounted;
    const Comm world = detail::world_comm();
    at::Tensor len = at::full({1}, static_cast<int64_t>(why.size()), at::kLong);
    comm::transport::broadcast_(len, out.rank, world);
    at::Tensor text = at::zeros({len.item<int64_t>()}, at::kByte);
    if (me == out.rank && !why.empty()) std::memcpy(text.data_ptr(), why.data(), why.size());
    comm::transport::broadcast_(text, out.rank, world);
    why.assign(static_cast<const char*>(text.data_ptr()), static_cast<size_t>(text.numel()));
  }
  if (out.v <= 1.0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "mismatch on rank " << out.rank << " (error ratio " << out.v << ", rtol " << rtol
         << ", atol " << atol << "): " << why;
}

}  // namespace shardtensor::testing
