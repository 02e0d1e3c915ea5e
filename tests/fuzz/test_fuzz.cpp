// Randomized differential tester (issue 15): random programs over the
// supported ops (chains of stencil, norm, pointwise, reduction, shape and
// redistribute ops with random kernel/stride/dilation/padding), random global
// shapes (extents below P included), random placements on 1-D and 2-D meshes,
// random explicit sizes with zeros, float32/float64; each program runs
// sharded and on plain libtorch through reference_check (output, input grad,
// parameter grads). A mismatch prints a one-line reproducer:
//   FUZZ_SEED=<seed> FUZZ_COUNT=1 mpirun -np <P> [SHARDTENSOR_TEST_MESH=2x2] test_fuzz
// Environment: FUZZ_SEED (first seed, default 1), FUZZ_COUNT (programs,
// default 60), FUZZ_SECONDS (stop starting new programs after this long;
// `make fuzz SECONDS=...`).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

struct Program {
  std::string text;  // human-readable description
  RefFn fn;
  std::vector<at::Tensor> params;
};

/// One random op appended to `prog`, acting on a 4-D [N, C, H, W] tensor with
/// channel count `c`; updates c. Parameters are drawn from `rng` (the same on
/// every rank).
void add_op(std::mt19937_64& rng, Program& prog, int64_t& c, at::ScalarType dtype, uint64_t seed) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int kind = static_cast<int>(pick(0, 7));
  std::ostringstream os;
  auto prev = prog.fn;
  switch (kind) {
    case 0: {  // conv2d with random kernel/stride/dilation/padding
      const int64_t co = pick(1, 3), kh = pick(1, 4), kw = pick(1, 4), s = pick(1, 2),
                    d = pick(1, 2), ph = pick(0, 2), pw = pick(0, 2);
      const size_t w = prog.params.size();
      prog.params.push_back(rnd({co, c, kh, kw}, seed + w, 0.5).to(dtype));
      prog.params.push_back(rnd({co}, seed + w + 100, 0.1).to(dtype));
      os << "conv2d(co=" << co << ",k=" << kh << "x" << kw << ",s=" << s << ",d=" << d
         << ",p=" << ph << "x" << pw << ")";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        return at::conv2d(prev(in, p), p[w], p[w + 1], {s, s}, {ph, pw}, {d, d});
      };
      c = co;
      break;
    }
    case 1: {  // pooling
      const int64_t k = pick(1, 3), s = pick(1, 2), pad = pick(0, k / 2);
      const bool max = pick(0, 1) == 1;
      os << (max ? "max_pool2d" : "avg_pool2d") << "(k=" << k << ",s=" << s << ",p=" << pad << ")";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        at::Tensor x = prev(in, p);
        return max ? at::max_pool2d(x, {k, k}, {s, s}, {pad, pad})
                   : at::avg_pool2d(x, {k, k}, {s, s}, {pad, pad});
      };
      break;
    }
    case 2: {  // group norm with affine parameters
      const size_t w = prog.params.size();
      prog.params.push_back(rnd({c}, seed + w, 0.2, 1.0).to(dtype));
      prog.params.push_back(rnd({c}, seed + w + 100, 0.2).to(dtype));
      os << "group_norm(groups=1)";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        return at::group_norm(prev(in, p), 1, p[w], p[w + 1], 1e-5);
      };
      break;
    }
    case 3: {  // pointwise
      const int which = static_cast<int>(pick(0, 2));
      os << (which == 0 ? "gelu" : which == 1 ? "tanh*2+x" : "relu");
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        at::Tensor x = prev(in, p);
        return which == 0 ? at::gelu(x) : which == 1 ? at::tanh(x) * 2.0 + x : at::relu(x);
      };
      break;
    }
    case 4: {  // softmax over a (possibly sharded) spatial dim
      const int64_t dim = pick(2, 3);
      os << "softmax(dim=" << dim << ")";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        return at::softmax(prev(in, p), dim);
      };
      break;
    }
    case 5: {  // reduction keeping dims, then broadcast back
      const int64_t dim = pick(2, 3);
      os << "x - mean(dim=" << dim << ")";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        at::Tensor x = prev(in, p);
        return x - x.mean({dim}, true);
      };
      break;
    }
    case 6: {  // interpolation
      const bool nearest = pick(0, 1) == 1;
      os << (nearest ? "upsample_nearest2d(x2)" : "upsample_bilinear2d(x2)");
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        at::Tensor x = prev(in, p);
        return nearest
                   ? at::upsample_nearest2d(x, c10::nullopt, std::vector<double>{2.0, 2.0})
                   : at::upsample_bilinear2d(x, c10::nullopt, false, std::vector<double>{2.0, 2.0});
      };
      break;
    }
    default: {  // shape: transpose of the spatial dims
      os << "transpose(2,3)";
      prog.fn = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
        return prev(in, p).transpose(2, 3).contiguous();
      };
      break;
    }
  }
  prog.text += (prog.text.empty() ? "" : " -> ") + os.str();
}

}  // namespace

