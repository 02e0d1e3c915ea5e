// Interpolation rules (src/ops/interpolate.cpp) compared with plain libtorch on
// the full tensors through torch::nn::functional::interpolate: forward output
// and input gradients (reference_check), every mode, align_corners both ways,
// by size and by scale (integer and non-integer, up and down, with and without
// recompute_scale_factor), and the .vec overloads called directly.
//
// Layouts are written for the 2x2 mesh (two spatial dims sharded) and trimmed
// by fit_placements() on a 1-D mesh. Extents (13, 11, 7, 5) are not divisible
// by 2, 3 or 4, so shards are uneven; strong downsampling (13 -> 3) leaves
// output blocks empty and makes input ranges skip whole shards, upsampling
// (5 -> 17) makes every rank read a neighbour's data (halos). The empty(...)
// inputs give coordinate 0 of every sharded mesh dim no data.
//
// Tolerance: rtol 1e-5. The rule computes libtorch's own indices and weights
// (same precision) and applies them separably; only summation order differs.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
namespace F = torch::nn::functional;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
// Bicubic weights are negative at the outer taps, so the 16 products of a 2-D
// output cancel: the rounding error scales with sum |w||x| (a few times |out|),
// and summation order alone moves results by ~3e-6 on values of order 1.
constexpr double kCubicAtol = 5e-6;

struct Case {
  std::optional<std::vector<int64_t>> size;
  std::optional<std::vector<double>> scale;
  std::optional<bool> recompute;
};

std::string str(const Case& c) {
  std::string s;
  if (c.size) {
    s += "size=";
    for (auto v : *c.size) s += std::to_string(v) + ",";
  }
  if (c.scale) {
    s += "scale=";
    for (auto v : *c.scale) s += std::to_string(v) + ",";
  }
  if (c.recompute) s += std::string(" recompute=") + (*c.recompute ? "1" : "0");
  return s;
}

F::InterpolateFuncOptions options(F::InterpolateFuncOptions::mode_t mode, const Case& c,
                                  std::optional<bool> align) {
  F::InterpolateFuncOptions o;
  o.mode(mode);
  if (c.size) o.size(*c.size);
  if (c.scale) o.scale_factor(*c.scale);
  if (c.recompute) o.recompute_scale_factor(*c.recompute);
  if (align) o.align_corners(*align);
  return o;
}

class Interp : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  RefInput sh(const at::Tensor& full, const P& wanted) { return sharded_input(mesh, full, wanted); }
  RefInput empty(const at::Tensor& full, const P& wanted) {
    return empty_first_input(mesh, full, wanted);
  }
  ::testing::AssertionResult check(const RefFn& fn, const std::vector<RefInput>& in) {
    return reference_check(fn, in, mesh, {}, kRtol, kAtol);
  }
  // interpolate(mode, case, align) on `x` in several layouts.
  void sweep(F::InterpolateFuncOptions::mode_t mode, const at::Tensor& x,
             const std::vector<Case>& cases, const std::vector<P>& layouts,
             std::vector<std::optional<bool>> aligns = {std::nullopt}, double atol = kAtol,
             bool f32_accuracy = false) {
    for (const auto& align : aligns) {
      for (const auto& c : cases) {
        auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], options(mode, c, align));
        };
        // Note [float32 interpolation gradients]: in float32 the gathered formulation's
        // gradient sums the taps in another order than libtorch 2.x's upsample backward
        // (trilinear at scale (3, 2, 3): both are 5.6e-6 from float64, 2.9e-6 apart,
        // which fails the element-wise 1e-5 test on an element near zero). So float32
        // is checked for accuracy where a sweep asks for it (f32_accuracy): at least as
        // close to float64 as single-process libtorch (precision_check, factor 2 + one
        // float32 rounding); float64, and every other sweep, keep the element-wise
        // comparison with libtorch.
        auto check = [&](const RefInput& in) {
          return f32_accuracy && x.scalar_type() == at::kFloat
                     ? precision_check(fn, {in}, mesh, at::kFloat)
                     : reference_check(fn, {in}, mesh, {}, kRtol, atol);
        };
        for (size_t l = 0; l < layouts.size(); ++l) {
          EXPECT_TRUE(check(sh(x, layouts[l])))
              << str(c) << " align=" << (align ? int(*align) : -1) << " layout " << l;
        }
        EXPECT_TRUE(check(empty(x, layouts[0])))
            << str(c) << " align=" << (align ? int(*align) : -1) << " empty";
      }
    }
  }
};

