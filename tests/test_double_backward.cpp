// Second-order gradients (create_graph=true) through sharded ops, compared
// with plain single-process libtorch (torch::autograd::grad with
// create_graph=true on the full tensors): Note [differentiable adjoints]
// (src/comm/collectives.cpp), [conv double backward], [norm double backward],
// [sharded softmax], [ring attention double backward], [gradient carriers].
//
// For f(x, w) (inputs x, parameters w) every check computes, sharded and plain,
//   loss = sum(f * (c + f / 2))          (a fixed c; quadratic, so d2loss != 0)
//   g    = d loss / d(x, w)              (create_graph=true)
//   s    = sum_i sum(g_i * v_i)          (fixed v_i)
//   h    = d s / d(x, w)
// and compares g and h (gathered) with the plain run. h holds every second
// derivative term: f's own (softmax, norms, attention), the mixed x-w terms
// (conv), and J^T diag J through the loss (pooling, interpolation).
//
// The primitive tests check the adjoint of the adjoint: for y = A x with a
// cotangent c that requires grad, g = A^T c (create_graph) and s = <g, v>, so
// ds/dc must be A v, on every placement of x and y (Note [replicated gradients]).
//
// Layouts are written for a 2x2 mesh and trimmed by fit_placements() on a 1-D
// mesh; extents are uneven over 2, 3 and 4 ranks and the empty cases give
// coordinate 0 of every sharded mesh dim an empty piece.
//
// Tolerances: rtol 1e-4, atol 1e-5 (float32). The second derivatives sum
// products of first-order terms that are themselves reordered partial sums
// (statistics, softmax denominators, halo accumulations), so rounding is a
// few ulps of the summed magnitudes rather than of the (sometimes cancelling)
// result, as in test_norm.cpp; all algebra errors this test exists for are
// O(1) relative. The float64 case checks the same algebra at 1e-10.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "testing.h"

namespace st = shardtensor;
namespace comm = shardtensor::comm;
namespace F = torch::nn::functional;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-4;
constexpr double kAtol = 1e-5;

at::Tensor seeded(c10::IntArrayRef shape, uint64_t seed, at::ScalarType dt = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble).to(dt);
}

// ---- ops: second derivatives against plain libtorch -----------------------------------

std::vector<int64_t> global_shape(const at::Tensor& t) {
  if (st::ShardTensor::is_shard_tensor(t)) return st::ShardTensor(t).spec().global_shape();
  return t.sizes().vec();
}

struct Result {
  std::vector<at::Tensor> g, h;  // gathered, one per differentiated tensor
  bool consistent = true;        // every rank agreed that g is differentiable
};

// One run of the recipe above on `in` (plain or sharded) and `params` (plain).
Result second_order(const RefFn& fn, const std::vector<at::Tensor>& in,
                    const std::vector<at::Tensor>& params, bool sharded) {
  std::vector<at::Tensor> wrt;
  for (const auto& t : in) {
    if (t.requires_grad()) wrt.push_back(t);
  }
  for (const auto& p : params) wrt.push_back(p);
  at::Tensor out = fn(in, params);
  const std::vector<int64_t> shape = global_shape(out);
  const at::Tensor c = seeded(shape, 77, out.scalar_type());
  const at::Tensor loss = (out * (c + out * 0.5)).sum();
  auto grad = [&](const at::Tensor& y, bool create) {
    if (sharded) return st::grad({y}, wrt, {}, true, create, /*allow_unused=*/true);
    return torch::autograd::grad({y}, wrt, {}, true, create, /*allow_unused=*/true);
  };
  auto g = grad(loss, true);
  at::Tensor s;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!g[i].defined()) continue;
    const std::vector<int64_t> gshape = global_shape(g[i]);
    at::Tensor term = (g[i] * seeded(gshape, 300 + i, out.scalar_type())).sum();
    s = s.defined() ? s + term : term;
  }
  Result r;
  std::vector<at::Tensor> h(wrt.size());
  // A wrong library could make this differ between ranks: agree first, so
  // that the check fails instead of leaving ranks in different collectives.
  const bool differentiable = s.defined() && s.requires_grad();
  if (all_ranks(differentiable)) {
    h = grad(s, false);
  } else {
    r.consistent = all_ranks(!differentiable);
  }
  for (size_t i = 0; i < wrt.size(); ++i) {
    at::NoGradGuard no_grad;
    const std::vector<int64_t> wshape = global_shape(wrt[i]);
    auto full = [&](const at::Tensor& t) {
      return t.defined() ? gathered(t).detach() : at::zeros(wshape, out.options());
    };
    r.g.push_back(full(g[i]));
    r.h.push_back(full(h[i]));
  }
  return r;
}

