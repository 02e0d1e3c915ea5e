// Normalization rules (src/ops/norm.cpp) compared with plain libtorch on the
// full tensors: output, input gradient, weight and bias gradients, running
// statistics after several training steps, eval mode. Layouts are written for
// a 2x2 mesh (batch x space, or two spatial dims) and trimmed by
// fit_placements() on a 1-D mesh, so the same test covers 1, 2, 3 and 4 ranks
// and the 2x2 mesh. Extents are uneven over 2, 3 and 4; the empty cases give
// coordinate 0 of every sharded mesh dim an empty piece.
//
// Tolerances: rtol 1e-5 and atol 1e-5. Statistics, weight and bias gradients
// sum float32 values over the ranks (partial sums, then an all-reduce) in an
// order different from libtorch's kernel; the rounding scales with the sum of
// the magnitudes (a few hundred terms of order 1), not with the possibly
// cancelling result, so entries near zero need the absolute floor.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <shardtensor/core/comm.h>

#include <sstream>

#include "testing.h"

namespace st = shardtensor;
namespace F = torch::nn::functional;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-5;

std::string describe(const P& p, bool empty) {
  return st::to_string(p) + (empty ? " empty-first" : "");
}

class Norm : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(1234); }

  st::DeviceMesh mesh = test_mesh();

  RefInput input(const at::Tensor& full, const P& wanted, bool empty) {
    auto p = fit_placements(mesh, wanted);
    std::optional<st::ShardSizes> sizes;
    if (empty) sizes = sizes_with_empty_first(mesh, p, full.sizes());
    return RefInput{full, p, true, sizes};
  }

  // Runs `fn(x, params)` on every layout, balanced and empty-first.
  void sweep(const std::string& name, const RefFn& fn, const at::Tensor& full,
             const std::vector<P>& layouts, const std::vector<at::Tensor>& params = {}) {
    for (const auto& layout : layouts) {
      for (bool empty : {false, true}) {
        RefInput in = input(full, layout, empty);
        EXPECT_TRUE(reference_check(fn, {in}, mesh, params, kRtol, kAtol))
            << name << " on " << describe(*in.placements, empty);
      }
    }
  }

  // Trains a module on plain and on sharded inputs for `steps` steps and
  // compares outputs, input gradients, parameter gradients and buffers after
  // every step, then the eval-mode outputs. `ref` and `sh` must be identical.
  template <class M>
  void train_compare(const std::string& name, M ref, M sh, c10::IntArrayRef shape, const P& layout,
                     bool empty, int steps = 3) {
    const std::string where = name + " on " + describe(fit_placements(mesh, layout), empty);
    auto params = ref->parameters();
    auto sparams = sh->parameters();
    {
      torch::NoGradGuard ng;  // non-trivial affine parameters, the same in both
      for (size_t i = 0; i < params.size(); ++i) {
        auto v = rnd(params[i].sizes(), 50 + i);
        params[i].copy_(v);
        sparams[i].copy_(v);
      }
    }
    for (int step = 0; step < steps + 1; ++step) {
      const bool eval = step == steps;
      if (eval) {
        ref->eval();
        sh->eval();
      }
      at::Tensor x = rnd(shape, 100 + step, 2.0, 0.5 * step);
      RefInput in = input(x, layout, empty);
      at::Tensor xr = x.clone().requires_grad_(true);
      at::Tensor xs = st::distribute_tensor(x, mesh, *in.placements, true, in.sizes);
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      for (auto& p : sparams) p.mutable_grad() = at::Tensor();
      at::Tensor yr = ref->forward(xr);
      at::Tensor ys = sh->forward(xs);
      at::Tensor cot = rnd(yr.sizes(), 200 + step);
      (yr * cot).sum().backward();
      (ys * cot).sum().backward();
      const std::string at_step = where + (eval ? " (eval)" : " step " + std::to_string(step));
      EXPECT_TRUE(all_close(gathered(ys), yr, kRtol, kAtol)) << at_step << ": output";
      EXPECT_TRUE(all_close(gathered(st::ShardTensor(xs).grad()), xr.grad(), kRtol, kAtol))
          << at_step << ": input grad";
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(all_close(sparams[i].grad(), params[i].grad(), kRtol, kAtol))
            << at_step << ": grad of parameter " << i;
      }
      auto rb = ref->buffers();
      auto sb = sh->buffers();
      for (size_t i = 0; i < rb.size(); ++i) {
        if (!rb[i].defined()) continue;
        EXPECT_TRUE(all_close(sb[i], rb[i], kRtol, kAtol)) << at_step << ": buffer " << i;
      }
    }
  }

  // EXPECT that `fn` throws a c10::Error containing every `needle` on every rank.
  void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
    EXPECT_TRUE(throws_everywhere(fn, needles));
  }
};

