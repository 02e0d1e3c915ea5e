// comm/ primitives: forward against plain libtorch on the full tensor (the same
// seed on every rank), a dot-product adjoint test <A x, y> == <x, A^T y> for
// every primitive (Note [replicated gradients] in src/comm/primitives.cpp
// defines the pairings), traffic accounting, argument validation and the
// SHARDTENSOR_DEBUG agreement check. Every mesh dim of the test mesh is
// exercised, with uneven partitions and empty shards.
#include <ATen/CPUGeneratorImpl.h>
#include <shardtensor/core/comm.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>

#include "comm/agree.h"
#include "comm/repartition.h"
#include "comm/transport.h"
#include "core/channel.h"
#include "testing.h"

namespace st = shardtensor;
namespace comm = shardtensor::comm;
using namespace shardtensor::testing;
using st::PadMode;
using st::ReduceOp;

namespace {

// ---- helpers -------------------------------------------------------------------

at::Tensor seeded_randn(c10::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, dtype);
}

/// One mesh dim as a test sees it.
struct Axis {
  int64_t mesh_dim;
  int64_t P;
  int64_t me;
  st::Comm comm;
};

std::vector<Axis> axes(const st::DeviceMesh& mesh) {
  std::vector<Axis> out;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    out.push_back({m, mesh.size(m), mesh.coordinate()[m], mesh.comm(m)});
  }
  return out;
}

std::vector<int64_t> balanced(int64_t n, int64_t P) {
  std::vector<int64_t> s(P);
  for (int64_t i = 0; i < P; ++i) {
    s[i] = n / P + (i < n % P ? 1 : 0);
  }
  return s;
}

std::vector<int64_t> offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> o(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) {
    o[i] = o[i - 1] + sizes[i - 1];
  }
  return o;
}

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

std::string str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    os << (i ? ", " : "") << v[i];
  }
  return os.str() + "]";
}

/// Partitions of some extent over P coordinates: uneven balanced, an empty shard
/// inside, an empty first shard, pieces of one element (multi-hop halos).
std::vector<std::vector<int64_t>> partitions(int64_t P) {
  std::vector<std::vector<int64_t>> out;
  out.push_back(balanced(2 * P + 1, P));
  if (P >= 2) {
    std::vector<int64_t> inner(P), first(P, 2);
    for (int64_t c = 0; c < P; ++c) {
      inner[c] = c == 1 ? 0 : c + 2;
    }
    first[0] = 0;
    out.push_back(inner);
    out.push_back(first);
  } else {
    out.push_back({4});
  }
  out.push_back(balanced(std::max<int64_t>(P, 2), P));
  return out;
}

/// A shape with extent n at `dim` (rank 3).
std::vector<int64_t> shape3(int64_t dim, int64_t n) {
  std::vector<int64_t> s = {2, 3, 2};
  s[dim] = n;
  return s;
}

double local_dot(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) * b.to(at::kDouble)).sum().item<double>();
}

// The harness's sums and comparisons go through the transport (either
// transport), uncounted so that byte assertions see only the library's traffic.
double sum_over(double v, st::Comm comm) {
  st::detail::UncountedComm uncounted;
  at::Tensor t = at::full({1}, v, at::kDouble);
  comm::transport::all_reduce_(t, st::ReduceOp::Sum, comm);
  return t.item<double>();
}

/// Collective over `comm`: true iff `t` equals (to 1e-12) rank 0's `t` on every rank.
bool same_on(const at::Tensor& t, st::Comm comm) {
  st::detail::UncountedComm uncounted;
  at::Tensor mine = t.detach().to(at::kDouble).contiguous();
  at::Tensor root = mine.clone();
  comm::transport::broadcast_(root, 0, comm);
  at::Tensor ok = at::full({1}, at::allclose(mine, root, 1e-12, 1e-14) ? 1 : 0, at::kInt);
  comm::transport::all_reduce_(ok, st::ReduceOp::Min, comm);
  return ok.item<int>() == 1;
}

/// How a space pairs a value with its gradient (Note [replicated gradients]).
enum class Pairing {
  Once,          ///< replicated value, replicated gradient: local dot, counted once
  SumOverRanks,  ///< sharded, partial or per-rank-used: sum of local dots
};

double pair(const at::Tensor& v, const at::Tensor& g, Pairing p, st::Comm comm) {
  const double local = local_dot(v, g);
  return p == Pairing::Once ? local : sum_over(local, comm);
}

/// Collective over the world. The dot-product test <A x, y> == <x, A^T y> with
/// A^T y from autograd, at 1e-5 relative. `x_grad_replicated`: the gradient of
/// x must also be identical on every rank of `comm`.
::testing::AssertionResult adjoint(const std::function<at::Tensor(const at::Tensor&)>& op,
                                   const at::Tensor& x0, const at::Tensor& y, Pairing xp,
                                   Pairing yp, st::Comm comm, bool x_grad_replicated = false) {
  at::Tensor x = x0.detach().clone().requires_grad_(true);
  at::Tensor out = op(x);
  bool ok = true;
  std::ostringstream why;
  at::Tensor cot = y;
  if (out.sizes() != y.sizes()) {
    ok = false;
    why << "output shape " << out.sizes() << " but cotangent shape " << y.sizes() << "; ";
    cot = at::zeros_like(out);  // keep the backward collectives in step
  }
  at::Tensor g = torch::autograd::grad({out}, {x}, {cot}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true)[0];
  if (!g.defined()) {
    g = at::zeros_like(x);
  }
  const double lhs = pair(out, cot, yp, comm);
  const double rhs = pair(x, g, xp, comm);
  const double scale = std::max({std::abs(lhs), std::abs(rhs), 1e-300});
  if (!(std::abs(lhs - rhs) <= 1e-5 * scale)) {
    ok = false;
    why << "<A x, y> = " << lhs << " but <x, A^T y> = " << rhs << "; ";
  }
  if (x_grad_replicated && !same_on(g, comm)) {
    ok = false;
    why << "the gradient of a replicated input differs between ranks; ";
  }
  if (all_ranks(ok)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "adjoint test failed on rank " << st::world_rank() << " or another rank: " << why.str();
}

/// The reference for gather_range: torch::nn::functional::pad of the full
/// tensor along `dim`, then the slice [lo, hi). Circular reaches beyond one
/// period (which torch::nn::functional::pad refuses) tile the tensor instead.
at::Tensor padded_slice(const at::Tensor& full, int64_t dim, int64_t lo, int64_t hi, PadMode mode,
                        double value) {
  namespace F = torch::nn::functional;
  const int64_t n = full.size(dim);
  const int64_t L = std::max<int64_t>(0, -lo), R = std::max<int64_t>(0, hi - n);
  at::Tensor padded;
  if (mode == PadMode::Circular && (L > n || R > n)) {
    const int64_t k = (std::max(L, R) + n - 1) / n;
    std::vector<at::Tensor> copies(2 * k + 1, full);
    padded = at::cat(copies, dim).narrow(dim, k * n - L, n + L + R);
  } else {
    at::Tensor moved = full.movedim(dim, -1).contiguous();
    std::vector<int64_t> shp = moved.sizes().vec();
    int64_t rest = 1;
    for (size_t i = 0; i + 1 < shp.size(); ++i) {
      rest *= shp[i];
    }
    F::PadFuncOptions opts({L, R});
    switch (mode) {
      case PadMode::Constant:
        opts.mode(torch::kConstant).value(value);
        break;
      case PadMode::Reflect:
        opts.mode(torch::kReflect);
        break;
      case PadMode::Replicate:
        opts.mode(torch::kReplicate);
        break;
      case PadMode::Circular:
        opts.mode(torch::kCircular);
        break;
    }
    at::Tensor p = F::pad(moved.reshape({1, rest, n}), opts);
    shp.back() = n + L + R;
    padded = p.reshape(shp).movedim(-1, dim);
  }
  return padded.narrow(dim, lo + L, hi - lo);
}

const std::vector<PadMode> kModes = {PadMode::Constant, PadMode::Reflect, PadMode::Replicate,
                                     PadMode::Circular};

const char* mode_str(PadMode m) { return shardtensor::pad_mode_name(m); }

/// Whether torch::nn::functional::pad semantics define [lo, hi) for extent n.
bool mode_allows(PadMode mode, int64_t n, int64_t lo, int64_t hi) {
  if (lo == hi || (lo >= 0 && hi <= n) || mode == PadMode::Constant) {
    return true;
  }
  if (mode == PadMode::Reflect) {
    return n >= 2 && lo >= -(n - 1) && hi <= 2 * n - 1;
  }
  return n >= 1;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

Ranges halo_ranges(const std::vector<int64_t>& sizes, int64_t left, int64_t right) {
  Ranges r;
  auto off = offsets(sizes);
  for (size_t c = 0; c < sizes.size(); ++c) {
    r.emplace_back(off[c] - left, off[c] + sizes[c] + right);
  }
  return r;
}

bool ranges_allowed(PadMode mode, int64_t n, const Ranges& ranges) {
  for (auto [lo, hi] : ranges) {
    if (!mode_allows(mode, n, lo, hi)) {
      return false;
    }
  }
  return true;
}

/// Random ranges, identical on every rank: lo in [-(n-1), n], hi in [lo, 2n-1]
/// (trims, empty ranges, multi-hop and wrap-around all occur).
Ranges random_ranges(std::mt19937& rng, int64_t n, int64_t P) {
  Ranges r;
  for (int64_t c = 0; c < P; ++c) {
    std::uniform_int_distribution<int64_t> lo_d(-(n - 1), n);
    const int64_t lo = lo_d(rng);
    std::uniform_int_distribution<int64_t> hi_d(lo, std::max(lo, 2 * n - 1));
    r.emplace_back(lo, hi_d(rng));
  }
  return r;
}

/// Scoped SHARDTENSOR_DEBUG=1.
class DebugMode {
 public:
  DebugMode() { setenv("SHARDTENSOR_DEBUG", "1", 1); }
  ~DebugMode() { unsetenv("SHARDTENSOR_DEBUG"); }
};

/// Runs `fn` expecting a c10::Error whose message contains `needle`.
::testing::AssertionResult throws_with(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find(needle) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "message lacks \"" << needle << "\": " << msg;
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace

// ---- host staging (Note [host staging] in src/comm/transport_mpi.cpp) -----------

// Every transport call on a buffer that is not in host memory goes through a
// host copy. On a CPU-only machine SHARDTENSOR_STAGE_HOST=1 stages host
// buffers too (test_comm.staged.* runs this whole suite so): then each call
// counts its copies in staged_bytes exactly, and the results are those of the
// unstaged calls. Without it nothing is staged.
TEST(Transport, HostStagingCountsEveryCopyAndKeepsResults) {
  const char* env = std::getenv("SHARDTENSOR_STAGE_HOST");
  const bool forced = env != nullptr && *env != '\0' && std::string(env) != "0";
  auto mesh = test_mesh();
  const st::Comm comm = mesh.comm(0);
  const int P = comm::transport::comm_size(comm);
  const int me = comm::transport::comm_rank(comm);
  const int64_t n = 10, b = n * static_cast<int64_t>(sizeof(double));
  auto staged = [&](int64_t copies) { return forced ? copies * b : int64_t{0}; };

  // In place: copied in and back.
  st::reset_comm_stats();
  at::Tensor t = at::full({n}, double(me + 1), at::kDouble);
  comm::transport::all_reduce_(t, ReduceOp::Sum, comm);
  EXPECT_EQ(st::comm_stats().staged_bytes, staged(2));
  EXPECT_TRUE(t.equal(at::full({n}, P * (P + 1) / 2.0, at::kDouble)));

  // Split-phase reduction: copied back only by finish().
  st::reset_comm_stats();
  at::Tensor u = at::full({n}, double(me + 1), at::kDouble);
  auto pending = comm::transport::start_all_reduce_(u, ReduceOp::Sum, comm);
  EXPECT_EQ(pending.pending(), P > 1 || forced);
  pending.finish();
  EXPECT_EQ(st::comm_stats().staged_bytes, staged(2));
  EXPECT_TRUE(u.equal(at::full({n}, P * (P + 1) / 2.0, at::kDouble)));

  // A ring exchange: the send is copied in, the receive (written whole) only back.
  st::reset_comm_stats();
  at::Tensor send = at::full({n}, double(me), at::kDouble);
  at::Tensor recv = at::full({n}, -1.0, at::kDouble);
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  auto ex = comm::transport::start_exchange({{next, send}}, {{prev, recv}}, comm);
  ex.finish();
  EXPECT_EQ(st::comm_stats().staged_bytes, staged(2));
  EXPECT_TRUE(recv.equal(at::full({n}, double(prev), at::kDouble)));

  // An all-gatherv into a larger buffer: only the bytes it writes go back,
  // the others keep their values.
  st::reset_comm_stats();
  at::Tensor piece = at::full({n}, double(me), at::kDouble);
  at::Tensor all = at::full({P * n + 3}, 7.0, at::kDouble);
  comm::transport::all_gatherv(piece, all, std::vector<int64_t>(P, b), comm);
  EXPECT_EQ(st::comm_stats().staged_bytes, forced ? b + P * b : 0);
  for (int c = 0; c < P; ++c) {
    EXPECT_TRUE(all.narrow(0, c * n, n).equal(at::full({n}, double(c), at::kDouble)));
  }
  EXPECT_TRUE(all.narrow(0, P * n, 3).equal(at::full({3}, 7.0, at::kDouble)));
}

// ---- all_reduce / all_reduce_nograd / use_replicated ---------------------------

TEST(CommAllReduce, SumsOverEachMeshDimAndOverAllDims) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    at::Tensor x = seeded_randn({3, 4}, 100 + a.me);
    at::Tensor expected = at::zeros({3, 4}, at::kDouble);
    for (int64_t c = 0; c < a.P; ++c) {
      expected += seeded_randn({3, 4}, 100 + c);
    }
    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor out = comm::all_reduce(xr, mesh, {a.mesh_dim});
    EXPECT_TRUE(all_close(out, expected));
    EXPECT_TRUE(all_close(x, xr.detach())) << "the input was modified";
    at::Tensor g = seeded_randn({3, 4}, 7);
    out.backward(g);
    EXPECT_TRUE(all_close(xr.grad(), g)) << "backward must be the identity";
  }
  // Every mesh dim at once (the whole mesh on a 2x2 mesh).
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    dims.push_back(m);
  }
  at::Tensor x = seeded_randn({5}, 200 + mesh.rank());
  at::Tensor expected = at::zeros({5}, at::kDouble);
  for (int64_t r = 0; r < mesh.size(); ++r) {
    expected += seeded_randn({5}, 200 + r);
  }
  EXPECT_TRUE(all_close(comm::all_reduce(x, mesh, dims), expected));
  // No mesh dims: the identity.
  EXPECT_TRUE(all_close(comm::all_reduce(x, mesh, {}), x));
}