// Collective. The recipe on plain tensors and on the sharded inputs; compares g and h.
::testing::AssertionResult double_backward_check(const RefFn& fn,
                                                 const std::vector<RefInput>& inputs,
                                                 const st::DeviceMesh& mesh,
                                                 const std::vector<at::Tensor>& params = {},
                                                 double rtol = kRtol, double atol = kAtol) {
  std::vector<at::Tensor> ref_in, sh_in, ref_p, sh_p;
  for (const auto& in : inputs) {
    const bool rg = in.requires_grad && in.full.is_floating_point();
    ref_in.push_back(in.full.detach().clone().requires_grad_(rg));
    sh_in.push_back(in.placements
                        ? st::distribute_tensor(in.full, mesh, *in.placements, rg, in.sizes)
                        : in.full.detach().clone().requires_grad_(rg));
  }
  for (const auto& p : params) {
    ref_p.push_back(p.detach().clone().requires_grad_(true));
    sh_p.push_back(p.detach().clone().requires_grad_(true));
  }
  Result ref = second_order(fn, ref_in, ref_p, false);
  Result sh = second_order(fn, sh_in, sh_p, true);
  bool ok = sh.consistent;
  std::ostringstream msg;
  if (!ok) msg << "\n  the ranks disagree whether the gradients are differentiable";
  for (size_t i = 0; i < ref.g.size(); ++i) {
    for (int order : {1, 2}) {
      auto r =
          all_close(order == 1 ? sh.g[i] : sh.h[i], order == 1 ? ref.g[i] : ref.h[i], rtol, atol);
      if (!r) {
        ok = false;
        msg << "\n  " << (order == 1 ? "gradient" : "second-order gradient") << " of tensor " << i
            << ": " << r.message();
      }
    }
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

class DoubleBackward : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  RefInput input(const at::Tensor& full, const P& wanted, bool empty) {
    return empty ? empty_first_input(mesh, full, wanted) : sharded_input(mesh, full, wanted);
  }

  // `fn` on every layout, balanced and empty-first.
  void sweep(const std::string& name, const RefFn& fn, const at::Tensor& full,
             const std::vector<P>& layouts, const std::vector<at::Tensor>& params = {}) {
    for (const auto& layout : layouts) {
      for (bool empty : {false, true}) {
        RefInput in = input(full, layout, empty);
        EXPECT_TRUE(double_backward_check(fn, {in}, mesh, params))
            << name << " on " << st::to_string(*in.placements) << (empty ? " empty-first" : "");
      }
    }
  }
};

TEST_F(DoubleBackward, Conv1dStrideDilationAndSame) {
  const at::Tensor x = seeded({2, 3, 13}, 1);
  const at::Tensor w = seeded({4, 3, 3}, 2, at::kFloat) * 0.5;
  const at::Tensor b = seeded({4}, 3);
  // k3 p1: the overlapped fast path forward (Note [conv overlap]) when pieces allow.
  sweep("conv1d k3 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::conv1d(in[0], p[0], F::Conv1dFuncOptions().bias(p[1]).padding(1));
        },
        x, {{S2, S0}}, {w, b});
  sweep("conv1d k3 stride 2 dilation 2 p2",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::conv1d(in[0], p[0], F::Conv1dFuncOptions().stride(2).dilation(2).padding(2));
        },
        x, {{S2, S0}}, {w});
}

TEST_F(DoubleBackward, Conv2dBothSpatialDims) {
  const at::Tensor x = seeded({2, 2, 9, 7}, 4);
  const at::Tensor w = seeded({3, 2, 3, 3}, 5) * 0.5;
  const at::Tensor b = seeded({3}, 6);
  sweep("conv2d k3 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::conv2d(in[0], p[0], F::Conv2dFuncOptions().bias(p[1]).padding(1));
        },
        x, {{S2, S3}, {S1, S2}}, {w, b});  // {S1, S2}: Note [channel-sharded conv]
  sweep("conv2d k3 stride 2 dilation (2, 1) p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::conv2d(in[0], p[0],
                           F::Conv2dFuncOptions().bias(p[1]).stride(2).dilation({2, 1}).padding(1));
        },
        x, {{S3, S2}}, {w, b});
}

TEST_F(DoubleBackward, BatchGroupInstanceAndLayerNorm) {
  const at::Tensor x = seeded({3, 4, 9}, 7) + 0.5;
  const at::Tensor w = seeded({4}, 8) * 0.3 + 1.0;
  const at::Tensor b = seeded({4}, 9);
  sweep("batch_norm",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::batch_norm(in[0], at::zeros({4}), at::ones({4}),
                               F::BatchNormFuncOptions().weight(p[0]).bias(p[1]).training(true));
        },
        x, {{S2, S0}}, {w, b});
  sweep("group_norm",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::group_norm(in[0], F::GroupNormFuncOptions(2).weight(p[0]).bias(p[1]));
        },
        x, {{S2, S0}}, {w, b});
  sweep("instance_norm",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::instance_norm(in[0], F::InstanceNormFuncOptions());
        },
        x, {{S2}});
  const at::Tensor y = seeded({3, 6, 5}, 10);
  const at::Tensor lw = seeded({6, 5}, 11) * 0.3 + 1.0;
  const at::Tensor lb = seeded({6, 5}, 12);
  sweep("layer_norm",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return F::layer_norm(in[0], F::LayerNormFuncOptions({6, 5}).weight(p[0]).bias(p[1]));
        },
        y, {{S1, S2}}, {lw, lb});
}