// Batch x space, two spatial dims, space x batch, replicated x space (2x2 mesh); on a 1-D
// mesh: Shard(0), Shard(2), Shard(3), Replicate (the local path).
const std::vector<P> kLayouts4d = {{S0, S2}, {S2, S3}, {S3, S0}, {R, S2}};

}  // namespace

// ---------------------------------------------------------------- batch_norm

TEST_F(Norm, BatchNormFunctionalTraining) {
  auto fn = [](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
    auto rm = torch::zeros({3}), rv = torch::ones({3});
    return F::batch_norm(
        x[0], rm, rv,
        F::BatchNormFuncOptions().weight(p[0]).bias(p[1]).training(true).momentum(0.2).eps(1e-3));
  };
  sweep("F::batch_norm", fn, rnd({5, 3, 7, 6}, 1, 1.5, 0.3), kLayouts4d,
        {rnd({3}, 2), rnd({3}, 3)});
}

TEST_F(Norm, BatchNormNoAffine) {
  auto fn = [](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>&) {
    return torch::batch_norm(x[0], {}, {}, {}, {}, true, 0.1, 1e-5, false);
  };
  sweep("batch_norm(no weight, no running stats)", fn, rnd({5, 3, 7, 6}, 4), kLayouts4d);
}

TEST_F(Norm, BatchNormFunctionalEval) {
  auto fn = [](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
    auto rm = rnd({3}, 7), rv = rnd({3}, 8).abs() + 0.5;
    return F::batch_norm(x[0], rm, rv,
                         F::BatchNormFuncOptions().weight(p[0]).bias(p[1]).training(false));
  };
  sweep("F::batch_norm eval", fn, rnd({5, 3, 7, 6}, 5), kLayouts4d, {rnd({3}, 2), rnd({3}, 3)});
}

// Regression (found by tests/fuzz, seeds 302753 and 311602 at 3 ranks).
// libtorch's CPU batch_norm backward (1.13, and still 2.13) is wrong for an
// input or an incoming gradient that is channels-last contiguous while
// suggest_memory_format() says Contiguous, here x.transpose(3, 1) of
// [N, 1, H, C] (strides [H*C, 1, C, H*C]). With plain tensors .contiguous()
// avoids the input side; on a ShardTensor .contiguous() does not reach the
// local piece, so the rule's local and plain paths (Replicate, eval mode,
// P = 1) returned wrong input gradients (Note [batch_norm strides]).
TEST_F(Norm, BatchNormOfTransposedPiece) {
  auto src = rnd({2, 1, 4, 8}, 30, 1.5, 0.2);
  for (bool training : {true, false}) {
    auto fn = [training](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
      at::Tensor t = x[0].transpose(3, 1).contiguous();  // [2, 8, 4, 1]
      return torch::batch_norm(t, p[0], p[1], rnd({8}, 31), rnd({8}, 32).abs() + 0.5, training, 0.1,
                               1e-5, false);
    };
    // The gradient side (seed 311602): a transpose after batch_norm hands its
    // backward a gradient in that layout. The reference dodges libtorch's bug
    // with a hook that makes its gradient contiguous; the rule must do the same.
    auto after = [training](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
      at::Tensor y = torch::batch_norm(x[0].transpose(3, 1).contiguous(), p[0], p[1], rnd({8}, 31),
                                       rnd({8}, 32).abs() + 0.5, training, 0.1, 1e-5, false);
      if (!st::ShardTensor::is_shard_tensor(y)) {
        y.register_hook([](const at::Tensor& g) { return g.contiguous(); });
      }
      return y.transpose(3, 1);
    };
    for (const P& layout : std::vector<P>{{R, R}, {S0, R}, {S2, R}, {R, S2}}) {
      for (bool empty : {false, true}) {
        RefInput in = input(src, layout, empty);
        for (const auto& [f, what] :
             {std::make_pair(RefFn(fn), "input"), std::make_pair(RefFn(after), "gradient")}) {
          EXPECT_TRUE(reference_check(f, {in}, mesh, {rnd({8}, 33), rnd({8}, 34)}, kRtol, kAtol))
              << what << " layout, " << (training ? "train" : "eval") << " on "
              << describe(*in.placements, empty);
        }
      }
    }
  }
}