TEST(CommAllReduce, NogradEveryDtypeAndOp) {
  auto mesh = test_mesh();
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble,  at::kInt,   at::kLong,
                                              at::kByte,  at::kChar,    at::kShort, at::kBool,
                                              at::kHalf,  at::kBFloat16};
  const std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min,
                                     ReduceOp::Product};
  for (const Axis& a : axes(mesh)) {
    for (auto dtype : dtypes) {
      for (auto op : ops) {
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " dtype " +
                     std::string(c10::toString(dtype)) + " op " +
                     std::to_string(static_cast<int>(op)));
        // Small integers (exact in every dtype): coordinate c holds (i + c) % 3 + 1.
        auto value = [&](int64_t c) {
          at::Tensor v = (at::arange(6, at::kLong) + c).remainder(3) + 1;
          return dtype == at::kBool ? (v == 2) : v;
        };
        at::Tensor expected = value(0);
        for (int64_t c = 1; c < a.P; ++c) {
          at::Tensor v = value(c);
          if (dtype == at::kBool) {
            expected =
                (op == ReduceOp::Sum || op == ReduceOp::Max) ? (expected | v) : (expected & v);
          } else if (op == ReduceOp::Sum) {
            expected = expected + v;
          } else if (op == ReduceOp::Max) {
            expected = at::maximum(expected, v);
          } else if (op == ReduceOp::Min) {
            expected = at::minimum(expected, v);
          } else {
            expected = expected * v;
          }
        }
        at::Tensor x = value(a.me).to(dtype);
        at::Tensor out = comm::all_reduce_nograd(x, mesh, {a.mesh_dim}, op);
        bool ok = out.scalar_type() == dtype && out.equal(expected.to(dtype)) &&
                  !out.requires_grad() && x.equal(value(a.me).to(dtype));
        EXPECT_TRUE(all_ranks(ok)) << "got " << out << " expected " << expected;
      }
    }
  }
  // Complex sums are supported (the FFT rules keep Partial complex values);
  // an order (Max/Min) means nothing for complex numbers and throws before
  // communicating, on every rank.
  for (auto dtype : {at::kComplexFloat, at::kComplexDouble}) {
    at::Tensor z = at::complex(at::full({2}, 1.0), at::full({2}, -2.0)).to(dtype);
    at::Tensor s = comm::all_reduce_nograd(z, mesh, {0}, ReduceOp::Sum);
    EXPECT_TRUE(
        all_ranks(s.scalar_type() == dtype && s.equal(z * static_cast<double>(mesh.size(0)))))
        << s;
    EXPECT_THROW(comm::all_reduce_nograd(z, mesh, {0}, ReduceOp::Max), c10::Error);
  }
  // Note [complex sums]: infinite parts add componentwise, as at::sum over
  // the stacked contributions does (libtorch's a + b gives nan+nan i for
  // 0 + (inf+inf i)): the last coordinate holds the infinities, the others
  // zero or finite values, and one element mixes +inf with -inf (NaN).
  const double inf = std::numeric_limits<double>::infinity();
  for (auto dtype : {at::kComplexFloat, at::kComplexDouble}) {
    for (const Axis& a : axes(mesh)) {
      auto value = [&](int64_t c) {
        if (c == a.P - 1) {
          return at::complex(at::tensor({inf, 1.0, -inf, 2.0}, at::kDouble),
                             at::tensor({inf, inf, 0.0, -inf}, at::kDouble))
              .to(dtype);
        }
        return at::complex(at::tensor({0.0, -1.0, static_cast<double>(c), inf}, at::kDouble),
                           at::tensor({0.0, -1.0, 0.5, 1.0}, at::kDouble))
            .to(dtype);
      };
      std::vector<at::Tensor> all;
      for (int64_t c = 0; c < a.P; ++c) all.push_back(value(c));
      at::Tensor expected = at::stack(all).sum(0);
      at::Tensor out = comm::all_reduce_nograd(value(a.me), mesh, {a.mesh_dim}, ReduceOp::Sum);
      EXPECT_TRUE(all_close(out, expected, 0.0, 0.0))
          << "mesh dim " << a.mesh_dim << " " << c10::toString(dtype);
    }
  }
}

TEST(CommAllReduce, Adjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    // Partial input (per-rank summands) -> replicated output (identical cotangent).
    at::Tensor x = seeded_randn({4, 3}, 300 + a.me);
    at::Tensor y = seeded_randn({4, 3}, 301);
    EXPECT_TRUE(
        adjoint([&](const at::Tensor& t) { return comm::all_reduce(t, mesh, {a.mesh_dim}); }, x, y,
                Pairing::SumOverRanks, Pairing::Once, a.comm))
        << "mesh dim " << a.mesh_dim;
  }
}

TEST(CommUseReplicated, IdentityForwardSumBackward) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    at::Tensor x = seeded_randn({2, 5}, 400);
    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor out = comm::use_replicated(xr, mesh, {a.mesh_dim});
    EXPECT_TRUE(all_close(out, x));
    at::Tensor g = seeded_randn({2, 5}, 410 + a.me);
    at::Tensor expected = at::zeros({2, 5}, at::kDouble);
    for (int64_t c = 0; c < a.P; ++c) {
      expected += seeded_randn({2, 5}, 410 + c);
    }
    out.backward(g);
    EXPECT_TRUE(all_close(xr.grad(), expected));
    // Replicated input -> per-rank use (per-rank cotangents).
    EXPECT_TRUE(
        adjoint([&](const at::Tensor& t) { return comm::use_replicated(t, mesh, {a.mesh_dim}); }, x,
                seeded_randn({2, 5}, 420 + a.me), Pairing::Once, Pairing::SumOverRanks, a.comm,
                /*x_grad_replicated=*/true));
  }
}

// ---- all_gather / shard_slice / reduce_scatter / replicate_to_partial ----------

