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
             std::vector<std::optional<bool>> aligns = {std::nullopt}, double atol = kAtol) {
    for (const auto& align : aligns) {
      for (const auto& c : cases) {
        auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], options(mode, c, align));
        };
        for (size_t l = 0; l < layouts.size(); ++l) {
          EXPECT_TRUE(reference_check(fn, {sh(x, layouts[l])}, mesh, {}, kRtol, atol))
              << str(c) << " align=" << (align ? int(*align) : -1) << " layout " << l;
        }
        EXPECT_TRUE(reference_check(fn, {empty(x, layouts[0])}, mesh, {}, kRtol, atol))
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

// Note [nearest 2x special case]: when out == 2 * in but a scale != 2 is given,
// libtorch 1.13's forward uses floor(o / scale) while its backward kernel
// (nearest_idx) uses o / 2, so its gradient is not the adjoint of its forward.
// The rule is the forward (and its exact adjoint); only the forward is compared.
TEST_F(Interp, Nearest1dDoubleWithGivenScale) {
  const auto x = rnd({2, 3, 13}, 15);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return F::interpolate(in[0], F::InterpolateFuncOptions()
                                     .mode(torch::kNearest)
                                     .scale_factor(std::vector<double>{2.05})
                                     .recompute_scale_factor(false));
  };
  EXPECT_TRUE(reference_check(fn, {sh(x, {S2})}, mesh, {}, kRtol, kAtol, false));
  EXPECT_TRUE(reference_check(fn, {empty(x, {S2})}, mesh, {}, kRtol, kAtol, false));
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