TEST_F(Norm, BatchNorm1dModule) {
  for (bool empty : {false, true}) {
    // (N, C): only the batch can be sharded.
    train_compare("BatchNorm1d (N, C)", torch::nn::BatchNorm1d(4), torch::nn::BatchNorm1d(4),
                  {9, 4}, {S0}, empty);
    // (N, C, L)
    for (const P& layout : std::vector<P>{{S0, S2}, {S2, S0}}) {
      train_compare("BatchNorm1d (N, C, L)", torch::nn::BatchNorm1d(3), torch::nn::BatchNorm1d(3),
                    {5, 3, 11}, layout, empty);
    }
  }
}

TEST_F(Norm, BatchNorm2dModule) {
  for (const P& layout : kLayouts4d) {
    for (bool empty : {false, true}) {
      train_compare("BatchNorm2d", torch::nn::BatchNorm2d(3), torch::nn::BatchNorm2d(3),
                    {5, 3, 7, 6}, layout, empty);
    }
  }
}

TEST_F(Norm, BatchNorm3dModule) {
  for (const P& layout : std::vector<P>{{S0, S2}, {S3, S4}, {S4, S0}}) {
    for (bool empty : {false, true}) {
      train_compare("BatchNorm3d", torch::nn::BatchNorm3d(2), torch::nn::BatchNorm3d(2),
                    {3, 2, 5, 6, 5}, layout, empty);
    }
  }
}

TEST_F(Norm, BatchNormCumulativeMomentum) {
  // momentum = None: cumulative moving average driven by num_batches_tracked.
  auto opts = torch::nn::BatchNormOptions(3).momentum(c10::nullopt);
  for (const P& layout : kLayouts4d) {
    train_compare("BatchNorm2d(momentum=None)", torch::nn::BatchNorm2d(opts),
                  torch::nn::BatchNorm2d(opts), {5, 3, 7, 6}, layout, false, 4);
  }
}

TEST_F(Norm, BatchNormOptions) {
  for (const P& layout : kLayouts4d) {
    auto no_track = torch::nn::BatchNormOptions(3).track_running_stats(false);
    train_compare("BatchNorm2d(track_running_stats=false)", torch::nn::BatchNorm2d(no_track),
                  torch::nn::BatchNorm2d(no_track), {5, 3, 7, 6}, layout, false);
    auto no_affine = torch::nn::BatchNormOptions(3).affine(false).momentum(0.5).eps(1e-2);
    train_compare("BatchNorm2d(affine=false, momentum=0.5)", torch::nn::BatchNorm2d(no_affine),
                  torch::nn::BatchNorm2d(no_affine), {5, 3, 7, 6}, layout, true);
  }
}