TEST_F(DoubleBackward, SoftmaxAndLogSoftmaxAlongShardedDim) {
  const at::Tensor x = seeded({3, 11}, 13) * 2.0;
  sweep("softmax",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::softmax(in[0], 1);
        },
        x, {{S1, S0}});
  sweep("log_softmax",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::log_softmax(in[0], 1);
        },
        x, {{S1, S0}});
}

// Note [logcumsumexp gradient]: the hand-written backward is differentiable.
TEST_F(DoubleBackward, LogcumsumexpAlongShardedDim) {
  const at::Tensor x = seeded({3, 11}, 13) * 2.0;
  sweep("logcumsumexp",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::logcumsumexp(in[0], 1);
        },
        x, {{S1, S0}, {S0, S1}});
}

TEST_F(DoubleBackward, MaxAndAvgPooling) {
  const at::Tensor x = seeded({2, 2, 9, 8}, 14);
  sweep("max_pool2d k3 s2 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::max_pool2d(in[0], F::MaxPool2dFuncOptions(3).stride(2).padding(1));
        },
        x, {{S2, S3}});
  sweep("avg_pool2d k3 s1 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::avg_pool2d(in[0], F::AvgPool2dFuncOptions(3).stride(1).padding(1));
        },
        x, {{S3, S2}});
}

// ConvTransposeFn (Note [transposed convolution memory]; {S2, S3} on the 2x2
// mesh), the split path under autograd (Note [split-phase transposed
// convolution]; one spatial dim sharded) and the 1-D pools lifted to 2-D in
// PoolFn (Note [pool saves no halo copy]).
TEST_F(DoubleBackward, ConvTransposeAndPool1d) {
  const at::Tensor x = seeded({2, 3, 9, 7}, 31);
  const at::Tensor w = seeded({3, 2, 3, 3}, 32) * 0.5;
  const at::Tensor b = seeded({2}, 33);
  sweep("conv_transpose2d k3 s2 p1 op1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return at::tanh(at::conv_transpose2d(in[0], p[0], p[1], {2, 2}, {1, 1}, {1, 1}));
        },
        x, {{S2, S3}, {S2, S0}}, {w, b});
  const at::Tensor x1 = seeded({2, 3, 13}, 34);
  sweep("max_pool1d k3 s2 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::max_pool1d(in[0], {3}, {2}, {1}).square();
        },
        x1, {{S2, S0}});
  sweep("avg_pool1d k3 s1 p1",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::avg_pool1d(in[0], {3}, {1}, {1}).square();
        },
        x1, {{S2, S0}});
}

TEST_F(DoubleBackward, InterpolationNearestAndLinear) {
  const at::Tensor x1 = seeded({2, 2, 7}, 15);
  sweep("nearest x2",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], F::InterpolateFuncOptions()
                                           .scale_factor(std::vector<double>{2.0})
                                           .mode(torch::kNearest));
        },
        x1, {{S2}});
  sweep("linear x2",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], F::InterpolateFuncOptions()
                                           .scale_factor(std::vector<double>{2.0})
                                           .mode(torch::kLinear)
                                           .align_corners(false));
        },
        x1, {{S2}});
  const at::Tensor x2 = seeded({1, 2, 5, 6}, 16);
  sweep("bilinear to (9, 11)",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], F::InterpolateFuncOptions()
                                           .size(std::vector<int64_t>{9, 11})
                                           .mode(torch::kBilinear)
                                           .align_corners(true));
        },
        x2, {{S2, S3}});
  // Note [split-phase interpolation]: strips, the block assembly (AssembleFn)
  // and its ties; two sharded dims on the 2x2 mesh.
  const at::Tensor x3 = seeded({1, 2, 9, 8}, 17);
  sweep("bilinear x2 split",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], F::InterpolateFuncOptions()
                                           .scale_factor(std::vector<double>{2.0, 2.0})
                                           .mode(torch::kBilinear)
                                           .align_corners(false));
        },
        x3, {{S2, S3}, {S3, S2}});
  sweep("bicubic x2 split",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return F::interpolate(in[0], F::InterpolateFuncOptions()
                                           .scale_factor(std::vector<double>{2.0, 2.0})
                                           .mode(torch::kBicubic)
                                           .align_corners(false));
        },
        x3, {{S2, S3}});
}

// A plain attention from its definition, the reference.
at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal) {
  const int64_t g = q.size(1) / k.size(1);
  at::Tensor s = at::matmul(q, k.repeat_interleave(g, 1).transpose(-2, -1)) /
                 std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    auto hidden = at::ones({q.size(2), k.size(2)}, at::kBool).triu(1);
    s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(s, -1), v.repeat_interleave(g, 1));
}

