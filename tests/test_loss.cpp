// Softmax and loss rules (src/ops/softmax.cpp, src/ops/loss.cpp) compared with
// plain libtorch on the full tensors: output and the gradients of the input
// (and of a floating target where libtorch differentiates it), for every
// reduction, with class weights, ignore_index and label smoothing, on 1, 2, 3,
// 4 ranks and the 2x2 mesh, balanced (uneven) and empty-first shards. Inputs
// and targets are ShardTensors laid out alike (class-index targets: like the
// input without its class dim). Layouts are written for a 2x2 mesh and trimmed
// by fit_placements() on a 1-D mesh.
//
// Tolerances: rtol 1e-5, atol 1e-5: mean/sum losses re-associate a float32
// sum over the ranks (partial sums, then an all-reduce) of a few hundred terms
// of order 1; softmax sums of exponentials likewise.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <sstream>

#include "testing.h"

namespace st = shardtensor;
namespace F = torch::nn::functional;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-5;

at::Tensor uni(c10::IntArrayRef shape, uint64_t seed, double lo, double hi) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::rand(shape, gen, at::kFloat) * (hi - lo) + lo;
}
at::Tensor classes(c10::IntArrayRef shape, int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, n, shape, gen, at::kLong);
}

constexpr int64_t kReductions[] = {at::Reduction::None, at::Reduction::Mean, at::Reduction::Sum};
const char* rname(int64_t r) { return r == 0 ? "none" : r == 1 ? "mean" : "sum"; }

// The layout of a class-index target: the input's without dim 1.
P drop_class_dim(const P& p) {
  P out;
  for (const auto& pl : p) {
    if (st::is_shard(pl) && st::shard_dim(pl) > 1) {
      out.push_back(st::Shard{st::shard_dim(pl) - 1});
    } else {
      out.push_back(pl);
    }
  }
  return out;
}

class Loss : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(1234); }

  st::DeviceMesh mesh = test_mesh();

  RefInput input(const at::Tensor& full, const P& wanted, bool empty, bool grad = true) {
    auto p = fit_placements(mesh, wanted);
    std::optional<st::ShardSizes> sizes;
    if (empty) sizes = sizes_with_empty_first(mesh, p, full.sizes());
    return RefInput{full, p, grad, sizes};
  }

  // fn(inputs) on every layout pair, balanced and empty-first.
  void sweep(const std::string& name, const RefFn& fn, const std::vector<at::Tensor>& fulls,
             const std::vector<std::vector<P>>& layouts, const std::vector<bool>& grads) {
    for (const auto& ls : layouts) {
      for (bool empty : {false, true}) {
        std::vector<RefInput> in;
        for (size_t i = 0; i < fulls.size(); ++i) {
          in.push_back(input(fulls[i], ls[i], empty, grads[i]));
        }
        EXPECT_TRUE(reference_check(fn, in, mesh, {}, kRtol, kAtol))
            << name << " on " << st::to_string(*in[0].placements) << (empty ? " empty-first" : "");
      }
    }
  }

  void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
    EXPECT_TRUE(throws_everywhere(fn, needles));
  }
};

using Fn1 = std::function<at::Tensor(const at::Tensor&)>;

}  // namespace

// ---------------------------------------------------------------- softmax