TEST_F(Norm, BatchNormRunningStatsOnEveryRank) {
  // After training, every rank holds the same buffers, equal to single-process.
  torch::manual_seed(3);
  torch::nn::BatchNorm2d ref(3);
  torch::manual_seed(3);
  torch::nn::BatchNorm2d sh(3);
  auto p = fit_placements(mesh, {S0, S2});
  for (int step = 0; step < 4; ++step) {
    at::Tensor x = rnd({6, 3, 5, 7}, 300 + step, 3.0, 1.0 + step);
    ref->forward(x);
    sh->forward(st::distribute_tensor(x, mesh, p, false));
  }
  EXPECT_TRUE(all_close(sh->running_mean, ref->running_mean, kRtol, kAtol));
  EXPECT_TRUE(all_close(sh->running_var, ref->running_var, kRtol, kAtol));
  EXPECT_TRUE(all_ranks(sh->num_batches_tracked.item<int64_t>() == 4));
  // Identical on every rank, bit for bit.
  at::Tensor mine = at::cat({sh->running_mean, sh->running_var}).to(at::kDouble).contiguous();
  at::Tensor hi = st::testing::reduce_over_ranks(mine, st::ReduceOp::Max);
  at::Tensor lo = st::testing::reduce_over_ranks(mine, st::ReduceOp::Min);
  EXPECT_TRUE(all_ranks(hi.equal(lo)));
}

// ---------------------------------------------------------------- group_norm

TEST_F(Norm, GroupNormModule) {
  for (bool affine : {true, false}) {
    for (const P& layout : kLayouts4d) {
      for (bool empty : {false, true}) {
        auto opts = torch::nn::GroupNormOptions(2, 6).affine(affine).eps(1e-4);
        train_compare(std::string("GroupNorm(2, 6) affine=") + (affine ? "on" : "off"),
                      torch::nn::GroupNorm(opts), torch::nn::GroupNorm(opts), {3, 6, 7, 5}, layout,
                      empty, 1);
      }
    }
  }
}

TEST_F(Norm, GroupNormShapes) {
  auto gn = [](int64_t g) {
    return [g](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
      return at::group_norm(x[0], g, p[0], p[1], 1e-5);
    };
  };
  // 1-D and 3-D spatial, one group (LayerNorm-like) and one group per channel.
  sweep("group_norm 3d-spatial g=2", gn(2), rnd({2, 4, 5, 3, 6}, 11, 1.0, 2.0),
        {{S2, S4}, {S0, S3}}, {rnd({4}, 12), rnd({4}, 13)});
  sweep("group_norm 1d-spatial g=1", gn(1), rnd({3, 4, 13}, 14), {{S2, S0}},
        {rnd({4}, 12), rnd({4}, 13)});
  sweep("group_norm g=C", gn(4), rnd({3, 4, 13}, 15), {{S2, S0}}, {rnd({4}, 12), rnd({4}, 13)});
  // Unsharded spatial dims (only the batch): local.
  sweep("group_norm batch-sharded", gn(2), rnd({5, 4, 3}, 16), {{S0, R}},
        {rnd({4}, 12), rnd({4}, 13)});
}

// Note [group norm fast forward]: ranks whose pieces are well conditioned
// (|mean_l| rstd_l <= 16) normalize with libtorch's kernel and an affine
// correction; a piece with a large offset (rows 8.. shifted by 300) or a
// constant group (rank 0's first rows at 4 ranks) takes the two-pass path.
// Mixed on one statistic, the result must still be the global one.
TEST_F(Norm, GroupNormMixedFastAndTwoPassPieces) {
  auto gn = [](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& p) {
    return at::group_norm(x[0], 2, p[0], p[1], 1e-5);
  };
  at::Tensor x = rnd({2, 4, 16, 6}, 31);
  x.narrow(2, 8, 8).add_(300.0);
  x.narrow(0, 0, 1).narrow(1, 0, 2).narrow(2, 0, 4).fill_(0.5);
  for (auto dt : {at::kFloat, at::kDouble}) {
    sweep(std::string("group_norm mixed paths ") + c10::toString(dt), gn, x.to(dt),
          {{S2, S0}, {S2, S3}}, {rnd({4}, 12).to(dt), rnd({4}, 13).to(dt)});
  }
}