TEST(CommAllGather, ForwardAndAdjointEveryPartitionAndDim) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      for (int64_t dim : {0, 1, 2}) {
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) + " dim " +
                     std::to_string(dim));
        const int64_t n = total(sizes);
        auto off = offsets(sizes);
        at::Tensor full = seeded_randn(shape3(dim, n), 500 + dim);
        at::Tensor local = full.narrow(dim, off[a.me], sizes[a.me]);
        EXPECT_TRUE(all_close(comm::all_gather(local, mesh, a.mesh_dim, dim, sizes), full));
        // Negative dims wrap like libtorch's.
        EXPECT_TRUE(all_close(comm::all_gather(local, mesh, a.mesh_dim, dim - 3, sizes), full));
        // Sharded input -> replicated output.
        EXPECT_TRUE(adjoint(
            [&](const at::Tensor& t) { return comm::all_gather(t, mesh, a.mesh_dim, dim, sizes); },
            local, seeded_randn(shape3(dim, n), 510), Pairing::SumOverRanks, Pairing::Once,
            a.comm));
      }
    }
  }
}

TEST(CommAllGather, OtherDtypes) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = balanced(2 * a.P + 1, a.P);
    auto off = offsets(sizes);
    for (auto dtype : {at::kFloat, at::kLong, at::kBool, at::kHalf}) {
      at::Tensor full = (seeded_randn({4, 2 * a.P + 1}, 520) * 10).to(dtype);
      at::Tensor out =
          comm::all_gather(full.narrow(1, off[a.me], sizes[a.me]), mesh, a.mesh_dim, 1, sizes);
      EXPECT_TRUE(all_ranks(out.scalar_type() == dtype && out.equal(full)))
          << "dtype " << dtype << " mesh dim " << a.mesh_dim;
    }
  }
}

// Note [strided gather]: a gather along an inner dim allocates the result and
// one piece-sized send buffer, not a second full-size (transposed) copy.
TEST(CommAllGather, InnerDimNeedsNoFullSizeCopy) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = balanced(64 * a.P + 3, a.P);
    auto off = offsets(sizes);
    at::Tensor full = seeded_randn({6, 5, total(sizes), 7}, 530);
    at::Tensor local = full.narrow(2, off[a.me], sizes[a.me]);
    const int64_t full_bytes = full.numel() * 8;
    const int64_t piece_bytes = local.numel() * 8;
    at::Tensor out;
    const int64_t base = st::memory_stats().current_bytes;
    st::reset_peak_memory_stats();
    {
      at::NoGradGuard no_grad;
      out = comm::all_gather(local, mesh, a.mesh_dim, 2, sizes);
    }
    const int64_t peak = st::memory_stats().peak_bytes - base;
    EXPECT_TRUE(out.equal(full)) << "mesh dim " << a.mesh_dim;
    // Under MPI a vector datatype places the rows (Note [strided gather]);
    // the c10d transport gathers contiguously and then places the rows, one
    // more result-sized buffer (Note [c10d data movement]).
    const bool mpi = st::detail::transport() == "mpi";
    // SHARDTENSOR_STAGE_HOST=1 (test_comm.staged.*, Note [host staging]):
    // host copies of the send piece and of the result, from the same allocator.
    const char* env = std::getenv("SHARDTENSOR_STAGE_HOST");
    const bool staged = env != nullptr && *env != '\0' && std::string(env) != "0";
    const int64_t staging = staged ? full_bytes + piece_bytes : 0;
    EXPECT_LE(peak, (mpi ? 1 : 2) * full_bytes + piece_bytes + staging + 4096)
        << "mesh dim " << a.mesh_dim << ": peak " << peak << " for a result of " << full_bytes
        << " bytes and a piece of " << piece_bytes << " (transport " << st::detail::transport()
        << ")";
  }
}

TEST(CommShardSlice, ForwardAndAdjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      for (int64_t dim : {0, 2}) {
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) + " dim " +
                     std::to_string(dim));
        const int64_t n = total(sizes);
        auto off = offsets(sizes);
        at::Tensor full = seeded_randn(shape3(dim, n), 600);
        EXPECT_TRUE(all_close(comm::shard_slice(full, mesh, a.mesh_dim, dim, sizes),
                              full.narrow(dim, off[a.me], sizes[a.me])));
        // Replicated input (full gradient on every rank) -> sharded output.
        EXPECT_TRUE(adjoint(
            [&](const at::Tensor& t) { return comm::shard_slice(t, mesh, a.mesh_dim, dim, sizes); },
            full, seeded_randn(shape3(dim, sizes[a.me]), 610 + a.me), Pairing::Once,
            Pairing::SumOverRanks, a.comm, /*x_grad_replicated=*/true));
      }
    }
  }
}

TEST(CommReduceScatter, ForwardAndAdjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      for (int64_t dim : {0, 1}) {
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) + " dim " +
                     std::to_string(dim));
        const int64_t n = total(sizes);
        auto off = offsets(sizes);
        at::Tensor x = seeded_randn(shape3(dim, n), 700 + a.me);
        at::Tensor sum = at::zeros(shape3(dim, n), at::kDouble);
        for (int64_t c = 0; c < a.P; ++c) {
          sum += seeded_randn(shape3(dim, n), 700 + c);
        }
        EXPECT_TRUE(all_close(comm::reduce_scatter(x, mesh, a.mesh_dim, dim, sizes),
                              sum.narrow(dim, off[a.me], sizes[a.me])));
        // Partial input -> sharded output.
        EXPECT_TRUE(adjoint(
            [&](const at::Tensor& t) {
              return comm::reduce_scatter(t, mesh, a.mesh_dim, dim, sizes);
            },
            x, seeded_randn(shape3(dim, sizes[a.me]), 710 + a.me), Pairing::SumOverRanks,
            Pairing::SumOverRanks, a.comm));
      }
    }
  }
}

TEST(CommReplicateToPartial, ForwardAndAdjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    at::Tensor x = seeded_randn({3, 2}, 800);
    at::Tensor out = comm::replicate_to_partial(x, mesh, a.mesh_dim);
    EXPECT_TRUE(all_close(out, a.me == 0 ? x : at::zeros_like(x)));
    // Replicated input -> partial output (whose gradient is replicated).
    EXPECT_TRUE(adjoint(
        [&](const at::Tensor& t) { return comm::replicate_to_partial(t, mesh, a.mesh_dim); }, x,
        seeded_randn({3, 2}, 810), Pairing::Once, Pairing::SumOverRanks, a.comm,
        /*x_grad_replicated=*/true));
  }
}

// ---- all_to_all / repartition ---------------------------------------------------

TEST(CommAllToAll, ShardToShardForwardAndAdjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto parts = partitions(a.P);
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto& src_sizes = parts[i];
      const auto& dst_sizes = parts[(i + 1) % parts.size()];
      for (auto dims : {std::pair<int64_t, int64_t>{0, 1}, {1, 0}, {2, 0}}) {
        const int64_t sd = dims.first, dd = dims.second;
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " src " + str(src_sizes) + " dst " +
                     str(dst_sizes) + " dims " + std::to_string(sd) + "->" + std::to_string(dd));
        std::vector<int64_t> shape = {2, 3, 2};
        shape[sd] = total(src_sizes);
        shape[dd] = total(dst_sizes);
        auto so = offsets(src_sizes), doff = offsets(dst_sizes);
        at::Tensor full = seeded_randn(shape, 900);
        at::Tensor local = full.narrow(sd, so[a.me], src_sizes[a.me]);
        at::Tensor out = comm::all_to_all(local, mesh, a.mesh_dim, sd, src_sizes, dd, dst_sizes);
        EXPECT_TRUE(all_close(out, full.narrow(dd, doff[a.me], dst_sizes[a.me])));
        at::Tensor y =
            seeded_randn(full.narrow(dd, doff[a.me], dst_sizes[a.me]).sizes(), 910 + a.me);
        EXPECT_TRUE(adjoint(
            [&](const at::Tensor& t) {
              return comm::all_to_all(t, mesh, a.mesh_dim, sd, src_sizes, dd, dst_sizes);
            },
            local, y, Pairing::SumOverRanks, Pairing::SumOverRanks, a.comm));
      }
    }
  }
}

TEST(CommAllToAll, RebalancingSameDim) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    const int64_t n = 3 * a.P + 2;
    std::vector<int64_t> src(a.P, 0);  // everything on the last coordinate but 1 element
    src[a.P - 1] = n - (a.P > 1 ? 1 : 0);
    src[0] += a.P > 1 ? 1 : 0;
    auto dst = balanced(n, a.P);
    auto so = offsets(src), doff = offsets(dst);
    at::Tensor full = seeded_randn({3, n}, 950);
    at::Tensor local = full.narrow(1, so[a.me], src[a.me]);
    EXPECT_TRUE(all_close(comm::all_to_all(local, mesh, a.mesh_dim, 1, src, 1, dst),
                          full.narrow(1, doff[a.me], dst[a.me])))
        << "mesh dim " << a.mesh_dim;
    EXPECT_TRUE(adjoint(
        [&](const at::Tensor& t) { return comm::all_to_all(t, mesh, a.mesh_dim, 1, src, 1, dst); },
        local, seeded_randn({3, dst[a.me]}, 960 + a.me), Pairing::SumOverRanks,
        Pairing::SumOverRanks, a.comm));
  }
}

namespace {

/// Blocks of 2 global indices dealt to coordinates: block k goes to
/// deal(k); each coordinate lists its blocks in `reverse` order if asked.
std::vector<std::vector<st::comm::Segment>> dealt(int64_t n, int64_t P,
                                                  const std::function<int64_t(int64_t)>& deal,
                                                  bool reverse) {
  std::vector<std::vector<st::comm::Segment>> seg(P);
  for (int64_t k = 0; 2 * k < n; ++k) {
    seg[deal(k)].push_back({2 * k, std::min<int64_t>(2, n - 2 * k)});
  }
  if (reverse) {
    for (auto& s : seg) {
      std::reverse(s.begin(), s.end());
    }
  }
  return seg;
}

at::Tensor take_runs(const at::Tensor& full, int64_t dim,
                     const std::vector<st::comm::Segment>& runs) {
  std::vector<at::Tensor> parts;
  for (const auto& s : runs) {
    parts.push_back(full.narrow(dim, s.start, s.length));
  }
  if (parts.empty()) {
    return full.narrow(dim, 0, 0);
  }
  return at::cat(parts, dim);
}

}  // namespace