const std::vector<std::optional<bool>> kBothAlign = {false, true};

}  // namespace

TEST_F(Interp, Nearest1d) {
  const auto x = rnd({2, 3, 13}, 1);
  sweep(torch::kNearest, x,
        {{std::vector<int64_t>{29}},
         {std::vector<int64_t>{26}},
         {std::vector<int64_t>{5}},
         {std::vector<int64_t>{3}},
         {std::nullopt, std::vector<double>{2.0}},
         {std::nullopt, std::vector<double>{1.7}, false},
         {std::nullopt, std::vector<double>{1.7}, true},
         {std::nullopt, std::vector<double>{0.4}, false}},
        {{S2}, {S0}});
}

// Note [nearest special extents] (src/ops/interpolate.cpp): with a given scale
// where out == 2 * in (2.05) or out == in (1.05), libtorch's 1-d and 3-d
// forward kernels use floor(o / scale) while their backward kernels use
// nearest_idx (o / 2, o), so their gradient is not the adjoint of their
// forward (1.13 and 2.13): the rule is the forward (and its exact adjoint), and
// only the forward is compared there. 2.13's 2-d kernels use nearest_idx both
// ways, and so does the rule: forward and backward are compared.
TEST_F(Interp, NearestSpecialExtentsWithGivenScale) {
  auto fn = [](std::vector<double> s) {
    return [s](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      return F::interpolate(in[0], F::InterpolateFuncOptions()
                                       .mode(torch::kNearest)
                                       .scale_factor(s)
                                       .recompute_scale_factor(false));
    };
  };
  const auto x1 = rnd({2, 3, 13}, 15);
  for (double s : {2.05, 1.05}) {
    EXPECT_TRUE(reference_check(fn({s}), {sh(x1, {S2})}, mesh, {}, kRtol, kAtol, false)) << s;
    EXPECT_TRUE(reference_check(fn({s}), {empty(x1, {S2})}, mesh, {}, kRtol, kAtol, false)) << s;
  }
  const auto x2 = rnd({2, 2, 11, 7}, 16);
  for (const auto& s : std::vector<std::vector<double>>{{2.05, 1.05}, {1.05, 2.05}}) {
    for (const P& layout : std::vector<P>{{S2, S3}, {S3, S2}}) {
      EXPECT_TRUE(reference_check(fn(s), {sh(x2, layout)}, mesh, {}, kRtol, kAtol))
          << s[0] << ", " << s[1] << " on " << st::to_string(layout);
      EXPECT_TRUE(reference_check(fn(s), {empty(x2, layout)}, mesh, {}, kRtol, kAtol))
          << s[0] << ", " << s[1] << " on " << st::to_string(layout) << " empty";
    }
  }
  const auto x3 = rnd({1, 2, 5, 7, 3}, 17);
  EXPECT_TRUE(
      reference_check(fn({2.05, 1.05, 1.5}), {sh(x3, {S2, S3})}, mesh, {}, kRtol, kAtol, false));
  EXPECT_TRUE(
      reference_check(fn({2.05, 1.05, 1.5}), {empty(x3, {S2, S3})}, mesh, {}, kRtol, kAtol, false));
}

TEST_F(Interp, Nearest2d) {
  const auto x = rnd({2, 2, 11, 7}, 2);
  sweep(torch::kNearest, x,
        {{std::vector<int64_t>{23, 17}},
         {std::vector<int64_t>{4, 3}},
         {std::nullopt, std::vector<double>{2.0, 3.0}},
         {std::nullopt, std::vector<double>{1.5, 0.6}, false},
         {std::nullopt, std::vector<double>{1.5, 0.6}, true}},
        {{S2, S3}, {S3, S2}, {S2, S1}});
}