TEST_F(Loss, Softmax) {
  const at::Tensor x = rnd({5, 7, 6}, 1, 3.0);
  const std::vector<std::vector<P>> layouts = {{{S0, S1}}, {{S1, S2}}, {{S2, S0}}, {{R, S1}}};
  std::vector<std::pair<std::string, Fn1>> cases = {
      {"softmax(0)", [](const at::Tensor& t) { return t.softmax(0); }},
      {"softmax(1)", [](const at::Tensor& t) { return torch::softmax(t, 1); }},
      {"softmax(-1)", [](const at::Tensor& t) { return F::softmax(t, F::SoftmaxFuncOptions(-1)); }},
      {"log_softmax(0)", [](const at::Tensor& t) { return t.log_softmax(0); }},
      {"log_softmax(1)", [](const at::Tensor& t) { return torch::log_softmax(t, 1); }},
      {"log_softmax(2)",
       [](const at::Tensor& t) { return F::log_softmax(t, F::LogSoftmaxFuncOptions(2)); }},
      {"softmax(1, double)", [](const at::Tensor& t) { return t.softmax(1, at::kDouble); }},
      {"_softmax(1)", [](const at::Tensor& t) { return at::_softmax(t, 1, false); }},
      {"_log_softmax(0)", [](const at::Tensor& t) { return at::_log_softmax(t, 0, false); }},
  };
  for (const auto& c : cases) {
    auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      return c.second(in[0]);
    };
    sweep(c.first, fn, {x}, layouts, {true});
  }
}

TEST_F(Loss, SoftmaxLargeValues) {
  // exp would overflow without the global max: values up to ~1e3.
  const at::Tensor x = rnd({4, 9}, 2, 400.0);
  for (bool log : {false, true}) {
    auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      return log ? in[0].log_softmax(1) : in[0].softmax(1);
    };
    sweep(log ? "log_softmax(large)" : "softmax(large)", fn, {x}, {{{S1, S0}}}, {true});
  }
}

// ---------------------------------------------------------------- elementwise losses

TEST_F(Loss, ElementwiseLosses) {
  const std::vector<int64_t> shape{5, 7, 6};
  const at::Tensor x = rnd(shape, 3), t = rnd(shape, 4);
  const at::Tensor prob = uni(shape, 5, 0.05, 0.95), label = uni(shape, 6, 0.0, 1.0);
  const at::Tensor w_full = uni(shape, 7, 0.5, 2.0), w_last = uni({6}, 8, 0.5, 2.0),
                   pos = uni({6}, 9, 0.5, 3.0);
  const std::vector<std::vector<P>> layouts = {
      {{S0, S1}, {S0, S1}}, {{S1, S2}, {S1, S2}}, {{S2, S0}, {S2, S0}}};
  using Fn2 = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>;
  struct Case {
    std::string name;
    Fn2 fn;
    at::Tensor input, target;
    bool target_grad;
  };
  std::vector<Case> cases = {
      {"mse_loss", [](auto& a, auto& b, int64_t r) { return at::mse_loss(a, b, r); }, x, t, true},
      {"l1_loss", [](auto& a, auto& b, int64_t r) { return at::l1_loss(a, b, r); }, x, t, true},
      {"smooth_l1_loss(beta=0.5)",
       [](auto& a, auto& b, int64_t r) { return at::smooth_l1_loss(a, b, r, 0.5); }, x, t, true},
      {"huber_loss(delta=0.7)",
       [](auto& a, auto& b, int64_t r) { return at::huber_loss(a, b, r, 0.7); }, x, t, true},
      {"binary_cross_entropy",
       [](auto& a, auto& b, int64_t r) { return at::binary_cross_entropy(a, b, {}, r); }, prob,
       label, false},
      {"binary_cross_entropy(weight full)",
       [&](auto& a, auto& b, int64_t r) { return at::binary_cross_entropy(a, b, w_full, r); }, prob,
       label, false},
      {"binary_cross_entropy_with_logits",
       [](auto& a, auto& b, int64_t r) {
         return at::binary_cross_entropy_with_logits(a, b, {}, {}, r);
       },
       x, label, true},
      {"binary_cross_entropy_with_logits(weight, pos_weight)",
       [&](auto& a, auto& b, int64_t r) {
         return at::binary_cross_entropy_with_logits(a, b, w_last, pos, r);
       },
       x, label, true},
  };
  for (const auto& c : cases) {
    for (int64_t r : kReductions) {
      auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return c.fn(in[0], in[1], r);
      };
      sweep(c.name + " reduction=" + rname(r), fn, {c.input, c.target}, layouts,
            {true, c.target_grad});
    }
  }
}