TEST_F(DoubleBackward, RingAttention) {
  for (bool causal : {false, true}) {
    for (int64_t hkv : {2, 1}) {  // hkv = 1: grouped-query heads
      for (bool empty : {false, true}) {
        const at::Tensor q = seeded({2, 2, 11, 4}, 17);
        const at::Tensor k = seeded({2, hkv, 11, 4}, 18);
        const at::Tensor v = seeded({2, hkv, 11, 4}, 19);
        const P layout{S2, S0};
        auto fn = [causal](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          if (st::ShardTensor::is_shard_tensor(in[0])) {
            return st::scaled_dot_product_attention(in[0], in[1], in[2], {}, causal);
          }
          return plain_attention(in[0], in[1], in[2], causal);
        };
        EXPECT_TRUE(double_backward_check(
            fn, {input(q, layout, empty), input(k, layout, empty), input(v, layout, empty)}, mesh))
            << "causal " << causal << " hkv " << hkv << (empty ? " empty-first" : "");
      }
    }
  }
}

// Note [ring matmul]: softmax(q @ k^T) @ v with q, k, v sequence-sharded: both
// rings (rows vs cols, rows vs k); double backward recomputes from gathered blocks.
TEST_F(DoubleBackward, RingMatmul) {
  for (bool empty : {false, true}) {
    const at::Tensor q = seeded({2, 11, 4}, 23), k = seeded({2, 11, 4}, 24);
    const at::Tensor v = seeded({2, 11, 3}, 25);
    const P layout{S1, S0};
    auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      return at::matmul(at::softmax(at::matmul(in[0], in[1].transpose(-2, -1)), -1), in[2]);
    };
    EXPECT_TRUE(double_backward_check(
        fn, {input(q, layout, empty), input(k, layout, empty), input(v, layout, empty)}, mesh))
        << (empty ? "empty-first" : "balanced");
  }
}

// Linear over a sharded feature dim: partial products all-reduced (all_reduce
// / use_replicated in both backward passes).
TEST_F(DoubleBackward, LinearContractingShardedFeatures) {
  const at::Tensor x = seeded({4, 7}, 20);
  const at::Tensor w = seeded({5, 7}, 21) * 0.5;
  const at::Tensor b = seeded({5}, 22);
  sweep("linear + tanh",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          return at::tanh(F::linear(in[0], p[0], p[1]));
        },
        x, {{S1, S0}}, {w, b});
}

// Note [pending partial sums]: the sharded contractions stay Partial through the
// linear ops (scaling, difference, a replicated right factor and a bias) and are
// summed once, by tanh; the replicated weights' gradients are summed over the
// Partial mesh dim, to second order.
TEST_F(DoubleBackward, PendingPartialChain) {
  const at::Tensor x = seeded({4, 7}, 23);
  const at::Tensor w1 = seeded({7, 5}, 24) * 0.5, w2 = seeded({7, 5}, 25) * 0.5;
  const at::Tensor v = seeded({5, 3}, 26) * 0.5, b = seeded({3}, 27);
  sweep("pending partial chain",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          at::Tensor y = at::matmul(in[0], p[0]) * 2 - at::matmul(in[0], p[1]);
          return at::tanh(F::linear(y, p[2].t(), p[3]) * y.sum(1, true));
        },
        x, {{S1, S0}, {S1, R}}, {w1, w2, v, b});
}

// Losses (all-reduced sums over constant denominators), the distributed FFT
// (all-to-all plans) and an op without a rule (the generic fallback's gathers).
TEST_F(DoubleBackward, LossesFftAndFallback) {
  st::set_strict(false);
  const at::Tensor x = seeded({4, 3, 6}, 34);
  const at::Tensor target = seeded({4, 3, 6}, 35);
  const at::Tensor classes =
      at::randint(0, 3, {4, 6}, at::make_generator<at::CPUGeneratorImpl>(36));
  sweep("mse_loss(tanh)",
        [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::mse_loss(at::tanh(in[0]), target);
        },
        x, {{S2, S0}});
  sweep("cross_entropy",
        [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::cross_entropy_loss(in[0], classes);
        },
        x, {{S2, S0}});
  // The pencil needs a dim that no mesh dim shards (dim 1 here).
  const at::Tensor z = seeded({2, 3, 10}, 38);
  sweep("irfft(rfft(x * x))",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return torch::fft::irfft(torch::fft::rfft(in[0] * in[0], c10::nullopt, 2), 10, 2);
        },
        z, {{S2, S0}});
  const at::Tensor y = seeded({3, 10}, 37);
  sweep("renorm (generic fallback)",
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return at::renorm(in[0], 2, 0, 1.5);
        },
        y, {{S1, S0}});
}

// Reductions with gradient carriers (Note [gradient carriers]): exact in double backward.
TEST_F(DoubleBackward, ReductionCarriers) {
  const at::Tensor x = seeded({3, 10}, 23) + 0.3;
  const std::vector<std::pair<std::string, std::function<at::Tensor(const at::Tensor&)>>> ops = {
      {"std", [](const at::Tensor& t) { return t.std(1); }},
      {"var", [](const at::Tensor& t) { return t.var(1); }},
      {"vector_norm 2",
       [](const at::Tensor& t) { return at::linalg_vector_norm(t, 2, std::vector<int64_t>{1}); }},
      {"vector_norm 3",
       [](const at::Tensor& t) { return at::linalg_vector_norm(t, 3, std::vector<int64_t>{1}); }},
      {"vector_norm 1.5",
       [](const at::Tensor& t) { return at::linalg_vector_norm(t, 1.5, std::vector<int64_t>{1}); }},
      {"amax", [](const at::Tensor& t) { return t.amax(1); }},
      {"logsumexp", [](const at::Tensor& t) { return t.logsumexp(1); }},
      {"mean of squares", [](const at::Tensor& t) { return (t * t).mean(); }},
  };
  for (const auto& [name, op] : ops) {
    sweep(name,
          [op = op](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
            return op(in[0]).exp();
          },
          x, {{S1, S0}});
  }
}