TEST(CommRepartition, SeveralRunsPerRankForwardAndAdjoint) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    const int64_t P = a.P, n = 4 * P + 3;
    std::vector<std::function<int64_t(int64_t)>> deals = {
        [P](int64_t k) { return k % P; },            // round robin
        [P](int64_t k) { return P - 1 - (k % P); },  // reversed
        [P](int64_t k) {
          return P == 1 ? 0 : (k % (P - 1) >= 1 ? k % (P - 1) + 1 : 0);
        },  // 1 empty
    };
    std::vector<std::vector<int64_t>> dsts = {balanced(n, P), partitions(P)[1]};
    // partitions(P)[1] sums to a different n; rescale it to n by giving the rest to the last.
    {
      auto& d = dsts[1];
      int64_t s = total(d);
      d[P - 1] += n - s;
      if (d[P - 1] < 0) {
        d = balanced(n, P);
      }
    }
    for (size_t di = 0; di < deals.size(); ++di) {
      for (bool reverse : {false, true}) {
        for (const auto& dst : dsts) {
          SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " deal " + std::to_string(di) +
                       (reverse ? " reversed" : "") + " dst " + str(dst));
          auto seg = dealt(n, P, deals[di], reverse);
          auto doff = offsets(dst);
          at::Tensor full = seeded_randn({2, n, 3}, 1000);
          at::Tensor local = take_runs(full, 1, seg[a.me]);
          EXPECT_TRUE(all_close(comm::repartition(local, mesh, a.mesh_dim, 1, seg, dst),
                                full.narrow(1, doff[a.me], dst[a.me])));
          EXPECT_TRUE(adjoint(
              [&](const at::Tensor& t) {
                return comm::repartition(t, mesh, a.mesh_dim, 1, seg, dst);
              },
              local, seeded_randn({2, dst[a.me], 3}, 1010 + a.me), Pairing::SumOverRanks,
              Pairing::SumOverRanks, a.comm));
        }
      }
    }
    // Runs that overlap or leave a gap are rejected on every rank before communicating.
    auto seg = dealt(n, P, deals[0], false);
    auto bad = seg;
    bad[0].push_back({0, 1});  // overlap
    at::Tensor full = seeded_randn({2, n, 3}, 1000);
    EXPECT_TRUE(throws_with(
        [&] {
          comm::repartition(take_runs(full, 1, bad[a.me]), mesh, a.mesh_dim, 1, bad,
                            balanced(n, P));
        },
        "repartition"));
    EXPECT_THROW(comm::repartition(take_runs(full, 1, seg[a.me]), mesh, a.mesh_dim, 1, seg,
                                   balanced(n + 1, P)),
                 c10::Error);
  }
}

// Plans are built once per layout and reused, the adjoint's inverse plan too
// (Note [repartition plan cache]); the dtype and the other extents are not
// part of a plan.
TEST(CommRepartition, PlansAreCached) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    const int64_t P = a.P, n = 2 * P + 1;
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    auto seg = dealt(
        n, P, [P](int64_t k) { return (k + 1) % P; }, /*reverse=*/true);
    const auto dst = balanced(n, P);
    const auto doff = offsets(dst);
    const auto src = balanced(3 * P + 2, P);  // for all_to_all: Shard(0) -> Shard(1)
    const auto soff = offsets(src);
    const auto dst2 = balanced(n, P);
    auto step = [&](at::ScalarType dtype, int64_t extent) {
      // repartition, forward and backward.
      at::Tensor full = seeded_randn({extent, n}, 1400).to(dtype);
      at::Tensor x = take_runs(full, 1, seg[a.me]).detach().requires_grad_(true);
      at::Tensor out = comm::repartition(x, mesh, a.mesh_dim, 1, seg, dst);
      EXPECT_TRUE(all_close(out, full.narrow(1, doff[a.me], dst[a.me])));
      at::Tensor w = seeded_randn({extent, n}, 1410).to(dtype);
      (out * w.narrow(1, doff[a.me], dst[a.me])).sum().backward();
      EXPECT_TRUE(all_close(x.grad(), take_runs(w, 1, seg[a.me])));
      // all_to_all Shard(0) -> Shard(1), forward and backward.
      at::Tensor full2 = seeded_randn({3 * P + 2, n, extent}, 1420).to(dtype);
      at::Tensor x2 = full2.narrow(0, soff[a.me], src[a.me]).detach().requires_grad_(true);
      at::Tensor out2 = comm::all_to_all(x2, mesh, a.mesh_dim, 0, src, 1, dst2);
      EXPECT_TRUE(all_close(out2, full2.narrow(1, doff[a.me], dst2[a.me])));
      at::Tensor w2 = seeded_randn({3 * P + 2, n, extent}, 1430).to(dtype);
      (out2 * w2.narrow(1, doff[a.me], dst2[a.me])).sum().backward();
      EXPECT_TRUE(all_close(x2.grad(), w2.narrow(0, soff[a.me], src[a.me])));
    };
    step(at::kFloat, 2);  // builds the plans and their inverses
    const size_t rep = comm::repartition_plan_cache_size();
    const size_t a2a = comm::all_to_all_plan_cache_size();
    step(at::kFloat, 2);
    step(at::kDouble, 3);  // another dtype and other extents: the same plans
    EXPECT_TRUE(all_ranks(comm::repartition_plan_cache_size() == rep))
        << rep << " -> " << comm::repartition_plan_cache_size() << " repartition plans";
    EXPECT_TRUE(all_ranks(comm::all_to_all_plan_cache_size() == a2a))
        << a2a << " -> " << comm::all_to_all_plan_cache_size() << " all-to-all plans";
    // Another layout: one more forward plan (and its inverse once differentiated).
    at::Tensor full = seeded_randn({2, n + 1}, 1440);
    auto seg2 = dealt(
        n + 1, P, [P](int64_t k) { return k % P; }, false);
    EXPECT_TRUE(
        all_close(comm::repartition(take_runs(full, 1, seg2[a.me]), mesh, a.mesh_dim, 1, seg2,
                                    balanced(n + 1, P)),
                  full.narrow(1, offsets(balanced(n + 1, P))[a.me], balanced(n + 1, P)[a.me])));
    const size_t after = comm::repartition_plan_cache_size();
    EXPECT_TRUE(all_ranks(after == rep + 1 || after == 1));  // 1: the bounded cache was cleared
  }
}

// ---- box_exchange ------------------------------------------------------------------

namespace {

using Box = st::comm::Box;

/// Boxes that split tensor dim `dim` of `shape` by `sizes` (coordinate c gets
/// run order[c] of the split; order empty: c), the full extent elsewhere.
std::vector<Box> slab_boxes(const std::vector<int64_t>& shape, int64_t dim,
                            const std::vector<int64_t>& sizes,
                            const std::vector<int64_t>& order = {}) {
  auto off = offsets(sizes);
  std::vector<Box> out;
  for (size_t c = 0; c < sizes.size(); ++c) {
    const size_t k = order.empty() ? c : static_cast<size_t>(order[c]);
    Box b;
    for (size_t d = 0; d < shape.size(); ++d) {
      b.push_back(static_cast<int64_t>(d) == dim ? st::comm::Segment{off[k], sizes[k]}
                                                 : st::comm::Segment{0, shape[d]});
    }
    out.push_back(b);
  }
  return out;
}

at::Tensor take_box(const at::Tensor& full, const Box& b) {
  at::Tensor v = full;
  for (size_t d = 0; d < b.size(); ++d) {
    v = v.narrow(static_cast<int64_t>(d), b[d].start, b[d].length);
  }
  return v;
}

int64_t box_numel(const Box& b) {
  int64_t n = 1;
  for (const auto& r : b) n *= r.length;
  return n;
}

/// This rank's row-major coordinate over all mesh dims (the group of box_exchange over them).
int64_t all_dims_coordinate(const st::DeviceMesh& mesh) {
  int64_t me = 0;
  for (int64_t m = 0; m < mesh.ndim(); ++m) me = me * mesh.size(m) + mesh.coordinate()[m];
  return me;
}

std::vector<int64_t> all_mesh_dims(const st::DeviceMesh& mesh) {
  std::vector<int64_t> dims(mesh.ndim());
  std::iota(dims.begin(), dims.end(), 0);
  return dims;
}

/// Boxes over P coordinates of a [n0, n1, 2] tensor that cut dims 0 and 1 in
/// a grid of q0 x q1 blocks with the splits s0, s1 (coordinate c: block
/// (c / q1, c % q1)), or, read in `reversed` order, block P - 1 - c.
std::vector<Box> grid_boxes(const std::vector<int64_t>& s0, const std::vector<int64_t>& s1,
                            int64_t last, bool reversed) {
  auto o0 = offsets(s0), o1 = offsets(s1);
  const int64_t q0 = static_cast<int64_t>(s0.size()), q1 = static_cast<int64_t>(s1.size());
  std::vector<Box> out;
  for (int64_t c = 0; c < q0 * q1; ++c) {
    const int64_t k = reversed ? q0 * q1 - 1 - c : c;
    const int64_t i = k / q1, j = k % q1;
    out.push_back({{o0[i], s0[i]}, {o1[j], s1[j]}, {0, last}});
  }
  return out;
}

}  // namespace

// With one mesh dim and slab boxes, box_exchange is all_to_all (and rebalancing).
TEST(CommBoxExchange, OneMeshDimEqualsAllToAll) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto parts = partitions(a.P);
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto& src_sizes = parts[i];
      const auto& dst_sizes = parts[(i + 1) % parts.size()];
      for (auto dims : {std::pair<int64_t, int64_t>{0, 1}, {1, 0}, {2, 0}}) {
        const int64_t sd = dims.first, dd = dims.second;
        SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " src " + str(src_sizes) + " dst " +
                     str(dst_sizes) + " dims " + std::to_string(sd) + "->" + std::to_string(dd));
        std::vector<int64_t> shape = {2, 3, 2};
        shape[sd] = total(src_sizes);
        shape[dd] = total(dst_sizes);
        auto src = slab_boxes(shape, sd, src_sizes), dst = slab_boxes(shape, dd, dst_sizes);
        for (auto dtype : {at::kDouble, at::kFloat}) {
          at::Tensor full = seeded_randn(shape, 1100, dtype);
          at::Tensor local = take_box(full, src[a.me]);
          at::Tensor out = comm::box_exchange(local, mesh, {a.mesh_dim}, src, dst);
          at::Tensor ref = comm::all_to_all(local, mesh, a.mesh_dim, sd, src_sizes, dd, dst_sizes);
          EXPECT_TRUE(all_ranks(out.scalar_type() == dtype && at::equal(out, ref)));
          EXPECT_TRUE(all_close(out, take_box(full, dst[a.me])));
        }
        at::Tensor full = seeded_randn(shape, 1100);
        at::Tensor local = take_box(full, src[a.me]);
        EXPECT_TRUE(adjoint(
            [&](const at::Tensor& t) {
              return comm::box_exchange(t, mesh, {a.mesh_dim}, src, dst);
            },
            local, seeded_randn(take_box(full, dst[a.me]).sizes(), 1110 + a.me),
            Pairing::SumOverRanks, Pairing::SumOverRanks, a.comm));
      }
    }
    // Same dim: a rebalancing.
    const int64_t n = 3 * a.P + 2;
    std::vector<int64_t> shape = {3, n};
    auto src = slab_boxes(shape, 1, balanced(n, a.P));
    auto rebal = partitions(a.P)[1];  // with an empty piece
    rebal[a.P - 1] += n - total(rebal);
    auto dst = slab_boxes(shape, 1, rebal);
    at::Tensor full = seeded_randn(shape, 1120);
    at::Tensor local = take_box(full, src[a.me]);
    EXPECT_TRUE(all_close(comm::box_exchange(local, mesh, {a.mesh_dim}, src, dst),
                          take_box(full, dst[a.me])));
  }
}