// ---------------------------------------------------------------- instance_norm

TEST_F(Norm, InstanceNormModule) {
  for (bool affine : {true, false}) {
    for (bool track : {false, true}) {
      for (const P& layout : kLayouts4d) {
        auto opts = torch::nn::InstanceNormOptions(3).affine(affine).track_running_stats(track);
        train_compare(std::string("InstanceNorm2d affine=") + (affine ? "on" : "off") +
                          " track=" + (track ? "on" : "off"),
                      torch::nn::InstanceNorm2d(opts), torch::nn::InstanceNorm2d(opts),
                      {4, 3, 7, 6}, layout, track, 2);
      }
    }
  }
  for (const P& layout : std::vector<P>{{S2, S0}, {S0, S2}}) {
    auto opts = torch::nn::InstanceNormOptions(2).affine(true).track_running_stats(true);
    train_compare("InstanceNorm1d", torch::nn::InstanceNorm1d(opts),
                  torch::nn::InstanceNorm1d(opts), {3, 2, 13}, layout, false, 2);
  }
  for (const P& layout : std::vector<P>{{S3, S4}, {S0, S2}}) {
    auto opts = torch::nn::InstanceNormOptions(2).affine(true);
    train_compare("InstanceNorm3d", torch::nn::InstanceNorm3d(opts),
                  torch::nn::InstanceNorm3d(opts), {2, 2, 5, 6, 5}, layout, true, 1);
  }
}

// ---------------------------------------------------------------- layer_norm

TEST_F(Norm, LayerNormModule) {
  for (bool affine : {true, false}) {
    // Normalized over the two last dims, which are sharded; over the last dim
    // only, with a leading dim sharded (local) or the last dim sharded.
    auto two = torch::nn::LayerNormOptions({7, 6}).elementwise_affine(affine);
    auto one = torch::nn::LayerNormOptions({6}).elementwise_affine(affine).eps(1e-3);
    for (bool empty : {false, true}) {
      for (const P& layout : std::vector<P>{{S1, S2}, {S2, S0}, {S0, S1}}) {
        train_compare("LayerNorm({7, 6})", torch::nn::LayerNorm(two), torch::nn::LayerNorm(two),
                      {5, 7, 6}, layout, empty, 1);
      }
      for (const P& layout : std::vector<P>{{S0, S1}, {S2, S0}}) {
        train_compare("LayerNorm({6})", torch::nn::LayerNorm(one), torch::nn::LayerNorm(one),
                      {5, 7, 6}, layout, empty, 1);
      }
    }
  }
}

// ---------------------------------------------------------------- in a network

// A U-Net block: conv -> GroupNorm -> SiLU -> conv -> BatchNorm -> SiLU, trained
// for two steps on spatially (and batch x space) sharded input.
TEST_F(Norm, ConvNormBlock) {
  auto make = [] {
    torch::manual_seed(7);
    torch::nn::Sequential s(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                            torch::nn::GroupNorm(4, 8), torch::nn::SiLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)),
                            torch::nn::BatchNorm2d(8), torch::nn::SiLU());
    return s;
  };
  for (const P& layout : std::vector<P>{{S2, S3}, {S0, S2}}) {
    for (bool empty : {false, true}) {
      train_compare("conv-GN-SiLU-conv-BN-SiLU", make(), make(), {2, 3, 12, 10}, layout, empty, 2);
    }
  }
}

// ---------------------------------------------------------------- stability