TEST_F(DoubleBackward, Float64Conv2dAndLayerNorm) {
  const at::Tensor x = seeded({2, 2, 7, 6}, 24, at::kDouble);
  const at::Tensor w = seeded({2, 2, 3, 3}, 25, at::kDouble);
  const at::Tensor lw = seeded({7, 6}, 26, at::kDouble);
  for (bool empty : {false, true}) {
    EXPECT_TRUE(double_backward_check(
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
          at::Tensor y = F::conv2d(in[0], p[0], F::Conv2dFuncOptions().padding(1));
          return F::layer_norm(y, F::LayerNormFuncOptions({7, 6}).weight(p[1]));
        },
        {input(x, {S2, S3}, empty)}, mesh, {w, lw}, 1e-10, 1e-12))
        << (empty ? "empty-first" : "balanced");
  }
}

// Message passing with plain ops on row-sharded nodes and edges (Note [graph
// op rules]): index_select and gather go through ghost_exchange, sums and
// means through ghost_accumulate (autograd), amax/amin through the
// hand-written ScatterCombineFn, whose backward is differentiable.
TEST_F(DoubleBackward, GraphIndexAndScatterOps) {
  const int64_t N = 11, E = 23;
  const at::Tensor x = seeded({N, 2}, 27);
  const at::Tensor src = seeded({E, 2}, 28);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(29);
  const at::Tensor idx = at::randint(N, {E, 2}, gen, at::kLong);
  for (bool empty : {false, true}) {
    // An empty first node piece, or an empty first edge piece (index and src alike).
    const std::vector<RefInput> in = {input(x, {S0, R}, empty),
                                      empty ? sharded_input(mesh, idx, {S0, R}, false)
                                            : empty_first_input(mesh, idx, {S0, R}, false),
                                      input(src, {S0, R}, !empty)};
    EXPECT_TRUE(double_backward_check(
        [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
          at::Tensor m = at::tanh(t[0].gather(0, t[1]) + t[2]);
          return t[0].index_add(0, t[1].select(1, 0), m * t[0].index_select(0, t[1].select(1, 1)));
        },
        in, mesh))
        << "gather / index_select / index_add" << (empty ? " empty-first" : "");
    for (const char* reduce : {"sum", "mean", "amax", "amin"}) {
      for (bool include_self : {true, false}) {
        EXPECT_TRUE(double_backward_check(
            [&](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
              return t[0].scatter_reduce(0, t[1], t[2] * t[2], reduce, include_self);
            },
            in, mesh))
            << reduce << " include_self=" << include_self << (empty ? " empty-first" : "");
      }
    }
  }
  // prod's coefficients are computed as constants: double backward refuses.
  const P rows = fit_placements(mesh, {S0, R});
  at::Tensor sx = st::distribute_tensor(x, mesh, rows, true);
  at::Tensor ss = st::distribute_tensor(src, mesh, rows, true);
  at::Tensor y = sx.scatter_reduce(0, st::distribute_tensor(idx, mesh, rows), ss, "prod").sum();
  EXPECT_TRUE(throws_everywhere([&] { st::grad({y}, {ss}, {}, true, /*create_graph=*/true); },
                                {"double backward", "prod", "not supported"}));
}

// ShardTensor.backward(gradient, retain_graph, create_graph) accumulates a
// differentiable gradient, as torch does; a second backward adds the second
// derivative on top of it.
TEST_F(DoubleBackward, ShardTensorBackwardWithCreateGraph) {
  const at::Tensor full = seeded({2, 2, 10}, 27);
  const at::Tensor w0 = seeded({2, 2, 3}, 28);
  const at::Tensor cot = seeded({2, 2, 10}, 29);
  const at::Tensor v = seeded({2, 2, 10}, 30);
  auto run = [&](const at::Tensor& x, const at::Tensor& w) {
    at::Tensor y = at::tanh(F::conv1d(x, w, F::Conv1dFuncOptions().padding(1)));
    y.backward(cot, /*retain_graph=*/true, /*create_graph=*/true);
  };
  at::Tensor xr = full.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
  run(xr, wr);
  at::Tensor gr = xr.grad().clone();
  (xr.grad() * v).sum().backward();
  at::Tensor xs = st::distribute_tensor(full, mesh, fit_placements(mesh, {S2, S0}), true);
  at::Tensor ws = w0.clone().requires_grad_(true);
  run(xs, ws);
  at::Tensor gs = st::ShardTensor(xs).grad();
  EXPECT_TRUE(all_close(gathered(gs).detach(), gr, kRtol, kAtol));
  (gs * v).sum().backward();
  EXPECT_TRUE(all_close(gathered(st::ShardTensor(xs).grad()).detach(), xr.grad(), kRtol, kAtol));
  EXPECT_TRUE(all_close(ws.grad(), wr.grad(), kRtol, kAtol));
}