// Several mesh dims at once (the whole mesh: 1-D, or both dims of 2x2):
// slabs to grid blocks, grid blocks to reversed grid blocks, with empty
// blocks; forward, adjoint, bytes (at most the piece, what stays is not sent)
// and the gradient through ordinary backward.
TEST(CommBoxExchange, AllMeshDimsSlabsAndGridsWithEmptyBlocks) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size(), me = all_dims_coordinate(mesh);
  const auto dims = all_mesh_dims(mesh);
  st::Comm world = mesh.comm();
  // A grid of q0 x q1 blocks with q0 * q1 = P.
  const int64_t q0 = P % 2 == 0 ? 2 : 1, q1 = P / q0;
  std::vector<int64_t> s0 = q0 == 2 ? std::vector<int64_t>{0, 3} : std::vector<int64_t>{3};
  std::vector<int64_t> s1 = balanced(2 * q1 + 1, q1);
  const int64_t n0 = total(s0), n1 = total(s1);
  std::vector<int64_t> shape = {n0, n1, 2};
  std::vector<int64_t> slab_sizes = partitions(P)[1];
  slab_sizes[P - 1] += n1 - total(slab_sizes);
  if (slab_sizes[P - 1] < 0) slab_sizes = balanced(n1, P);
  const std::vector<std::pair<std::vector<Box>, std::vector<Box>>> layouts = {
      {slab_boxes(shape, 1, slab_sizes), grid_boxes(s0, s1, 2, false)},
      {grid_boxes(s0, s1, 2, false), grid_boxes(s0, s1, 2, true)},
      {grid_boxes(s0, s1, 2, true), slab_boxes(shape, 0, balanced(n0, P))},
  };
  for (size_t l = 0; l < layouts.size(); ++l) {
    SCOPED_TRACE("layout " + std::to_string(l));
    const auto& [src, dst] = layouts[l];
    at::Tensor full = seeded_randn(shape, 1200);
    at::Tensor local = take_box(full, src[me]);
    st::reset_comm_stats();
    at::Tensor out = comm::box_exchange(local, mesh, dims, src, dst);
    const st::CommStats s = st::comm_stats();
    EXPECT_TRUE(all_close(out, take_box(full, dst[me])));
    // What stays: src[me] & dst[me].
    Box keep;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t lo = std::max(src[me][d].start, dst[me][d].start);
      const int64_t hi =
          std::min(src[me][d].start + src[me][d].length, dst[me][d].start + dst[me][d].length);
      keep.push_back({lo, std::max<int64_t>(0, hi - lo)});
    }
    const int64_t kept = box_numel(keep) * 8;
    const bool ok = s.bytes_sent == local.numel() * 8 - kept &&
                    s.bytes_received == out.numel() * 8 - kept && s.gathered_bytes == 0;
    EXPECT_TRUE(all_ranks(ok)) << "sent " << s.bytes_sent << " received " << s.bytes_received
                               << " kept " << kept;
    EXPECT_TRUE(adjoint(
        [&](const at::Tensor& t) { return comm::box_exchange(t, mesh, dims, src, dst); }, local,
        seeded_randn(out.sizes(), 1210 + me), Pairing::SumOverRanks, Pairing::SumOverRanks, world));
    // The gradient of sum(w * out) is w's piece in the source layout.
    at::Tensor w = seeded_randn(shape, 1220);
    at::Tensor x = local.detach().clone().requires_grad_(true);
    (comm::box_exchange(x, mesh, dims, src, dst) * take_box(w, dst[me])).sum().backward();
    EXPECT_TRUE(all_close(x.grad(), take_box(w, src[me])));
  }
  // The mesh dims in any order name the same group.
  if (mesh.ndim() == 2) {
    const auto& [src, dst] = layouts[1];
    at::Tensor full = seeded_randn(shape, 1230);
    EXPECT_TRUE(all_close(comm::box_exchange(take_box(full, src[me]), mesh, {1, 0}, src, dst),
                          take_box(full, dst[me])));
  }
}

// A plan is built once per layout and reused (Note [box exchange plan cache]).
TEST(CommBoxExchange, PlansAreCached) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size(), me = all_dims_coordinate(mesh);
  const auto dims = all_mesh_dims(mesh);
  std::vector<int64_t> shape = {P + 3, 2 * P + 1};
  auto src = slab_boxes(shape, 0, balanced(P + 3, P));
  auto dst = slab_boxes(shape, 1, balanced(2 * P + 1, P));
  at::Tensor full = seeded_randn(shape, 1300);
  comm::box_exchange(take_box(full, src[me]), mesh, dims, src, dst);
  const size_t before = comm::box_plan_cache_size();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(all_close(comm::box_exchange(take_box(full, src[me]), mesh, dims, src, dst),
                          take_box(full, dst[me])));
  }
  EXPECT_TRUE(all_ranks(comm::box_plan_cache_size() == before));
  // Another layout (another shape): one more plan.
  std::vector<int64_t> shape2 = {P + 4, 2 * P + 1};
  auto src2 = slab_boxes(shape2, 0, balanced(P + 4, P));
  at::Tensor full2 = seeded_randn(shape2, 1310);
  comm::box_exchange(take_box(full2, src2[me]), mesh, dims, src2,
                     slab_boxes(shape2, 1, balanced(2 * P + 1, P)));
  const size_t after = comm::box_plan_cache_size();
  EXPECT_TRUE(all_ranks(after == before + 1 || after == 1));  // 1: the bounded cache was cleared
}

// Bad boxes throw on every rank before communicating.
TEST(CommBoxExchange, BadBoxesThrowOnEveryRank) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size(), me = all_dims_coordinate(mesh);
  const auto dims = all_mesh_dims(mesh);
  std::vector<int64_t> shape = {P + 2, 3};
  auto src = slab_boxes(shape, 0, balanced(P + 2, P));
  auto dst = slab_boxes(shape, 1, balanced(3, P));
  at::Tensor full = seeded_randn(shape, 1400);
  at::Tensor local = take_box(full, src[me]);
  auto expect_throw = [&](const std::vector<Box>& s, const std::vector<Box>& d, const at::Tensor& t,
                          const std::string& needle) {
    EXPECT_TRUE(all_ranks(
        static_cast<bool>(throws_with([&] { comm::box_exchange(t, mesh, dims, s, d); }, needle))))
        << needle;
  };
  auto too_few = dst;
  too_few.pop_back();
  expect_throw(src, too_few, local, "boxes but the mesh dims have");
  auto short_box = dst;
  short_box[0].pop_back();
  expect_throw(src, short_box, local, "runs but the local tensor has");
  auto negative = dst;
  negative[0][1] = {-1, 1};
  expect_throw(src, negative, local, "negative");
  auto grown = dst;  // dst[0] grows over its neighbour (or past the source boxes when P == 1)
  grown[0][1].length += 1;
  expect_throw(src, grown, local, P == 1 ? "not covered" : "overlap");
  auto shrunk = dst;  // a gap
  shrunk[0][0].length -= 1;
  expect_throw(src, shrunk, local, "not covered");
  at::Tensor wrong = at::zeros({local.size(0) + 1, 3}, local.options());
  expect_throw(src, dst, wrong, "the local tensor has shape");
  EXPECT_TRUE(all_ranks(static_cast<bool>(throws_with(
      [&] { comm::box_exchange(local, mesh, {}, src, dst); }, "at least one mesh dim"))));
}

// ---- gather_range / halo_exchange ---------------------------------------------

TEST(CommGatherRange, HaloExchangeMatchesTorchPadEveryMode) {
  auto mesh = test_mesh();
  const std::vector<std::pair<int64_t, int64_t>> widths = {{1, 1}, {2, 0}, {0, 3}, {1, 2},
                                                           {3, 1}, {4, 4}, {0, 0}};
  int checked = 0;
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      const int64_t n = total(sizes);
      auto off = offsets(sizes);
      for (int64_t dim : {0, 2}) {
        at::Tensor full = seeded_randn(shape3(dim, n), 1100 + dim);
        at::Tensor local = full.narrow(dim, off[a.me], sizes[a.me]);
        for (PadMode mode : kModes) {
          for (auto [l, r] : widths) {
            Ranges ranges = halo_ranges(sizes, l, r);
            if (!ranges_allowed(mode, n, ranges)) {
              continue;
            }
            SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) +
                         " dim " + std::to_string(dim) + " mode " + mode_str(mode) + " widths " +
                         std::to_string(l) + "," + std::to_string(r));
            at::Tensor out =
                comm::halo_exchange(local, mesh, a.mesh_dim, dim, sizes, l, r, mode, 0.5);
            auto [lo, hi] = ranges[a.me];
            EXPECT_TRUE(all_close(out, padded_slice(full, dim, lo, hi, mode, 0.5)));
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

TEST(CommGatherRange, RandomRangesTrimsAndMultiHopEveryMode) {
  auto mesh = test_mesh();
  std::mt19937 rng(1234);  // identical on every rank
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      const int64_t n = total(sizes);
      auto off = offsets(sizes);
      at::Tensor full = seeded_randn({2, n, 3}, 1200);
      at::Tensor local = full.narrow(1, off[a.me], sizes[a.me]);
      for (PadMode mode : kModes) {
        for (int trial = 0; trial < 6; ++trial) {
          Ranges ranges = random_ranges(rng, n, a.P);
          if (!ranges_allowed(mode, n, ranges)) {
            continue;
          }
          auto [lo, hi] = ranges[a.me];
          SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) +
                       " mode " + mode_str(mode) + " my range [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + ")");
          at::Tensor out =
              comm::gather_range(local, mesh, a.mesh_dim, 1, sizes, ranges, mode, -2.0);
          EXPECT_TRUE(all_close(out, padded_slice(full, 1, lo, hi, mode, -2.0)));
        }
      }
    }
  }
}