TEST_F(Interp, Nearest3d) {
  const auto x = rnd({1, 2, 5, 7, 3}, 3);
  sweep(torch::kNearest, x,
        {{std::vector<int64_t>{11, 9, 4}}, {std::nullopt, std::vector<double>{1.5, 0.5, 2.0}}},
        {{S2, S3}, {S4, S2}});
}

TEST_F(Interp, NearestExact2d) {
  const auto x = rnd({2, 2, 11, 7}, 4);
  sweep(torch::kNearestExact, x,
        {{std::vector<int64_t>{23, 17}},
         {std::vector<int64_t>{4, 3}},
         {std::nullopt, std::vector<double>{1.5, 0.6}, false},
         {std::nullopt, std::vector<double>{2.0, 3.0}}},
        {{S2, S3}, {S3, S2}});
}

TEST_F(Interp, Linear1d) {
  const auto x = rnd({2, 3, 13}, 5);
  sweep(torch::kLinear, x,
        {{std::vector<int64_t>{29}},
         {std::vector<int64_t>{13}},
         {std::vector<int64_t>{3}},
         {std::vector<int64_t>{1}},
         {std::nullopt, std::vector<double>{2.0}},
         {std::nullopt, std::vector<double>{1.7}, false},
         {std::nullopt, std::vector<double>{1.7}, true},
         {std::nullopt, std::vector<double>{0.3}, false}},
        {{S2}, {S1}}, kBothAlign);
}

TEST_F(Interp, Bilinear2d) {
  const auto x = rnd({2, 2, 11, 7}, 6);
  sweep(torch::kBilinear, x,
        {{std::vector<int64_t>{23, 17}},
         {std::vector<int64_t>{4, 3}},
         {std::vector<int64_t>{11, 15}},
         {std::nullopt, std::vector<double>{2.0, 2.0}},
         {std::nullopt, std::vector<double>{1.5, 0.6}, false},
         {std::nullopt, std::vector<double>{1.5, 0.6}, true},
         {std::nullopt, std::vector<double>{0.35, 2.7}, false}},
        {{S2, S3}, {S3, S2}, {S0, S2}}, kBothAlign);
}

TEST_F(Interp, Bilinear2dUpsampleSmallShards) {
  // 5 -> 17 rows over up to 4 ranks: shards of 1-2 rows, every block reads halos.
  const auto x = rnd({1, 2, 5, 6}, 7);
  sweep(torch::kBilinear, x, {{std::vector<int64_t>{17, 13}}, {std::vector<int64_t>{2, 2}}},
        {{S2, S3}}, kBothAlign);
}

TEST_F(Interp, Trilinear3d) {
  const auto x = rnd({1, 2, 5, 7, 4}, 8);
  sweep(torch::kTrilinear, x,
        {{std::vector<int64_t>{11, 9, 3}},
         {std::nullopt, std::vector<double>{1.5, 0.5, 2.0}, false},
         {std::nullopt, std::vector<double>{2.0, 2.0, 2.0}}},
        {{S2, S3}, {S4, S2}}, kBothAlign);
}

TEST_F(Interp, Bicubic2d) {
  const auto x = rnd({2, 2, 11, 7}, 9);
  sweep(torch::kBicubic, x,
        {{std::vector<int64_t>{23, 17}},
         {std::vector<int64_t>{4, 3}},
         {std::nullopt, std::vector<double>{2.0, 2.0}},
         {std::nullopt, std::vector<double>{1.5, 0.6}, false},
         {std::nullopt, std::vector<double>{1.5, 0.6}, true}},
        {{S2, S3}, {S3, S2}}, kBothAlign, kCubicAtol);
}

TEST_F(Interp, Area2d) {
  // mode "area" is adaptive_avg_pool2d (rule in src/ops/pool.cpp).
  const auto x = rnd({2, 2, 11, 7}, 10);
  sweep(torch::kArea, x, {{std::vector<int64_t>{4, 3}}, {std::vector<int64_t>{23, 9}}}, {{S2, S3}});
}