// A gradient penalty with distribute_module (Note [gradient buckets]): the
// first pass (grad with create_graph) all-reduces the marked uses itself; the
// penalty's backward() then goes through the buckets.
TEST_F(DoubleBackward, GradientPenaltyWithDistributedModule) {
  const at::Tensor full = seeded({2, 2, 9, 6}, 31);
  auto make = [] {
    torch::manual_seed(5);
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1));
  };
  auto penalty = [](torch::nn::Conv2d& conv, const at::Tensor& x, bool sharded) {
    at::Tensor loss = at::tanh(conv(x)).square().mean();
    std::vector<at::Tensor> wrt{x, conv->weight};
    auto g = sharded ? st::grad({loss}, wrt, {}, true, true)
                     : torch::autograd::grad({loss}, wrt, {}, true, true);
    at::Tensor p = (g[0] * g[0]).sum() + (g[1] * g[1]).sum() + loss;
    p.backward();
    return g;
  };
  auto ref = make();
  at::Tensor xr = full.clone().requires_grad_(true);
  auto gr = penalty(ref, xr, false);
  auto conv = make();
  st::distribute_module(*conv, mesh);
  at::Tensor xs = st::distribute_tensor(full, mesh, fit_placements(mesh, {S2, S3}), true);
  auto gs = penalty(conv, xs, true);
  EXPECT_TRUE(all_close(gathered(gs[0]).detach(), gr[0], kRtol, kAtol));
  EXPECT_TRUE(all_close(gs[1].detach(), gr[1], kRtol, kAtol));
  EXPECT_TRUE(all_close(conv->weight.grad(), ref->weight.grad(), kRtol, kAtol));
  EXPECT_TRUE(all_close(conv->bias.grad(), ref->bias.grad(), kRtol, kAtol));
  EXPECT_TRUE(all_close(gathered(st::ShardTensor(xs).grad()).detach(), xr.grad(), kRtol, kAtol));
}

// Where double backward cannot be exact it throws on every rank, naming the op.
// Note [shard-dim swap]: the cycle's box exchange and its inverse are
// differentiable to any order (f32 and f64; on a 1-D mesh it is an all_to_all).
TEST_F(DoubleBackward, ShardDimSwapRedistribute) {
  struct Case {
    std::vector<int64_t> shape;
    P from, to;
  };
  for (const Case& c : {Case{{5, 3}, {S0, S1}, {S1, S0}}, Case{{3, 4, 5}, {S0, S2}, {S2, S0}}}) {
    const P to = fit_placements(mesh, c.to);
    auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
      return at::Tensor(st::ShardTensor(in[0]).redistribute(to));
    };
    sweep("swap to " + st::to_string(to), fn, seeded(c.shape, 11), {c.from});
    for (bool empty : {false, true}) {
      RefInput in = input(seeded(c.shape, 12, at::kDouble), c.from, empty);
      EXPECT_TRUE(double_backward_check(fn, {in}, mesh, {}, 1e-10, 1e-12))
          << "float64 swap to " << st::to_string(to) << (empty ? " empty-first" : "");
    }
  }
}

TEST_F(DoubleBackward, UnsupportedThrowsEverywhere) {
  const at::Tensor full = seeded({3, 10}, 32) + 0.2;
  at::Tensor x = st::distribute_tensor(full, mesh, fit_placements(mesh, {S1, S0}), true);
  at::Tensor y = at::linalg_vector_norm(x, -1.5, std::vector<int64_t>{1}).sum();
  EXPECT_TRUE(throws_everywhere(
      [&] { st::grad({y}, {x}, {}, true, /*create_graph=*/true); },
      {"double backward (create_graph=true)", "norm of negative order", "not supported"}));
  // The first derivative alone still works.
  at::Tensor g = st::grad({y}, {x})[0];
  at::Tensor xr = full.clone().requires_grad_(true);
  at::Tensor gr = torch::autograd::grad(
      {at::linalg_vector_norm(xr, -1.5, std::vector<int64_t>{1}).sum()}, {xr})[0];
  EXPECT_TRUE(all_close(gathered(g), gr, kRtol, kAtol));
}

TEST_F(DoubleBackward, GradArgumentErrors) {
  at::Tensor x = st::distribute_tensor(seeded({4, 6}, 33), mesh, fit_placements(mesh, {S1}), true);
  at::Tensor y = (x * x).sum();
  EXPECT_TRUE(throws_everywhere(
      [&] {
        st::grad({y}, {x}, {at::ones({}), at::ones({})});
      },
      {"shardtensor::grad", "2 grad_outputs for 1 outputs"}));
  EXPECT_TRUE(throws_everywhere([&] { st::grad({x * 2}, {x}); },
                                {"shardtensor::grad", "single-element output"}));
  std::vector<at::Tensor> wrt{x};
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (x * 2).backward(at::ones({4, 6}), c10::nullopt, false, at::TensorList(wrt));
      },
      {"ShardTensor.backward()", "inputs= is not supported", "shardtensor::grad"}));
}