TEST(CommGatherRange, NegativeWidthsTrim) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = balanced(3 * a.P + 1, a.P);  // every piece has at least 3 elements
    const int64_t n = total(sizes);
    auto off = offsets(sizes);
    at::Tensor full = seeded_randn({n, 2}, 1300);
    at::Tensor local = full.narrow(0, off[a.me], sizes[a.me]);
    for (auto [l, r] : {std::pair<int64_t, int64_t>{-1, 2}, {2, -1}, {-1, -1}, {-2, 0}}) {
      for (PadMode mode : kModes) {
        Ranges ranges = halo_ranges(sizes, l, r);
        if (!ranges_allowed(mode, n, ranges)) {
          continue;
        }
        auto [lo, hi] = ranges[a.me];
        at::Tensor out = comm::halo_exchange(local, mesh, a.mesh_dim, 0, sizes, l, r, mode);
        EXPECT_TRUE(all_close(out, padded_slice(full, 0, lo, hi, mode, 0.0)))
            << "widths " << l << "," << r << " mode " << mode_str(mode);
      }
    }
  }
}

TEST(CommGatherRange, WrapsSeveralPeriodsAndEmptyDomain) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = partitions(a.P)[1];
    const int64_t n = total(sizes);
    auto off = offsets(sizes);
    at::Tensor full = seeded_randn({n, 2}, 1400);
    at::Tensor local = full.narrow(0, off[a.me], sizes[a.me]);
    // Circular reaches of more than one period.
    Ranges ranges;
    for (int64_t c = 0; c < a.P; ++c) {
      ranges.emplace_back(-2 * n - c, n + 2 * n + 1 + c);
    }
    at::Tensor out =
        comm::gather_range(local, mesh, a.mesh_dim, 0, sizes, ranges, PadMode::Circular);
    EXPECT_TRUE(all_close(out, padded_slice(full, 0, ranges[a.me].first, ranges[a.me].second,
                                            PadMode::Circular, 0.0)));
    EXPECT_TRUE(adjoint(
        [&](const at::Tensor& t) {
          return comm::gather_range(t, mesh, a.mesh_dim, 0, sizes, ranges, PadMode::Circular);
        },
        local, seeded_randn(out.sizes(), 1410 + a.me), Pairing::SumOverRanks, Pairing::SumOverRanks,
        a.comm));
    // An empty domain: only Constant can fill it.
    std::vector<int64_t> zeros(a.P, 0);
    at::Tensor empty = at::zeros({0, 2}, at::kDouble);
    Ranges r2(a.P, {-1, 2});
    EXPECT_TRUE(
        all_close(comm::gather_range(empty, mesh, a.mesh_dim, 0, zeros, r2, PadMode::Constant, 3.5),
                  at::full({3, 2}, 3.5, at::kDouble)));
    EXPECT_TRUE(throws_with(
        [&] { comm::gather_range(empty, mesh, a.mesh_dim, 0, zeros, r2, PadMode::Replicate); },
        "gather_range"));
  }
}

TEST(CommGatherRange, AdjointEveryModeRandomRanges) {
  auto mesh = test_mesh();
  std::mt19937 rng(4321);
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      const int64_t n = total(sizes);
      auto off = offsets(sizes);
      at::Tensor full = seeded_randn({3, n}, 1500);
      at::Tensor local = full.narrow(1, off[a.me], sizes[a.me]);
      for (PadMode mode : kModes) {
        for (int trial = 0; trial < 4; ++trial) {
          // Trial 0: a uniform halo; the others random ranges.
          Ranges ranges = trial == 0 ? halo_ranges(sizes, 2, 1) : random_ranges(rng, n, a.P);
          if (!ranges_allowed(mode, n, ranges)) {
            continue;
          }
          SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) +
                       " mode " + mode_str(mode) + " trial " + std::to_string(trial));
          const int64_t len = ranges[a.me].second - ranges[a.me].first;
          // Sharded input -> per-rank ranges (local dots summed over ranks). The fill
          // value is 0: with another constant the map is affine, not linear.
          EXPECT_TRUE(adjoint(
              [&](const at::Tensor& t) {
                return comm::gather_range(t, mesh, a.mesh_dim, 1, sizes, ranges, mode, 0.0);
              },
              local, seeded_randn({3, len}, 1510 + a.me), Pairing::SumOverRanks,
              Pairing::SumOverRanks, a.comm));
        }
      }
    }
  }
}

TEST(CommGatherRange, ReplicateAndReflectGradientsAccumulateOnOwners) {
  // Many-to-one: with Replicate the edge element feeds every halo position, so
  // its gradient is the sum of theirs; compared with autograd through torch's pad.
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      const int64_t n = total(sizes);
      auto off = offsets(sizes);
      for (PadMode mode : {PadMode::Replicate, PadMode::Reflect, PadMode::Circular}) {
        Ranges ranges = halo_ranges(sizes, 3, 2);
        if (!ranges_allowed(mode, n, ranges)) {
          continue;
        }
        at::Tensor full = seeded_randn({2, n}, 1600).requires_grad_(true);
        // Reference: every rank's range, cotangent seeded by coordinate, summed.
        at::Tensor ref_loss = at::zeros({}, at::kDouble);
        for (int64_t c = 0; c < a.P; ++c) {
          auto [lo, hi] = ranges[c];
          ref_loss = ref_loss + (padded_slice(full, 1, lo, hi, mode, 0.0) *
                                 seeded_randn({2, hi - lo}, 1610 + c))
                                    .sum();
        }
        at::Tensor ref_grad = torch::autograd::grad({ref_loss}, {full})[0];
        at::Tensor local = full.detach().narrow(1, off[a.me], sizes[a.me]).clone();
        local.requires_grad_(true);
        auto [lo, hi] = ranges[a.me];
        at::Tensor out = comm::halo_exchange(local, mesh, a.mesh_dim, 1, sizes, 3, 2, mode);
        out.backward(seeded_randn({2, hi - lo}, 1610 + a.me));
        EXPECT_TRUE(all_close(local.grad(), ref_grad.narrow(1, off[a.me], sizes[a.me])))
            << "mesh dim " << a.mesh_dim << " sizes " << str(sizes) << " mode " << mode_str(mode);
      }
    }
  }
}

// ---- traffic accounting ----------------------------------------------------------

namespace {

/// Brute force: rows that coordinate `c`'s range takes from coordinate `o`'s
/// block, one per position (Constant, Circular and Reflect send every position).
int64_t rows_from(const Ranges& ranges, int64_t c, const std::vector<int64_t>& sizes, int64_t o,
                  PadMode mode) {
  const int64_t n = total(sizes);
  auto off = offsets(sizes);
  int64_t rows = 0;
  for (int64_t g = ranges[c].first; g < ranges[c].second; ++g) {
    int64_t s = g;
    if (g < 0 || g >= n) {
      if (mode == PadMode::Constant) {
        continue;
      }
      s = mode == PadMode::Circular ? ((g % n) + n) % n : (g < 0 ? -g : 2 * (n - 1) - g);
    }
    rows += (s >= off[o] && s < off[o] + sizes[o]) ? 1 : 0;
  }
  return rows;
}

}  // namespace

// SHARDTENSOR_HALO_NEIGHBOR=1 (Note [neighbourhood collectives]): the
// neighbourhood-collective path gives bit-identical results and counts the
// same bytes as the point-to-point path, blocking and split phase, in every
// mode (reflect: rows sent in reverse; replicate: one row expanded on
// arrival; circular and multi-hop: several runs per peer), for float and
// double; it makes one graph per layout and reuses it.
TEST(CommGatherRange, NeighbourhoodCollectivesMatchPointToPoint) {
  auto mesh = test_mesh();
  std::mt19937 rng(4321);  // identical on every rank
  struct EnvGuard {
    ~EnvGuard() { unsetenv("SHARDTENSOR_HALO_NEIGHBOR"); }
  } guard;
  auto both = [&](const std::function<at::Tensor()>& f, st::CommStats* stats) {
    std::vector<at::Tensor> out;
    std::vector<st::CommStats> s;
    for (const char* v : {"0", "1"}) {
      setenv("SHARDTENSOR_HALO_NEIGHBOR", v, 1);
      st::reset_comm_stats();
      out.push_back(f());
      s.push_back(st::comm_stats());
    }
    EXPECT_TRUE(s[0].bytes_sent == s[1].bytes_sent && s[0].bytes_received == s[1].bytes_received &&
                s[0].messages == s[1].messages)
        << "point-to-point " << s[0].bytes_sent << " B sent, " << s[0].bytes_received
        << " B received, " << s[0].messages << " messages; neighbourhood " << s[1].bytes_sent
        << ", " << s[1].bytes_received << ", " << s[1].messages;
    if (stats) *stats = s[1];
    return at::equal(out[0], out[1]);
  };
  int checked = 0;
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : partitions(a.P)) {
      const int64_t n = total(sizes);
      auto off = offsets(sizes);
      for (auto dtype : {at::kFloat, at::kDouble}) {
        at::Tensor full = seeded_randn({3, n, 4}, 1500).to(dtype);
        at::Tensor local = full.narrow(1, off[a.me], sizes[a.me]);
        for (PadMode mode : kModes) {
          for (int trial = 0; trial < 4; ++trial) {
            Ranges ranges = trial == 0 ? halo_ranges(sizes, 1, 2) : random_ranges(rng, n, a.P);
            if (!ranges_allowed(mode, n, ranges)) {
              continue;
            }
            SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim) + " sizes " + str(sizes) +
                         " mode " + mode_str(mode) + " trial " + std::to_string(trial));
            EXPECT_TRUE(all_ranks(both(
                [&] {
                  return comm::gather_range(local, mesh, a.mesh_dim, 1, sizes, ranges, mode, 0.5);
                },
                nullptr)));
            // Split phase, on a non-contiguous piece.
            at::Tensor strided = local.transpose(0, 2).contiguous().transpose(0, 2);
            EXPECT_TRUE(all_ranks(both(
                [&] {
                  auto h = comm::gather_range_start(strided, mesh, a.mesh_dim, 1, sizes, ranges,
                                                    mode, 0.5);
                  return h.finish();
                },
                nullptr)));
            ++checked;
          }
        }
      }
    }
    // Messages above the per-call limit (Note [large counts]) take the
    // Isend/Irecv path on every rank alike, empty pieces included.
    {
      struct Limit {
        int64_t previous = comm::transport::set_max_count_for_testing(20);
        ~Limit() { comm::transport::set_max_count_for_testing(previous); }
      } limit;
      for (const auto& sizes : partitions(a.P)) {
        const int64_t n = total(sizes);
        at::Tensor full = seeded_randn({2, n, 3}, 1520);
        at::Tensor local = full.narrow(1, offsets(sizes)[a.me], sizes[a.me]);
        EXPECT_TRUE(all_ranks(
            both([&] { return comm::halo_exchange(local, mesh, a.mesh_dim, 1, sizes, 1, 2); },
                 nullptr)));
      }
    }
    // A repeated layout reuses its graph; the count is bounded.
    const auto sizes = balanced(2 * a.P + 1, a.P);
    at::Tensor local = seeded_randn({2, sizes[a.me], 3}, 1510);
    setenv("SHARDTENSOR_HALO_NEIGHBOR", "1", 1);
    comm::halo_exchange(local, mesh, a.mesh_dim, 1, sizes, 1, 1);
    const int64_t graphs = comm::transport::neighbor_graph_count(a.comm);
    comm::halo_exchange(local, mesh, a.mesh_dim, 1, sizes, 1, 1);
    comm::halo_exchange(local.to(at::kDouble), mesh, a.mesh_dim, 1, sizes, 1, 1);
    EXPECT_TRUE(all_ranks(comm::transport::neighbor_graph_count(a.comm) == graphs));
    // Open MPI 5.0 ignores the opt-in (Note [neighbourhood collectives on Open MPI
    // 5.0]): no graph is made there, and the comparisons above ran point-to-point
    // twice.
    // Graphs exist only on the MPI transport (the c10d transport's halos are
    // point-to-point, Note [c10d handles]).
    const bool usable =
        comm::transport::neighbor_collectives_usable() && st::detail::transport() == "mpi";
    EXPECT_TRUE(all_ranks(graphs <= comm::transport::kMaxNeighborGraphs &&
                          (a.P == 1 || !usable ? graphs == 0 : graphs > 0)));
  }
  EXPECT_GT(checked, 0);
}