TEST_F(Interp, Area1d3d) {
  sweep(torch::kArea, rnd({2, 3, 13}, 16),
        {{std::vector<int64_t>{4}}, {std::nullopt, std::vector<double>{0.5}}}, {{S2}});
  sweep(torch::kArea, rnd({1, 2, 5, 7, 4}, 17), {{std::vector<int64_t>{2, 3, 4}}}, {{S2, S3}});
}

TEST_F(Interp, VecOverloads) {
  const auto x = rnd({2, 2, 11, 7}, 11);
  std::vector<RefFn> fns = {
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::upsample_bilinear2d(in[0], c10::nullopt, false, std::vector<double>{1.5, 0.6});
      },
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        const std::vector<int64_t> sz{5, 13};
        return at::upsample_bilinear2d(in[0], at::OptionalIntArrayRef(sz), true,
                                       c10::optional<at::ArrayRef<double>>());
      },
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::upsample_nearest2d(in[0], c10::nullopt, std::vector<double>{1.7, 2.0});
      },
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::upsample_bicubic2d(in[0], c10::nullopt, false, std::vector<double>{0.7, 1.3});
      },
  };
  for (size_t i = 0; i < fns.size(); ++i) {
    EXPECT_TRUE(check(fns[i], {sh(x, {S2, S3})})) << "fn " << i;
  }
}

TEST_F(Interp, Upsample2dModule) {
  torch::nn::Upsample up(torch::nn::UpsampleOptions()
                             .scale_factor(std::vector<double>{2.0, 2.0})
                             .mode(torch::kBilinear)
                             .align_corners(false));
  const auto x = rnd({1, 3, 7, 5}, 12);
  auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return up->forward(in[0]);
  };
  EXPECT_TRUE(check(fn, {sh(x, {S2, S3})}));
  EXPECT_TRUE(check(fn, {empty(x, {S3, S2})}));
}

TEST_F(Interp, PartialInput) {
  // A Partial input (pending sum) is resolved first: each rank holds x / k on
  // the Partial mesh dim, and the result is interpolate(x).
  const auto x = rnd({1, 2, 7, 5}, 13);
  const int64_t pm = mesh.ndim() - 1;  // the Partial mesh dim
  at::Tensor local = x / static_cast<double>(mesh.size(pm));
  st::Placements p(mesh.ndim(), st::Partial{});
  if (mesh.ndim() == 2) {
    p[0] = S2;
    local = at::tensor_split(local, mesh.size(0), 2)[mesh.coordinate()[0]].contiguous();
  }
  auto sx = st::ShardTensor::from_local(local, mesh, p);
  auto opts = F::InterpolateFuncOptions()
                  .size(std::vector<int64_t>{11, 9})
                  .mode(torch::kBilinear)
                  .align_corners(true);
  EXPECT_TRUE(all_close(gathered(F::interpolate(sx, opts)), F::interpolate(x, opts)));
}

TEST_F(Interp, Errors) {
  const auto x = rnd({1, 2, 13, 5}, 14);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S2, S3}));
  // scale 0.05 gives an output extent of 0: libtorch throws; so do we, naming the op.
  bool threw = false;
  try {
    F::interpolate(sx, F::InterpolateFuncOptions()
                           .scale_factor(std::vector<double>{0.05, 1.0})
                           .mode(torch::kBilinear)
                           .align_corners(false));
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("upsample_bilinear2d") != std::string::npos;
  }
  EXPECT_TRUE(threw);
  EXPECT_TRUE(all_ranks(true));  // nothing hangs
  // The out= overload runs the functional rule and copies into out= (Note
  // [out variants], src/ops/out_variants.cpp).
  auto out = st::distribute_tensor(at::zeros({1, 2, 26, 10}), mesh, fit_placements(mesh, {S2, S3}));
  at::upsample_nearest2d_out(out, sx, {26, 10}, c10::nullopt, c10::nullopt);
  EXPECT_TRUE(
      all_close(gathered(out), at::upsample_nearest2d(x, {26, 10}, c10::nullopt, c10::nullopt)));
}