// ---- primitives: the adjoint of the adjoint ---------------------------------------------

enum class Space { PerRank, Replicated };

// Collective over the mesh. y = A(x); c (requires grad) is y's cotangent;
// g = A^T c with create_graph; s = <g, v> (summed over ranks for a per-rank
// space x, once for a replicated one); ds/dc must equal `av` = A v.
::testing::AssertionResult adjoint_of_adjoint(const std::function<at::Tensor(const at::Tensor&)>& A,
                                              const at::Tensor& x, Space x_space,
                                              const at::Tensor& c0, const at::Tensor& v,
                                              const at::Tensor& av, const st::DeviceMesh& mesh) {
  at::Tensor xl = x.detach().clone().requires_grad_(true);
  at::Tensor c = c0.detach().clone().requires_grad_(true);
  at::Tensor y = A(xl);
  at::Tensor g = torch::autograd::grad({y}, {xl}, {c}, true, /*create_graph=*/true)[0];
  at::Tensor s = (g * v).sum();
  if (x_space == Space::PerRank) {
    std::vector<int64_t> all(mesh.ndim());
    for (int64_t d = 0; d < mesh.ndim(); ++d) all[d] = d;
    s = comm::all_reduce(s, mesh, all);
  }
  at::Tensor h = torch::autograd::grad({s}, {c})[0];
  return all_close(h, av, 1e-5, 1e-6);
}

struct AxisInfo {
  int64_t mesh_dim, P, me;
};

std::vector<AxisInfo> axes(const st::DeviceMesh& mesh) {
  std::vector<AxisInfo> out;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    out.push_back({m, mesh.size(m), mesh.coordinate()[m]});
  }
  return out;
}

// Uneven sizes with an empty first piece (balanced when P == 1).
std::vector<int64_t> uneven(int64_t P) {
  if (P == 1) return {5};
  std::vector<int64_t> s{0};
  for (int64_t c = 1; c < P; ++c) s.push_back(c + 1);
  return s;
}

int64_t total(const std::vector<int64_t>& s) {
  int64_t n = 0;
  for (int64_t v : s) n += v;
  return n;
}

TEST(DoubleBackwardPrimitives, CollectivesAdjointOfAdjoint) {
  auto mesh = test_mesh();
  const uint64_t r = static_cast<uint64_t>(st::world_rank());
  for (const AxisInfo& a : axes(mesh)) {
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    const std::vector<int64_t> sizes = uneven(a.P);
    const int64_t n = total(sizes), mine = sizes[a.me];
    const at::Tensor rep = seeded({n, 3}, 40), rep_v = seeded({n, 3}, 41);
    const at::Tensor piece = seeded({mine, 3}, 50 + r), piece_v = seeded({mine, 3}, 60 + r);
    const at::Tensor full_pr = seeded({n, 3}, 70 + r), full_pr_v = seeded({n, 3}, 80 + r);
    auto all_gather = [&](const at::Tensor& t) {
      return comm::all_gather(t, mesh, a.mesh_dim, 0, sizes);
    };
    auto shard_slice = [&](const at::Tensor& t) {
      return comm::shard_slice(t, mesh, a.mesh_dim, 0, sizes);
    };
    auto reduce_scatter = [&](const at::Tensor& t) {
      return comm::reduce_scatter(t, mesh, a.mesh_dim, 0, sizes);
    };
    auto all_reduce = [&](const at::Tensor& t) { return comm::all_reduce(t, mesh, {a.mesh_dim}); };
    auto use_rep = [&](const at::Tensor& t) { return comm::use_replicated(t, mesh, {a.mesh_dim}); };
    auto to_partial = [&](const at::Tensor& t) {
      return comm::replicate_to_partial(t, mesh, a.mesh_dim);
    };
    EXPECT_TRUE(adjoint_of_adjoint(all_gather, piece, Space::PerRank, rep, piece_v,
                                   all_gather(piece_v).detach(), mesh))
        << "all_gather";
    EXPECT_TRUE(adjoint_of_adjoint(shard_slice, rep, Space::Replicated, piece, rep_v,
                                   shard_slice(rep_v).detach(), mesh))
        << "shard_slice";
    EXPECT_TRUE(adjoint_of_adjoint(reduce_scatter, full_pr, Space::PerRank, piece, full_pr_v,
                                   reduce_scatter(full_pr_v).detach(), mesh))
        << "reduce_scatter";
    EXPECT_TRUE(adjoint_of_adjoint(all_reduce, full_pr, Space::PerRank, rep, full_pr_v,
                                   all_reduce(full_pr_v).detach(), mesh))
        << "all_reduce";
    EXPECT_TRUE(adjoint_of_adjoint(use_rep, rep, Space::Replicated, full_pr, rep_v,
                                   use_rep(rep_v).detach(), mesh))
        << "use_replicated";
    EXPECT_TRUE(adjoint_of_adjoint(to_partial, rep, Space::Replicated, rep, rep_v,
                                   to_partial(rep_v).detach(), mesh))
        << "replicate_to_partial";
  }
}