// Note [sharded moments]: a field with mean 1e4, standard deviation 1 and
// about 1e6 elements per statistic, against a float64 reference computed from
// the same float32 values. A naive E[x^2] - E[x]^2 in float32 loses the
// variance entirely (ulp(1e8) = 8). The usual tolerances hold (rtol 1e-5,
// atol 1e-6 on the normalized output; 1e-7 and 1e-5 relative on the running
// mean and variance): the output is formed from x - shift (exact) and a small
// correction, so its error is a few float32 ulps of the deviation, far below
// the ~5e-4 that normalizing with a float32-rounded mean (ulp(1e4) ~ 1e-3)
// would give (and that libtorch's own kernels show on this field).
TEST_F(Norm, LargeMeanStability) {
  const std::vector<int64_t> shape{2, 2, 500, 1000};  // 1e6 elements per channel
  at::Tensor x = rnd(shape, 77, 1.0, 1e4);
  at::Tensor xd = x.to(at::kDouble);
  auto p = fit_placements(mesh, {S2, S0});
  // Note [plain fast path]: with the spatial dim on a mesh dim of size 1
  // (one rank) the op is libtorch's, bit for bit, with libtorch's own
  // numerics (its float32 kernels are ~5e-4 off here); across ranks the
  // merged moments must meet the tolerances above.
  const bool plain = mesh.size(0) == 1;
  // Batch norm, training, with running statistics.
  {
    auto rm = torch::zeros({2}), rv = torch::ones({2});
    at::Tensor y = torch::batch_norm(st::distribute_tensor(x, mesh, p), {}, {}, rm, rv, true, 1.0,
                                     1e-5, false);
    if (plain) {
      auto rm0 = torch::zeros({2}), rv0 = torch::ones({2});
      at::Tensor y0 = torch::batch_norm(x, {}, {}, rm0, rv0, true, 1.0, 1e-5, false);
      EXPECT_TRUE(all_close(gathered(y), y0, 0, 0)) << "batch_norm output (plain)";
      EXPECT_TRUE(all_close(rm, rm0, 0, 0)) << "running_mean (plain)";
      EXPECT_TRUE(all_close(rv, rv0, 0, 0)) << "running_var (plain)";
    } else {
      at::Tensor mean = xd.mean({0, 2, 3});
      at::Tensor var_b = xd.var({0, 2, 3}, /*unbiased=*/false);
      at::Tensor var_u = xd.var({0, 2, 3}, /*unbiased=*/true);
      at::Tensor ref = (xd - mean.view({1, 2, 1, 1})) / (var_b.view({1, 2, 1, 1}) + 1e-5).sqrt();
      EXPECT_TRUE(all_close(gathered(y), ref, 1e-5, 1e-6)) << "batch_norm output";
      EXPECT_TRUE(all_close(rm, mean, 1e-7, 0)) << "running_mean";
      EXPECT_TRUE(all_close(rv, var_u, 1e-5, 0)) << "running_var";
    }
  }
  // Group norm, one group per sample: 2e6 elements per statistic.
  {
    at::Tensor y = at::group_norm(st::distribute_tensor(x, mesh, p), 1, {}, {}, 1e-5);
    if (plain) {
      EXPECT_TRUE(all_close(gathered(y), at::group_norm(x, 1, {}, {}, 1e-5), 0, 0))
          << "group_norm output (plain)";
    } else {
      at::Tensor mean = xd.mean({1, 2, 3}, true);
      at::Tensor var = xd.var({1, 2, 3}, false, true);
      at::Tensor ref = (xd - mean) / (var + 1e-5).sqrt();
      EXPECT_TRUE(all_close(gathered(y), ref, 1e-5, 1e-6)) << "group_norm output";
    }
  }
}

// ---------------------------------------------------------------- communication