TEST_F(Loss, ElementwiseLossFunctionals) {
  // The torch::nn::functional entry points users call.
  const at::Tensor x = rnd({6, 5}, 10), t = rnd({6, 5}, 11), lbl = uni({6, 5}, 12, 0, 1);
  const std::vector<std::vector<P>> layouts = {{{S0, S1}, {S0, S1}}, {{S1, R}, {S1, R}}};
  std::vector<std::pair<std::string, RefFn>> cases = {
      {"F::mse_loss", [](const std::vector<at::Tensor>& in,
                         const std::vector<at::Tensor>&) { return F::mse_loss(in[0], in[1]); }},
      {"F::l1_loss(sum)",
       [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
         return F::l1_loss(in[0], in[1], F::L1LossFuncOptions(torch::kSum));
       }},
      {"F::huber_loss",
       [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
         return F::huber_loss(in[0], in[1], F::HuberLossFuncOptions().delta(0.3));
       }},
      {"F::binary_cross_entropy",
       [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
         return F::binary_cross_entropy(torch::sigmoid(in[0]), in[1].sigmoid().detach());
       }},
      {"F::binary_cross_entropy_with_logits",
       [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
         return F::binary_cross_entropy_with_logits(in[0], in[1].sigmoid());
       }},
  };
  for (const auto& c : cases) sweep(c.first, c.second, {x, t}, layouts, {true, true});
  (void)lbl;
}

// ---------------------------------------------------------------- class losses

TEST_F(Loss, CrossEntropy) {
  // (N, C, H, W) logits with class-index targets (N, H, W); some targets ignored.
  const std::vector<int64_t> shape{5, 4, 6, 7};
  const at::Tensor x = rnd(shape, 20, 2.0);
  at::Tensor t = classes({5, 6, 7}, 4, 21);
  t = t.masked_fill(uni({5, 6, 7}, 22, 0, 1) < 0.2, 2);  // ignore_index 2 below
  const at::Tensor w = uni({4}, 23, 0.3, 2.0);
  const std::vector<P> xl = {{S0, S2}, {S2, S3}, {S3, S0}};
  std::vector<std::vector<P>> layouts;
  for (const auto& p : xl) layouts.push_back({p, drop_class_dim(p)});
  for (bool weighted : {false, true}) {
    for (int64_t ii : {-100, 2}) {
      for (double ls : {0.0, 0.15}) {
        for (int64_t r : kReductions) {
          auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
            return at::cross_entropy_loss(in[0], in[1], weighted ? w : at::Tensor(), r, ii, ls);
          };
          std::ostringstream name;
          name << "cross_entropy weight=" << weighted << " ignore_index=" << ii
               << " label_smoothing=" << ls << " reduction=" << rname(r);
          sweep(name.str(), fn, {x, t}, layouts, {true, false});
        }
      }
    }
  }
  // The functional, 2-D (N, C) and 3-D (N, C, L) inputs.
  auto f2 = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return F::cross_entropy(in[0], in[1],
                            F::CrossEntropyFuncOptions().weight(w).label_smoothing(0.1));
  };
  sweep("F::cross_entropy (N, C)", f2, {rnd({9, 4}, 24), classes({9}, 4, 25)}, {{{S0}, {S0}}},
        {true, false});
  sweep("F::cross_entropy (N, C, L)", f2, {rnd({3, 4, 11}, 26), classes({3, 11}, 4, 27)},
        {{{S2, S0}, {S1, S0}}, {{S0, S2}, {S0, S1}}}, {true, false});
}

TEST_F(Loss, CrossEntropyProbabilityTargets) {
  const std::vector<int64_t> shape{5, 4, 6, 7};
  const at::Tensor x = rnd(shape, 30), p = rnd(shape, 31).softmax(1);
  const at::Tensor w = uni({4}, 32, 0.3, 2.0);
  const std::vector<std::vector<P>> layouts = {{{S0, S2}, {S0, S2}}, {{S2, S3}, {S2, S3}}};
  for (double ls : {0.0, 0.2}) {
    for (int64_t r : kReductions) {
      auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::cross_entropy_loss(in[0], in[1], w, r, -100, ls);
      };
      sweep(std::string("cross_entropy(prob targets) reduction=") + rname(r), fn, {x, p}, layouts,
            {true, false});
    }
  }
}