TEST(Fuzz, RandomProgramsMatchLibtorch) {
  auto mesh = test_mesh();
  const int64_t first = env_int("FUZZ_SEED", 1), count = env_int("FUZZ_COUNT", 60);
  const double seconds = static_cast<double>(env_int("FUZZ_SECONDS", 0));
  const auto start = std::chrono::steady_clock::now();
  int64_t ran = 0, skipped = 0, unsupported = 0, failed = 0;
  for (int64_t seed = first; seed < first + count; ++seed) {
    if (seconds > 0) {
      // Every rank must make the same decision: agree on the elapsed time.
      const double el =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!all_ranks(el < seconds)) break;
    }
    std::mt19937_64 rng(static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull);
    auto pick = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    const at::ScalarType dtype = pick(0, 1) ? at::kDouble : at::kFloat;
    const int64_t c0 = pick(1, 3);
    int64_t c = c0;
    const int64_t n = pick(1, 2), h = pick(1, 11), w = pick(1, 11);
    Program prog;
    prog.fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      return in[0];
    };
    const int64_t nops = pick(1, 3);
    for (int64_t i = 0; i < nops; ++i) add_op(rng, prog, c, dtype, seed * 1000 + i * 10);
    // Placements: random Shard{2}/Shard{3}/Replicate per mesh dim, no dim twice.
    st::Placements pl;
    std::vector<bool> used(4, false);
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      const int64_t r = pick(0, 2);
      const int64_t d = r == 0 ? 2 : r == 1 ? 3 : -1;
      if (d >= 0 && !used[d]) {
        used[d] = true;
        pl.push_back(st::Shard{d});
      } else {
        pl.push_back(st::Replicate{});
      }
    }
    RefInput input{rnd({n, c0, h, w}, seed).to(dtype), pl, true};
    if (pick(0, 2) == 0) {
      input.sizes = sizes_with_empty_first(mesh, pl, input.full.sizes());
    }
    std::ostringstream repro;
    repro << "FUZZ_SEED=" << seed << " FUZZ_COUNT=1 mpirun -np " << mesh.size()
          << (is_mesh_2x2() ? " (SHARDTENSOR_TEST_MESH=2x2)" : "") << " test_fuzz   # " << prog.text
          << " on " << input.full.sizes() << " " << st::to_string(pl) << " " << dtype
          << (input.sizes ? " empty-first" : "");
    // The reference must be valid (random parameters can make an empty output).
    bool valid = true;
    try {
      at::Tensor y = prog.fn({input.full}, prog.params);
      valid = y.numel() > 0;
    } catch (const c10::Error&) {
      valid = false;
    }
    if (!valid) {
      ++skipped;
      continue;
    }
    const double tol = dtype == at::kDouble ? 1e-9 : 1e-4;
    ::testing::AssertionResult r = ::testing::AssertionSuccess();
    try {
      r = reference_check(prog.fn, {input}, mesh, prog.params, tol, tol);
    } catch (const c10::Error& e) {
      // A clear error on every rank is allowed (an unsupported combination);
      // it must not be a wrong number.
      ++unsupported;
      if (mesh.rank() == 0) {
        std::printf("fuzz: unsupported: %s\n  %s\n", repro.str().c_str(),
                    e.what_without_backtrace());
      }
      continue;
    }
    ++ran;
    if (!r) {
      ++failed;
      ADD_FAILURE() << "fuzz mismatch; reproduce with:\n  " << repro.str() << "\n" << r.message();
    }
  }
  if (mesh.rank() == 0) {
    std::printf(
        "fuzz: %lld programs compared, %lld invalid skipped, %lld unsupported, %lld failed\n",
        static_cast<long long>(ran), static_cast<long long>(skipped),
        static_cast<long long>(unsupported), static_cast<long long>(failed));
  }
}