// Note [split-phase interpolation] (src/ops/interpolate.cpp): integer scales
// with align_corners = false run libtorch's kernel on the local piece while
// the halo strips travel, then the boundary rows from strips. Extents 13 and
// 10 give uneven pieces (13 on 4 ranks: 4, 3, 3, 3; the output-first blocks
// 7, 7, 6, 6 are not s times the pieces, so the interior is copied into the
// block), the empty(...) inputs an empty first piece (no split: the general
// path), and both float32 and float64 (the taps are checked in the input's
// precision). align_corners = true keeps the weighted gathers.
TEST_F(Interp, SplitPhase2d) {
  const auto xf = rnd({2, 3, 13, 10}, 21);
  const std::vector<Case> cases = {{std::vector<int64_t>{26, 20}},
                                   {std::nullopt, std::vector<double>{2.0, 2.0}},
                                   {std::vector<int64_t>{39, 30}},
                                   {std::nullopt, std::vector<double>{3.0, 3.0}},
                                   {std::nullopt, std::vector<double>{2.0, 3.0}},
                                   {std::vector<int64_t>{13, 20}}};
  const std::vector<P> layouts = {{S2, S3}, {S3, S2}, {S2, S0}, {S1, S3}};
  for (auto dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(dtype == at::kFloat ? "float32" : "float64");
    const auto x = xf.to(dtype);
    sweep(torch::kNearest, x, cases, layouts);
    sweep(torch::kNearestExact, x, cases, layouts);
    sweep(torch::kBilinear, x, cases, layouts, kBothAlign);
    sweep(torch::kBicubic, x, cases, layouts, {false}, kCubicAtol);
  }
}

TEST_F(Interp, SplitPhase1d3d) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(dtype == at::kFloat ? "float32" : "float64");
    const auto x1 = rnd({2, 3, 13}, 22).to(dtype);
    const std::vector<Case> c1 = {{std::vector<int64_t>{26}},
                                  {std::nullopt, std::vector<double>{2.0}},
                                  {std::vector<int64_t>{39}},
                                  {std::nullopt, std::vector<double>{3.0}}};
    sweep(torch::kNearest, x1, c1, {{S2}, {S2, S0}});
    sweep(torch::kNearestExact, x1, c1, {{S2}});
    sweep(torch::kLinear, x1, c1, {{S2}, {S2, S1}}, {false});
    const auto x3 = rnd({1, 2, 13, 6, 5}, 23).to(dtype);
    const std::vector<Case> c3 = {{std::vector<int64_t>{26, 12, 10}},
                                  {std::nullopt, std::vector<double>{2.0, 2.0, 2.0}},
                                  {std::nullopt, std::vector<double>{3.0, 2.0, 3.0}}};
    sweep(torch::kTrilinear, x3, c3, {{S2, S3}, {S4, S2}}, {false}, kAtol,
          /*f32_accuracy=*/true);  // Note [float32 interpolation gradients]
    sweep(torch::kNearest, x3, c3, {{S2, S3}, {S4, S2}});
  }
}

TEST_F(Interp, SplitPhaseSmallPieces) {
  // Pieces of 0-2 rows: bicubic blocks with no interior (and empty pieces)
  // must take the general path on every rank; bilinear / nearest may split
  // where every piece has an interior.
  const auto x = rnd({1, 2, 3, 5}, 24);
  const std::vector<Case> cases = {{std::nullopt, std::vector<double>{2.0, 2.0}},
                                   {std::vector<int64_t>{9, 15}}};
  sweep(torch::kBicubic, x, cases, {{S2, S3}, {S3, S2}}, {false}, kCubicAtol);
  sweep(torch::kBilinear, x, cases, {{S2, S3}, {S3, S2}}, {false});
  sweep(torch::kNearest, x, cases, {{S2, S3}, {S3, S2}});
  const auto y = rnd({1, 2, 5, 4}, 25);
  sweep(torch::kBicubic, y, cases, {{S2, S3}}, {false}, kCubicAtol);
  sweep(torch::kBilinear, y, cases, {{S2, S3}}, {false});
}