TEST(CommStats, HaloExchangeSendsExactlyTheHaloBytes) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    for (const auto& sizes : {balanced(4 * a.P + 1, a.P), partitions(a.P)[1]}) {
      for (PadMode mode : {PadMode::Constant, PadMode::Circular, PadMode::Reflect}) {
        const int64_t n = total(sizes);
        const int64_t l = 1, r = 2;
        Ranges ranges = halo_ranges(sizes, l, r);
        if (!ranges_allowed(mode, n, ranges)) {
          continue;
        }
        auto off = offsets(sizes);
        const int64_t row_bytes = 5 * 3 * sizeof(double);
        int64_t sent = 0, received = 0, sends = 0, recvs = 0;
        for (int64_t c = 0; c < a.P; ++c) {
          if (c == a.me) {
            continue;
          }
          const int64_t out_rows = rows_from(ranges, c, sizes, a.me, mode);
          const int64_t in_rows = rows_from(ranges, a.me, sizes, c, mode);
          sent += out_rows * row_bytes;
          received += in_rows * row_bytes;
          sends += out_rows > 0 ? 1 : 0;
          recvs += in_rows > 0 ? 1 : 0;
        }
        at::Tensor full = seeded_randn({5, n, 3}, 1700);
        at::Tensor local = full.narrow(1, off[a.me], sizes[a.me]).clone().requires_grad_(true);
        st::reset_comm_stats();
        at::Tensor out = comm::halo_exchange(local, mesh, a.mesh_dim, 1, sizes, l, r, mode);
        st::CommStats fwd = st::comm_stats();
        st::reset_comm_stats();
        out.backward(at::ones_like(out));
        st::CommStats bwd = st::comm_stats();
        const bool ok = fwd.bytes_sent == sent && fwd.bytes_received == received &&
                        fwd.messages == sends && bwd.bytes_sent == received &&
                        bwd.bytes_received == sent && bwd.messages == recvs;
        EXPECT_TRUE(all_ranks(ok))
            << "mesh dim " << a.mesh_dim << " sizes " << str(sizes) << " mode " << mode_str(mode)
            << ": forward sent/received/messages " << fwd.bytes_sent << "/" << fwd.bytes_received
            << "/" << fwd.messages << " expected " << sent << "/" << received << "/" << sends
            << "; backward " << bwd.bytes_sent << "/" << bwd.bytes_received << "/" << bwd.messages
            << " expected " << received << "/" << sent << "/" << recvs;
      }
    }
  }
}

TEST(CommStats, CollectivesCountPairwiseVolumes) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = partitions(a.P)[1];
    const int64_t n = total(sizes);
    auto off = offsets(sizes);
    const int64_t row = 4 * sizeof(float);
    at::Tensor full = seeded_randn({n, 4}, 1800, at::kFloat);
    // all_gather: my piece to P-1 peers, everyone else's piece in.
    st::reset_comm_stats();
    comm::all_gather(full.narrow(0, off[a.me], sizes[a.me]), mesh, a.mesh_dim, 0, sizes);
    st::CommStats s = st::comm_stats();
    const int64_t mine = sizes[a.me] * row;
    bool ok = s.bytes_sent == (a.P - 1) * mine && s.bytes_received == n * row - mine &&
              s.messages == (mine > 0 ? a.P - 1 : 0);
    EXPECT_TRUE(all_ranks(ok)) << "all_gather " << s.bytes_sent << "/" << s.bytes_received << "/"
                               << s.messages;
    // all_reduce over balanced element chunks: N + (P-2) * chunk, both ways.
    st::reset_comm_stats();
    comm::all_reduce_nograd(full, mesh, {a.mesh_dim}, ReduceOp::Sum);
    s = st::comm_stats();
    const int64_t chunk = balanced(full.numel(), a.P)[a.me] * static_cast<int64_t>(sizeof(float));
    const int64_t expect = a.P == 1 ? 0 : full.numel() * 4 + (a.P - 2) * chunk;
    ok = s.bytes_sent == expect && s.bytes_received == expect;
    EXPECT_TRUE(all_ranks(ok)) << "all_reduce " << s.bytes_sent << "/" << s.bytes_received
                               << " expected " << expect;
    // all_to_all: everything but what stays here.
    auto dst = balanced(4, a.P);
    st::reset_comm_stats();
    comm::all_to_all(full.narrow(0, off[a.me], sizes[a.me]), mesh, a.mesh_dim, 0, sizes, 1, dst);
    s = st::comm_stats();
    const int64_t stay = sizes[a.me] * dst[a.me] * static_cast<int64_t>(sizeof(float));
    ok = s.bytes_sent == mine - stay && s.bytes_received == n * dst[a.me] * 4 - stay;
    EXPECT_TRUE(all_ranks(ok)) << "all_to_all " << s.bytes_sent << "/" << s.bytes_received;
  }
}

// ---- validation and the debug agreement check ------------------------------------

TEST(CommValidation, BadArgumentsThrowOnEveryRankBeforeCommunicating) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    auto sizes = balanced(2 * a.P + 1, a.P);
    auto off = offsets(sizes);
    at::Tensor full = seeded_randn({2 * a.P + 1, 2}, 1900);
    at::Tensor local = full.narrow(0, off[a.me], sizes[a.me]);
    auto too_long = sizes;
    too_long.push_back(0);
    EXPECT_TRUE(
        throws_with([&] { comm::all_gather(local, mesh, a.mesh_dim, 0, too_long); }, "all_gather"));
    auto negative = sizes;
    negative[0] = -1;
    EXPECT_TRUE(
        throws_with([&] { comm::all_gather(local, mesh, a.mesh_dim, 0, negative); }, "negative"));
    EXPECT_TRUE(
        throws_with([&] { comm::all_gather(local, mesh, a.mesh_dim, 5, sizes); }, "out of range"));
    EXPECT_TRUE(throws_with([&] { comm::all_gather(local, mesh, 7, 0, sizes); }, "mesh_dim"));
    at::Tensor too_big = at::zeros({2 * a.P + 2, 2}, at::kDouble);
    EXPECT_TRUE(throws_with([&] { comm::reduce_scatter(too_big, mesh, a.mesh_dim, 0, sizes); },
                            "reduce_scatter"));
    EXPECT_TRUE(throws_with(
        [&] {
          comm::halo_exchange(local, mesh, a.mesh_dim, 0, sizes, 3 * a.P, 0, PadMode::Reflect);
        },
        "Reflect"));
    Ranges inverted(a.P, {2, 1});
    EXPECT_TRUE(
        throws_with([&] { comm::gather_range(local, mesh, a.mesh_dim, 0, sizes, inverted); },
                    "negative length"));
    EXPECT_TRUE(throws_with(
        [&] { comm::all_to_all(local, mesh, a.mesh_dim, 0, sizes, 0, balanced(a.P, a.P)); },
        "all_to_all"));
    EXPECT_TRUE(throws_with([&] { comm::all_reduce(local, mesh, {0, 0}); }, "twice"));
  }
}