TEST_F(Loss, NllLoss) {
  const at::Tensor x = rnd({5, 4, 6, 7}, 40);
  at::Tensor t = classes({5, 6, 7}, 4, 41);
  t = t.masked_fill(uni({5, 6, 7}, 42, 0, 1) < 0.2, -100);
  const at::Tensor w = uni({4}, 43, 0.3, 2.0);
  const std::vector<P> xl = {{S0, S2}, {S2, S3}, {S3, S0}};
  std::vector<std::vector<P>> layouts;
  for (const auto& p : xl) layouts.push_back({p, drop_class_dim(p)});
  for (bool weighted : {false, true}) {
    for (int64_t r : kReductions) {
      auto nd = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        auto o = F::NLLLossFuncOptions().ignore_index(-100);
        if (weighted) o.weight(w);
        if (r == 0) o.reduction(torch::kNone);
        if (r == 2) o.reduction(torch::kSum);
        return F::nll_loss(in[0].log_softmax(1), in[1], o);
      };
      sweep(std::string("F::nll_loss weight=") + (weighted ? "1" : "0") + " reduction=" + rname(r),
            nd, {x, t}, layouts, {true, false});
      auto two = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::nll_loss2d(in[0].log_softmax(1), in[1], weighted ? w : at::Tensor(), r, -100);
      };
      sweep(std::string("nll_loss2d reduction=") + rname(r), two, {x, t}, layouts, {true, false});
      auto one = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::nll_loss(in[0].log_softmax(1), in[1], weighted ? w : at::Tensor(), r, 1);
      };
      sweep(std::string("nll_loss (N, C) ignore_index=1 reduction=") + rname(r), one,
            {rnd({11, 4}, 44), classes({11}, 4, 45)}, {{{S0}, {S0}}}, {true, false});
    }
  }
}

// ---------------------------------------------------------------- errors

TEST_F(Loss, Errors) {
  const at::Tensor x = rnd({4, 6, 5}, 50);
  const at::Tensor t = classes({4, 5}, 6, 51);
  // A sharded class dim.
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S1, S2}));
  auto st_ = st::distribute_tensor(t, mesh, fit_placements(mesh, {R, S1}));
  expect_error([&] { at::cross_entropy_loss(sx, st_); },
               {"cross_entropy_loss", "class dim", "Shard(1)", "[4, 6, 5]"});
  // A target laid out differently from the input (other placements, or the
  // same placements with other sizes) is moved to the input's layout.
  auto sx0 = st::distribute_tensor(x, mesh, fit_placements(mesh, {S2, S0}));
  auto other = st::distribute_tensor(t, mesh, fit_placements(mesh, {S0, S1}));
  EXPECT_TRUE(all_close(at::nll_loss_nd(sx0.log_softmax(1), other),
                        at::nll_loss_nd(x.log_softmax(1), t), 1e-5, 1e-6));
  const at::Tensor x2 = rnd({4, 6, 5}, 52);
  const P py = fit_placements(mesh, {S0, S1});
  auto y = st::distribute_tensor(x, mesh, py);
  auto y2 = st::distribute_tensor(x2, mesh, fit_placements(mesh, {S1, S0}));
  auto y3 =
      st::distribute_tensor(x2, mesh, py, false, sizes_with_empty_first(mesh, py, x2.sizes()));
  EXPECT_TRUE(all_close(at::mse_loss(y, y2), at::mse_loss(x, x2), 1e-5, 1e-6));
  EXPECT_TRUE(all_close(at::mse_loss(y, y3), at::mse_loss(x, x2), 1e-5, 1e-6));
  expect_error([&] { at::mse_loss(y, torch::zeros({4, 6})); }, {"mse_loss", "same shape"});
}