// The split path holds no piece-sized copy: the sharded forward's scratch
// (peak minus the output) against libtorch's own upsample on a copy of the
// piece. Even pieces (384 x 384 on up to 4 ranks or 2x2) make the
// local kernel's output exactly the block, so only the strips are extra. The
// general path (SHARDTENSOR_INTERP_SPLIT=0) holds the halo-extended piece and
// the kernel's output on it: more than half a piece extra, failing here. With
// autograd on, what the forward leaves alive beyond the output (the saved
// tensors) is small too: no halo-extended copy is saved.
TEST_F(Interp, SplitPhaseHoldsNoPaddedCopy) {
  const int64_t C = 2, H = 384, W = 384;
  auto x = rnd({1, C, H, W}, 26);
  for (const P& want : {P{S2, R}, P{S2, S3}, P{S3, S2}}) {
    const P pl = fit_placements(mesh, want);
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(st::to_string(pl) + " mode " + std::to_string(mode));
      auto fn = [mode](const at::Tensor& t) {
        auto o = F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0});
        if (mode == 0) return F::interpolate(t, o.mode(torch::kBilinear).align_corners(false));
        if (mode == 1) return F::interpolate(t, o.mode(torch::kBicubic).align_corners(false));
        return F::interpolate(t, o.mode(torch::kNearest));
      };
      auto sx = st::distribute_tensor(x, mesh, pl, false);
      at::Tensor piece = st::ShardTensor(sx).local().clone();
      const int64_t piece_bytes = piece.numel() * static_cast<int64_t>(sizeof(float));
      // One output row or column of the piece's block (the widest).
      const int64_t row_bytes =
          C * 2 * std::max(piece.size(2), piece.size(3)) * static_cast<int64_t>(sizeof(float));
      int64_t plain_extra = 0, extra = 0;
      {
        torch::NoGradGuard no_grad;
        const int64_t base = st::memory_stats().current_bytes;
        st::reset_peak_memory_stats();
        at::Tensor out = fn(piece);
        plain_extra = st::memory_stats().peak_bytes - base -
                      out.numel() * static_cast<int64_t>(sizeof(float));
      }
      at::Tensor out;
      {
        torch::NoGradGuard no_grad;
        const int64_t base = st::memory_stats().current_bytes;
        st::reset_peak_memory_stats();
        out = fn(sx);
        extra = st::memory_stats().peak_bytes - base -
                st::ShardTensor(out).local().numel() * static_cast<int64_t>(sizeof(float));
      }
      if (mesh.rank() == 0) {
        std::printf(
            "[ split interp ] P=%lld %s mode %d forward scratch: sharded %.3f MB, plain on the "
            "piece %.3f MB (piece %.3f MB)\n",
            static_cast<long long>(mesh.size()), st::to_string(pl).c_str(), mode, extra / 1e6,
            plain_extra / 1e6, piece_bytes / 1e6);
      }
      // Strips: a few input rows each, their kernel outputs (s times as many rows).
      EXPECT_TRUE(all_ranks(extra - plain_extra <= 24 * row_bytes))
          << "sharded extra " << extra << " plain extra " << plain_extra << " row " << row_bytes;
      EXPECT_TRUE(all_ranks(mesh.size() == 1 || extra - plain_extra < piece_bytes / 2));
      EXPECT_TRUE(all_close(gathered(out), fn(x), kRtol, mode == 1 ? kCubicAtol : kAtol));
      out = at::Tensor();
      // Saved for backward: nothing piece-sized beyond the output.
      auto sxg = st::distribute_tensor(x, mesh, pl, true);
      const int64_t base = st::memory_stats().current_bytes;
      at::Tensor y = fn(sxg);
      const int64_t held = st::memory_stats().current_bytes - base -
                           st::ShardTensor(y).local().numel() * static_cast<int64_t>(sizeof(float));
      EXPECT_TRUE(all_ranks(held <= 8 * row_bytes)) << "held " << held << " row " << row_bytes;
      y.sum().backward();
    }
  }
}