TEST(CommDebug, MismatchedCallsThrowOnEveryRankNamingThePrimitive) {
  auto mesh = test_mesh();
  DebugMode debug;
  for (const Axis& a : axes(mesh)) {
    auto sizes = balanced(2 * a.P, a.P);  // 2 each
    auto off = offsets(sizes);
    at::Tensor full = seeded_randn({2 * a.P, 3}, 2000);
    at::Tensor local = full.narrow(0, off[a.me], sizes[a.me]);
    // Matching calls still work in debug mode.
    EXPECT_TRUE(all_close(comm::all_gather(local, mesh, a.mesh_dim, 0, sizes), full));
    if (a.P == 1) {
      continue;  // nobody to disagree with
    }
    // Coordinate 0 believes in other sizes (its own extent still matches).
    auto wrong = sizes;
    if (a.me == 0) {
      wrong[a.P - 1] += 1;
    }
    EXPECT_TRUE(all_ranks(static_cast<bool>(
        throws_with([&] { comm::all_gather(local, mesh, a.mesh_dim, 0, wrong); }, "all_gather"))));
    EXPECT_TRUE(all_ranks(static_cast<bool>(throws_with(
        [&] { comm::halo_exchange(local, mesh, a.mesh_dim, 0, wrong, 1, 1); }, "halo_exchange"))));
    // A local-shape error on one rank only is reported on every rank.
    at::Tensor odd = a.me == 0 ? full.narrow(0, 0, 1) : local;
    EXPECT_TRUE(all_ranks(static_cast<bool>(throws_with(
        [&] { comm::gather_range(odd, mesh, a.mesh_dim, 0, sizes, halo_ranges(sizes, 1, 1)); },
        "gather_range"))));
    // Different primitives on different ranks.
    EXPECT_TRUE(all_ranks(static_cast<bool>(throws_with(
        [&] {
          if (a.me == 0) {
            comm::all_reduce(local, mesh, {a.mesh_dim});
          } else {
            comm::use_replicated(local, mesh, {a.mesh_dim});
          }
        },
        a.me == 0 ? "all_reduce" : "use_replicated"))));
    // And the communicator is still usable afterwards.
    EXPECT_TRUE(all_close(comm::all_gather(local, mesh, a.mesh_dim, 0, sizes), full));
  }
}

// ---- the transport itself (also used directly by tensor/ for metadata) ------------

// Internal header: the transport is not public API, but its contract is tested here.
#include "../src/comm/transport.h"

namespace transport = shardtensor::comm::transport;

TEST(CommTransport, BroadcastScattervReduceScatterAllToAllv) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    const int64_t P = a.P, me = a.me;
    // broadcast_ from the last coordinate.
    at::Tensor b = a.me == P - 1 ? seeded_randn({5}, 2100) : at::zeros({5}, at::kDouble);
    st::reset_comm_stats();
    transport::broadcast_(b, static_cast<int>(P - 1), a.comm);
    st::CommStats s = st::comm_stats();
    const int64_t nb = 5 * 8;
    bool ok = b.equal(seeded_randn({5}, 2100)) &&
              (P == 1 ? (s.bytes_sent == 0 && s.bytes_received == 0 && s.messages == 0)
               : me == P - 1
                   ? (s.bytes_sent == (P - 1) * nb && s.bytes_received == 0 && s.messages == P - 1)
                   : (s.bytes_sent == 0 && s.bytes_received == nb && s.messages == 0));
    EXPECT_TRUE(all_ranks(ok)) << "broadcast_ " << s.bytes_sent << "/" << s.bytes_received << "/"
                               << s.messages;
    // scatterv from coordinate 0: coordinate c gets c + 1 int64 values c*10 + i.
    std::vector<int64_t> bytes(P);
    std::vector<at::Tensor> pieces;
    for (int64_t c = 0; c < P; ++c) {
      bytes[c] = (c + 1) * 8;
      pieces.push_back(at::arange(c + 1, at::kLong) + 10 * c);
    }
    at::Tensor send = me == 0 ? at::cat(pieces) : at::Tensor();
    at::Tensor recv = at::empty({me + 1}, at::kLong);
    st::reset_comm_stats();
    transport::scatterv(send, me == 0 ? bytes : std::vector<int64_t>{}, recv, 0, a.comm);
    s = st::comm_stats();
    ok =
        recv.equal(pieces[me]) && (me == 0 ? s.bytes_sent == total(bytes) - 8 && s.messages == P - 1
                                           : s.bytes_received == bytes[me] && s.bytes_sent == 0);
    EXPECT_TRUE(all_ranks(ok)) << "scatterv " << recv;
    // reduce_scatter in half precision (reduced in float), with an empty piece when P >= 2.
    auto sizes = partitions(P)[1];
    const int64_t n = total(sizes);
    auto off = offsets(sizes);
    at::Tensor mine = (at::arange(n, at::kFloat) + me).to(at::kHalf);
    at::Tensor sum = at::zeros({n}, at::kFloat);
    for (int64_t c = 0; c < P; ++c) {
      sum += at::arange(n, at::kFloat) + c;
    }
    at::Tensor piece = at::empty({sizes[me]}, at::kHalf);
    st::reset_comm_stats();
    transport::reduce_scatter(mine, piece, sizes, ReduceOp::Sum, a.comm);
    s = st::comm_stats();
    int64_t rs_sent = 0;
    for (int64_t c = 0; c < P; ++c) {
      rs_sent += c == me ? 0 : sizes[c] * 2;
    }
    ok = piece.to(at::kFloat).equal(sum.narrow(0, off[me], sizes[me])) && s.bytes_sent == rs_sent &&
         s.bytes_received == (P - 1) * sizes[me] * 2;
    EXPECT_TRUE(all_ranks(ok)) << "reduce_scatter " << piece;
    // all_to_allv: coordinate me sends (me + 1) * (c + 1) bytes of value me*16 + c to c.
    std::vector<int64_t> sb(P), sd(P), rb(P), rd(P);
    for (int64_t c = 0; c < P; ++c) {
      sb[c] = (me + 1) * (c + 1);
      rb[c] = (c + 1) * (me + 1);
    }
    sd = offsets(sb);
    rd = offsets(rb);
    at::Tensor abuf = at::empty({total(sb)}, at::kByte);
    for (int64_t c = 0; c < P; ++c) {
      abuf.narrow(0, sd[c], sb[c]).fill_(me * 16 + c);
    }
    at::Tensor rbuf = at::zeros({total(rb)}, at::kByte);
    st::reset_comm_stats();
    transport::all_to_allv(abuf, sb, sd, rbuf, rb, rd, a.comm);
    s = st::comm_stats();
    ok = s.bytes_sent == total(sb) - sb[me] && s.bytes_received == total(rb) - rb[me] &&
         s.messages == P - 1;
    for (int64_t c = 0; c < P; ++c) {
      ok = ok && (rbuf.narrow(0, rd[c], rb[c]) == c * 16 + me).all().item<bool>();
    }
    EXPECT_TRUE(all_ranks(ok)) << "all_to_allv " << rbuf;
  }
}

TEST(CommTransport, SplitPhaseExchangeKeepsOrderAndCountsPayload) {
  auto mesh = test_mesh();
  for (const Axis& a : axes(mesh)) {
    const int64_t P = a.P, me = a.me;
    // Two messages to every coordinate (self included), plus an empty one that is skipped.
    std::vector<transport::PeerBuffer> sends, recvs;
    std::vector<at::Tensor> expected;
    for (int64_t c = 0; c < P; ++c) {
      const int peer = static_cast<int>(c);
      sends.push_back({peer, at::full({3}, static_cast<double>(100 * me + c), at::kDouble)});
      sends.push_back({peer, at::empty({0}, at::kDouble)});
      sends.push_back({peer, at::full({1, 2}, static_cast<double>(-(100 * me + c)), at::kDouble)});
      recvs.push_back({peer, at::zeros({3}, at::kDouble)});
      recvs.push_back({peer, at::empty({0}, at::kDouble)});
      recvs.push_back({peer, at::zeros({1, 2}, at::kDouble)});
      expected.push_back(at::full({3}, static_cast<double>(100 * c + me), at::kDouble));
      expected.push_back(at::empty({0}, at::kDouble));
      expected.push_back(at::full({1, 2}, static_cast<double>(-(100 * c + me)), at::kDouble));
    }
    st::reset_comm_stats();
    auto pending = transport::start_exchange(sends, recvs, a.comm);
    EXPECT_TRUE(pending.pending());
    pending.finish();
    pending.finish();  // idempotent
    st::CommStats s = st::comm_stats();
    bool ok = !pending.pending() && s.bytes_sent == (P - 1) * 5 * 8 &&
              s.bytes_received == (P - 1) * 5 * 8 && s.messages == 2 * (P - 1);
    for (size_t i = 0; i < recvs.size(); ++i) {
      ok = ok && recvs[i].buffer.equal(expected[i]);
    }
    EXPECT_TRUE(all_ranks(ok)) << "mesh dim " << a.mesh_dim << ": " << s.bytes_sent << "/"
                               << s.bytes_received << "/" << s.messages;
    // Invalid peers and non-contiguous buffers are rejected before anything is posted.
    EXPECT_THROW(transport::start_exchange({{static_cast<int>(P), at::zeros({1})}}, {}, a.comm),
                 c10::Error);
    EXPECT_THROW(transport::start_exchange({{0, at::zeros({4, 4}).t()}}, {}, a.comm), c10::Error);
  }
}

// Note [collective discipline]: a check that fails on one rank raises the same
// error, with that rank's message, on every rank.
TEST(Agree, CheckAllRaisesTheFailingRanksMessageEverywhere) {
  auto mesh = test_mesh();
  const int last = static_cast<int>(mesh.size()) - 1;
  EXPECT_TRUE(comm::all_ok(mesh, true));
  EXPECT_EQ(comm::all_ok(mesh, mesh.rank() != last), false);
  comm::check_all(mesh, true, "agree_test");  // returns on every rank
  EXPECT_TRUE(throws_everywhere(
      [&] {
        comm::check_all(mesh, mesh.rank() != last, "agree_test",
                        "piece " + std::to_string(mesh.rank()) + " is bad");
      },
      {"agree_test", "piece " + std::to_string(last) + " is bad",
       "reported by mesh rank " + std::to_string(last)}));
}

TEST(Agree, RecordsGatherBroadcastAndReduce) {
  auto mesh = test_mesh();
  const int64_t r = mesh.rank();
  std::vector<int64_t> mine(static_cast<size_t>(r), r);  // rank r sends r copies of r
  auto all = comm::all_gather_records(mesh, mine);
  ASSERT_EQ(static_cast<int64_t>(all.size()), mesh.size());
  for (int64_t c = 0; c < mesh.size(); ++c) {
    EXPECT_EQ(all[c], std::vector<int64_t>(static_cast<size_t>(c), c));
  }
  const int root = static_cast<int>(mesh.size()) - 1;
  auto b = comm::broadcast_record(mesh, {r, 7, -r}, root);
  EXPECT_EQ(b, (std::vector<int64_t>{root, 7, -root}));
  std::vector<int64_t> v{r, 1}, w{r, 1};
  comm::all_reduce_max(mesh, v);
  comm::all_reduce_sum(mesh, w);
  EXPECT_EQ(v, (std::vector<int64_t>{mesh.size() - 1, 1}));
  EXPECT_EQ(w, (std::vector<int64_t>{mesh.size() * (mesh.size() - 1) / 2, mesh.size()}));
  comm::barrier(mesh);
}