// Eval-mode batch norm, layer norm over unsharded dims and group norm with
// only the batch sharded run locally: no forward communication. Training
// batch norm over sharded dims sends two all-reduces of the channel count.
TEST_F(Norm, CommunicationVolume) {
  at::Tensor x = rnd({4, 6, 5, 7}, 500);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2}));
  torch::nn::BatchNorm2d bn(6);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({7}));
  auto sb = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, R}));
  torch::nn::GroupNorm gn(3, 6);
  bn->eval();
  st::reset_comm_stats();
  bn->forward(sx);
  ln->forward(sx);
  gn->forward(sb);
  const int64_t local_bytes = st::comm_stats().bytes_sent;
  bn->train();
  st::reset_comm_stats();
  bn->forward(sx);
  const int64_t train_msgs = st::comm_stats().messages;
  EXPECT_TRUE(all_ranks(local_bytes == 0)) << local_bytes << " bytes sent by local paths";
  // Two all-reduces (shift; deviation sums) when more than one rank takes part.
  EXPECT_TRUE(all_ranks(mesh.size() == 1 || train_msgs > 0));
}

// ---------------------------------------------------------------- memory

// Note [norm backward]: what a chain of normalizations keeps between forward
// and backward (outputs and saved tensors) is, per rank, the single-process
// amount divided by P: no extra full-size copies. Extents divide by 2, 3, 4.
TEST_F(Norm, RetainedMemory) {
  const int64_t np = mesh.size();
  const std::vector<int64_t> shape{2, 8, 48, 36};
  torch::manual_seed(0);
  torch::nn::GroupNorm gn(4, 8);
  torch::nn::BatchNorm2d bn(8);
  auto chain = [&](const at::Tensor& x) {
    at::Tensor y = x;
    for (int i = 0; i < 2; ++i) y = bn->forward(gn->forward(y));
    return y;
  };
  const at::Tensor x = rnd(shape, 400);
  for (const P& layout : std::vector<P>{{S2, S3}, {S3, S2}}) {
    int64_t single = 0, sharded = 0;
    {
      at::Tensor xr = x.clone().requires_grad_(true);
      const int64_t base = st::memory_stats().current_bytes;
      at::Tensor y = chain(xr);
      single = st::memory_stats().current_bytes - base;
      y.sum().backward();
    }
    {
      at::Tensor sx = st::distribute_tensor(x, mesh, fit_placements(mesh, layout), true);
      const int64_t base = st::memory_stats().current_bytes;
      at::Tensor y = chain(sx);
      sharded = st::memory_stats().current_bytes - base;
      y.sum().backward();
    }
    const double ratio = static_cast<double>(sharded) / (static_cast<double>(single) / np);
    if (mesh.rank() == 0) {
      std::printf(
          "[ norm memory ] P=%lld retained after forward: single %.2f MB, sharded %.2f MB "
          "per rank, ratio to single/P = %.3f\n",
          static_cast<long long>(np), single / 1e6, sharded / 1e6, ratio);
    }
    EXPECT_TRUE(all_ranks(ratio <= 1.1)) << "ratio " << ratio;
  }
}

// ---------------------------------------------------------------- errors

TEST_F(Norm, Errors) {
  at::Tensor x = rnd({4, 6, 5, 5}, 9);
  auto ch = fit_placements(mesh, {S1, S2});
  auto sx = st::distribute_tensor(x, mesh, ch);
  // A sharded channel dim.
  expect_error([&] { torch::nn::BatchNorm2d(6)->forward(sx); },
               {"batch_norm", "channel", "Shard(1)", "[4, 6, 5, 5]"});
  expect_error([&] { torch::nn::GroupNorm(2, 6)->forward(sx); }, {"group_norm", "channel"});
  expect_error([&] { at::instance_norm(sx, {}, {}, {}, {}, true, 0.1, 1e-5, false); },
               {"instance_norm", "channel"});
  // Bad groups, bad weight, bad normalized shape: every rank throws.
  auto sp = st::distribute_tensor(x, mesh, fit_placements(mesh, {S2, S3}));
  expect_error([&] { at::group_norm(sp, 4, {}, {}, 1e-5); }, {"group_norm", "num_groups"});
  expect_error([&] { at::batch_norm(sp, torch::ones({5}), {}, {}, {}, true, 0.1, 1e-5, false); },
               {"batch_norm", "weight"});
  expect_error([&] { at::layer_norm(sp, {4}); }, {"layer_norm", "normalized_shape"});
}