TEST(DoubleBackwardPrimitives, ExchangesAdjointOfAdjoint) {
  auto mesh = test_mesh();
  const uint64_t r = static_cast<uint64_t>(st::world_rank());
  for (const AxisInfo& a : axes(mesh)) {
    SCOPED_TRACE("mesh dim " + std::to_string(a.mesh_dim));
    const std::vector<int64_t> sizes = uneven(a.P);
    std::vector<int64_t> other(sizes.rbegin(), sizes.rend());  // the same total
    const int64_t n = total(sizes), mine = sizes[a.me];
    const at::Tensor piece = seeded({2, mine, 3}, 90 + r), piece_v = seeded({2, mine, 3}, 100 + r);
    // all_to_all Shard(1) -> Shard(2): the local piece holds the full dim 2.
    const at::Tensor a2a_x = seeded({2, mine, n}, 110 + r), a2a_v = seeded({2, mine, n}, 120 + r);
    auto a2a = [&](const at::Tensor& t) {
      return comm::all_to_all(t, mesh, a.mesh_dim, 1, sizes, 2, sizes);
    };
    auto rebalance = [&](const at::Tensor& t) {
      return comm::all_to_all(t, mesh, a.mesh_dim, 1, sizes, 1, other);
    };
    at::Tensor ya, yb;
    {
      at::NoGradGuard none;
      ya = a2a(a2a_x);
      yb = rebalance(piece);
    }
    EXPECT_TRUE(adjoint_of_adjoint(a2a, a2a_x, Space::PerRank, seeded(ya.sizes(), 130 + r), a2a_v,
                                   a2a(a2a_v).detach(), mesh))
        << "all_to_all";
    EXPECT_TRUE(adjoint_of_adjoint(rebalance, piece, Space::PerRank, seeded(yb.sizes(), 140 + r),
                                   piece_v, rebalance(piece_v).detach(), mesh))
        << "repartition (rebalance)";
    for (st::PadMode mode :
         {st::PadMode::Constant, st::PadMode::Replicate, st::PadMode::Circular}) {
      SCOPED_TRACE(st::pad_mode_name(mode));
      // A halo of 2 rows (multi-hop past the small pieces), fill value 2.5:
      // the adjoint of the adjoint is the linear part (fill 0).
      auto halo = [&](const at::Tensor& t) {
        return comm::halo_exchange(t, mesh, a.mesh_dim, 1, sizes, 2, 2, mode, 2.5);
      };
      auto halo_lin = [&](const at::Tensor& t) {
        return comm::halo_exchange(t, mesh, a.mesh_dim, 1, sizes, 2, 2, mode, 0.0);
      };
      auto split = [&](const at::Tensor& t) {
        auto h = comm::halo_exchange_start(t, mesh, a.mesh_dim, 1, sizes, 2, 2, mode, 2.5);
        return h.finish();
      };
      at::Tensor expected, yh;
      {
        at::NoGradGuard none;
        expected = halo_lin(piece_v);
        yh = halo(piece);
      }
      const at::Tensor c = seeded(yh.sizes(), 150 + r);
      EXPECT_TRUE(adjoint_of_adjoint(halo, piece, Space::PerRank, c, piece_v, expected, mesh))
          << "halo_exchange";
      EXPECT_TRUE(adjoint_of_adjoint(split, piece, Space::PerRank, c, piece_v, expected, mesh))
          << "halo_exchange_start/finish";
    }
  }
}

TEST(DoubleBackwardPrimitives, BoxExchangeAdjointOfAdjoint) {
  auto mesh = test_mesh();
  const uint64_t r = static_cast<uint64_t>(st::world_rank());
  // Over all mesh dims: rows split unevenly (first piece empty) to columns
  // split in reverse order.
  const int64_t np = mesh.size();
  int64_t me = 0;
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    me = me * mesh.size(m) + mesh.coordinate()[m];
    dims.push_back(m);
  }
  const std::vector<int64_t> rows = uneven(np), cols = uneven(np);
  const int64_t n0 = total(rows), n1 = total(cols);
  std::vector<comm::Box> src, dst;
  for (int64_t c = 0, ro = 0, co = n1; c < np; ++c) {
    src.push_back({{ro, rows[c]}, {0, n1}, {0, 2}});
    co -= cols[c];
    dst.push_back({{0, n0}, {co, cols[c]}, {0, 2}});
    ro += rows[c];
  }
  auto A = [&](const at::Tensor& t) { return comm::box_exchange(t, mesh, dims, src, dst); };
  const at::Tensor x = seeded({rows[me], n1, 2}, 160 + r), v = seeded({rows[me], n1, 2}, 170 + r);
  const at::Tensor c = seeded({n0, cols[me], 2}, 180 + r);
  at::Tensor av;
  {
    at::NoGradGuard none;
    av = A(v);
  }
  EXPECT_TRUE(adjoint_of_adjoint(A, x, Space::PerRank, c, v, av, mesh)) << "box_exchange";
}

}  // namespace
