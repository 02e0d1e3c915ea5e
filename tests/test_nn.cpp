// distribute_module: identical parameters everywhere, and after backward every
// parameter gradient equals the single-process gradient, with optimizers unchanged.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <set>
#include <string>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    scale = register_parameter("scale", torch::ones({3}));
    register_buffer("steps", torch::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::tanh(fc1(x))) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor scale;
};

}  // namespace

TEST(DistributeModule, BroadcastsParametersAndBuffersFromRankZero) {
  auto mesh = test_mesh();
  torch::manual_seed(100 + mesh.rank());  // deliberately different on every rank
  Net net;
  net.named_buffers()["steps"].fill_(mesh.rank());
  st::distribute_module(net, mesh);
  torch::manual_seed(100);
  Net ref;
  for (const auto& p : net.named_parameters()) {
    EXPECT_TRUE(all_close(p.value(), ref.named_parameters()[p.key()], 0, 0)) << p.key();
  }
  EXPECT_TRUE(all_close(net.named_buffers()["steps"], torch::zeros({1}), 0, 0));
}

TEST(DistributeModule, RejectsDifferentModulesOnEveryRank) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  torch::nn::Linear lin(mesh.rank() == 0 ? 4 : 5, 3);
  bool threw = false;
  try {
    st::distribute_module(*lin, mesh);
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("distribute_module") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
}

TEST(DistributeModule, GradientsAndAdamStepsEqualSingleProcess) {
  auto mesh = test_mesh();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = at::randn({6, 11, 5}, gen);  // [batch, sequence, features]
  auto y = at::randn({6, 11, 3}, gen);
  torch::manual_seed(0);
  Net ref;
  torch::manual_seed(0);
  Net net;
  st::distribute_module(net, mesh);
  torch::optim::Adam ref_opt(ref.parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-2));
  // Batch over mesh dim 0, sequence over mesh dim 1 (data x domain on 2x2).
  auto p = fit_placements(mesh, {st::Shard{1}, st::Shard{0}});
  if (is_mesh_2x2()) p = {st::Shard{0}, st::Shard{1}};
  auto sx = st::distribute_tensor(x, mesh, p);
  auto sy = st::distribute_tensor(y, mesh, p);
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    auto ref_loss = (ref.forward(x) - y).pow(2).mean();
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    auto loss = (net.forward(sx) - sy).pow(2).mean();
    EXPECT_FALSE(st::ShardTensor::is_shard_tensor(loss));  // full reduction: plain tensor
    loss.backward();
    EXPECT_TRUE(all_close(loss, ref_loss)) << "step " << step;
    for (const auto& prm : net.named_parameters()) {
      EXPECT_TRUE(all_close(prm.value().grad(), ref.named_parameters()[prm.key()].grad()))
          << "grad of " << prm.key() << " at step " << step;
    }
    opt.step();
  }
  for (const auto& prm : net.named_parameters()) {
    EXPECT_TRUE(all_close(prm.value(), ref.named_parameters()[prm.key()], 1e-5, 1e-6)) << prm.key();
  }
}

// Note [weight view backward]: linear's w.t() on a registered weight is
// re-taken as a transpose, so backward has no AsStridedBackward node (which
// would allocate and scatter into a zeroed copy of the weight's storage).
TEST(DistributeModule, WeightViewsTakeNoAsStridedBackward) {
  auto mesh = test_mesh();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  auto x = at::randn({6, 11, 5}, gen);
  torch::manual_seed(0);
  Net ref;
  torch::manual_seed(0);
  Net net;
  st::distribute_module(net, mesh);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {st::Shard{1}, st::Shard{0}}));
  auto loss = net.forward(sx).pow(2).mean();
  std::vector<std::string> names;
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (!n || !seen.insert(n).second) continue;
    names.push_back(n->name());
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  for (const auto& name : names) {
    EXPECT_EQ(name.find("AsStrided"), std::string::npos) << name;
  }
  loss.backward();
  ref.forward(x).pow(2).mean().backward();
  for (const auto& prm : net.named_parameters()) {
    EXPECT_TRUE(all_close(prm.value().grad(), ref.named_parameters()[prm.key()].grad()))
        << prm.key();
  }
}

// ---- Note [gradient buckets] ------------------------------------------------------

namespace {

struct Deep : torch::nn::Module {
  explicit Deep(int layers) {
    for (int i = 0; i < layers; ++i) {
      fcs.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(6, 6)));
    }
    scale = register_parameter("scale", torch::ones({6}));
    unused = register_module("unused", torch::nn::Linear(6, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& fc : fcs) h = torch::tanh(fc(h));
    return h * scale;
  }
  std::vector<torch::nn::Linear> fcs;
  torch::nn::Linear unused{nullptr};
  at::Tensor scale;
};

struct Grads {
  std::map<std::string, at::Tensor> g;
  int64_t messages = 0;
};

/// One backward (or `passes` backwards without zeroing) of Deep on sharded
/// [batch, sequence, features] input; the messages counted during backward only.
Grads deep_grads(const st::DeviceMesh& mesh, const st::DistributeOptions& opts, int passes,
                 bool penalty) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({4, 9, 6}, gen);
  torch::manual_seed(1);
  Deep net(6);
  st::distribute_module(net, mesh, opts);
  auto p = fit_placements(mesh, {st::Shard{1}, st::Shard{0}});
  if (is_mesh_2x2()) p = {st::Shard{0}, st::Shard{1}};
  auto sx = st::distribute_tensor(x, mesh, p);
  Grads out;
  for (int i = 0; i < passes; ++i) {
    auto loss = net.forward(sx).pow(2).mean();
    // A plain (replicated) use of a parameter next to its sharded use: its
    // contribution is already full on every rank and must not be summed.
    if (penalty) loss = loss + 0.1 * net.scale.pow(2).sum() + 0.01 * net.fcs[0]->weight.sum();
    st::reset_comm_stats();
    loss.backward();
    out.messages += st::comm_stats().messages;
  }
  for (const auto& prm : net.named_parameters()) out.g[prm.key()] = prm.value().grad();
  return out;
}

Grads deep_reference(int passes, bool penalty) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({4, 9, 6}, gen);
  torch::manual_seed(1);
  Deep net(6);
  Grads out;
  for (int i = 0; i < passes; ++i) {
    auto loss = net.forward(x).pow(2).mean();
    if (penalty) loss = loss + 0.1 * net.scale.pow(2).sum() + 0.01 * net.fcs[0]->weight.sum();
    loss.backward();
  }
  for (const auto& prm : net.named_parameters()) out.g[prm.key()] = prm.value().grad();
  return out;
}

/// `steps` optimizer steps on the loss mean(forward(x)^2), of the single
/// process reference (`ref` on the full `x`) and of the distributed module
/// (`net` on the sharded `sx`), side by side.
template <class M>
void train_side_by_side(M& ref, torch::optim::Optimizer& ro, const at::Tensor& x, M& net,
                        torch::optim::Optimizer& o, const at::Tensor& sx, int steps) {
  for (int step = 0; step < steps; ++step) {
    ro.zero_grad();
    ref.forward(x).pow(2).mean().backward();
    ro.step();
    o.zero_grad();
    net.forward(sx).pow(2).mean().backward();
    o.step();
  }
}

::testing::AssertionResult same_grads(const Grads& a, const Grads& ref) {
  for (const auto& [name, g] : ref.g) {
    const at::Tensor& mine = a.g.at(name);
    if (!all_ranks(mine.defined() == g.defined())) {
      return ::testing::AssertionFailure()
             << name << ": defined " << mine.defined() << " but reference " << g.defined();
    }
    if (!g.defined()) continue;
    auto r = all_close(mine, g);
    if (!r) return r << " (gradient of " << name << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(GradientBuckets, FewAllReducesNotOnePerParameter) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size();
  auto ref = deep_reference(1, false);
  auto bucketed = deep_grads(mesh, st::DistributeOptions(), 1, false);
  auto per_param = deep_grads(mesh, st::DistributeOptions().bucket_cap_bytes(1), 1, false);
  auto unbucketed = deep_grads(mesh, st::DistributeOptions().bucket_gradients(false), 1, false);
  EXPECT_TRUE(same_grads(bucketed, ref));
  EXPECT_TRUE(same_grads(per_param, ref));
  EXPECT_TRUE(same_grads(unbucketed, ref));
  // The only backward communication is the parameters' gradient sum. One fp32
  // bucket of >= P elements is one all-reduce: 2(P-1) messages (Note [traffic
  // accounting]); 13 used parameters (6 weights, 6 biases, scale) reduced one
  // by one cost 13 all-reduces (and the unused Linear's two are reduced too
  // with a 1-byte cap, as zeros).
  EXPECT_EQ(bucketed.messages, 2 * (P - 1));
  if (P > 1) {
    EXPECT_GE(per_param.messages, 15 * (P - 1));
    EXPECT_GE(unbucketed.messages, 13 * (P - 1));
  }
}

TEST(GradientBuckets, AccumulationOverTwoBackwardsAndPlainUses) {
  auto mesh = test_mesh();
  for (bool penalty : {false, true}) {
    auto ref = deep_reference(2, penalty);
    auto got = deep_grads(mesh, st::DistributeOptions().bucket_cap_bytes(600), 2, penalty);
    EXPECT_TRUE(same_grads(got, ref)) << "penalty " << penalty;
  }
}

TEST(GradientBuckets, UnusedParametersKeepNoGradient) {
  auto mesh = test_mesh();
  auto got = deep_grads(mesh, st::DistributeOptions().bucket_cap_bytes(100), 1, false);
  EXPECT_TRUE(
      all_ranks(!got.g.at("unused.weight").defined() && !got.g.at("unused.bias").defined()));
  EXPECT_TRUE(all_ranks(got.g.at("fc0.weight").defined()));
}

TEST(GradientBuckets, OptimizersUnchanged) {
  auto mesh = test_mesh();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto x = at::randn({4, 9, 6}, gen);
  auto p = fit_placements(mesh, {st::Shard{1}, st::Shard{0}});
  if (is_mesh_2x2()) p = {st::Shard{0}, st::Shard{1}};
  auto sx = st::distribute_tensor(x, mesh, p);
  for (int which = 0; which < 3; ++which) {
    torch::manual_seed(2);
    Deep ref(3);
    torch::manual_seed(2);
    Deep net(3);
    st::distribute_module(net, mesh, st::DistributeOptions().bucket_cap_bytes(300));
    auto make = [&](Deep& m) -> std::unique_ptr<torch::optim::Optimizer> {
      if (which == 0) {
        return std::make_unique<torch::optim::SGD>(m.parameters(),
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
      }
      if (which == 1) {
        return std::make_unique<torch::optim::Adam>(m.parameters(),
                                                    torch::optim::AdamOptions(1e-2));
      }
      return std::make_unique<torch::optim::AdamW>(m.parameters(),
                                                   torch::optim::AdamWOptions(1e-2));
    };
    auto ro = make(ref);
    auto o = make(net);
    train_side_by_side(ref, *ro, x, net, *o, sx, 3);
    for (const auto& prm : net.named_parameters()) {
      EXPECT_TRUE(all_close(prm.value(), ref.named_parameters()[prm.key()]))
          << prm.key() << " optimizer " << which;
    }
  }
}

TEST(GradientBuckets, AutogradGradWithInputsThrowsInsteadOfWrongGradients) {
  // torch::autograd::grad(outputs, inputs) does not run the accumulators, so
  // the bucketed partial gradients could not be delivered: an error on every rank.
  auto mesh = test_mesh();
  torch::manual_seed(4);
  Deep net(2);
  st::distribute_module(net, mesh);
  auto x = at::randn({4, 9, 6});
  auto p = fit_placements(mesh, {st::Shard{1}, st::Shard{0}});
  auto sx = st::distribute_tensor(x, mesh, p);
  bool threw = false;
  try {
    auto loss = net.forward(sx).pow(2).mean();
    torch::autograd::grad({loss}, {net.fcs[0]->weight});
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("distribute_module") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
  // The reducer is reset: an ordinary backward afterwards is correct.
  torch::manual_seed(4);
  Deep ref(2);
  ref.forward(x).pow(2).mean().backward();
  net.zero_grad();
  net.forward(sx).pow(2).mean().backward();
  for (const auto& prm : net.named_parameters()) {
    if (!ref.named_parameters()[prm.key()].grad().defined()) continue;
    EXPECT_TRUE(all_close(prm.value().grad(), ref.named_parameters()[prm.key()].grad()))
        << prm.key();
  }
}

TEST(GradientBuckets, ReplicatedOrPartlyShardedInputs) {
  // Input replicated over every mesh dim (no sharded use at all: the
  // gradients are full on every rank and must not be summed), or on a 2x2 mesh
  // replicated over mesh dim 0 and sharded over mesh dim 1 (uses over a subset
  // of the mesh dims: all-reduced by use_replicated over that subset only).
  auto mesh = test_mesh();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({4, 9, 6}, gen);
  torch::manual_seed(1);
  Deep ref(3);
  ref.forward(x).pow(2).mean().backward();
  std::vector<st::Placements> layouts = {st::Placements(mesh.ndim(), st::Replicate{})};
  if (mesh.ndim() == 2) layouts.push_back({st::Replicate{}, st::Shard{1}});
  for (const auto& p : layouts) {
    torch::manual_seed(1);
    Deep net(3);
    st::distribute_module(net, mesh);
    net.forward(st::distribute_tensor(x, mesh, p)).pow(2).mean().backward();
    for (const auto& prm : net.named_parameters()) {
      const auto& g = ref.named_parameters()[prm.key()].grad();
      EXPECT_TRUE(all_ranks(prm.value().grad().defined() == g.defined())) << prm.key();
      if (g.defined()) {
        EXPECT_TRUE(all_close(prm.value().grad(), g)) << prm.key() << " " << st::to_string(p);
      }
    }
  }
}

TEST(GradientBuckets, ReductionsStartDuringBackward) {
  // Batch-sharded MLP: backward communicates nothing but the gradient sums.
  // With one bucket per layer, the last layers' buckets are started while
  // the first layers are still being differentiated: by the time the
  // gradient of the input arrives (the very end of backward), all-reduce
  // traffic has already been counted.
  auto mesh = test_mesh();
  torch::manual_seed(6);
  torch::nn::Sequential net;
  for (int i = 0; i < 6; ++i) {
    net->push_back(torch::nn::Linear(6, 6));
    net->push_back(torch::nn::Tanh());
  }
  st::distribute_module(*net, mesh, st::DistributeOptions().bucket_cap_bytes(6 * 7 * 4));
  auto x = at::randn({8, 6});
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {st::Shard{0}, st::Replicate{}}),
                                  /*requires_grad=*/true);
  auto loss = net->forward(at::Tensor(sx)).pow(2).mean();
  int64_t messages_at_input_grad = -1;
  st::ShardTensor(sx).local().register_hook([&](const at::Tensor& g) {
    messages_at_input_grad = st::comm_stats().messages;
    return g;
  });
  st::reset_comm_stats();
  loss.backward();
  const int64_t total = st::comm_stats().messages;
  if (mesh.size() > 1) {
    EXPECT_TRUE(all_ranks(messages_at_input_grad > 0 && messages_at_input_grad < total))
        << messages_at_input_grad << " of " << total;
  }
  torch::manual_seed(6);
  torch::nn::Sequential ref;
  for (int i = 0; i < 6; ++i) {
    ref->push_back(torch::nn::Linear(6, 6));
    ref->push_back(torch::nn::Tanh());
  }
  ref->forward(x).pow(2).mean().backward();
  for (const auto& prm : net->named_parameters()) {
    EXPECT_TRUE(all_close(prm.value().grad(), ref->named_parameters()[prm.key()].grad()))
        << prm.key();
  }
}

// Note [factories return at::Tensor]: what scatter_tensor / distribute_tensor /
// from_local / redistribute return goes straight into torch::nn::Sequential
// (AnyModule checks the static argument type), a std::vector<at::Tensor> and
// ModuleList forwards, and the result equals the single-process run.
TEST(DistributeModule, SequentialTakesFactoryResultsDirectly) {
  auto mesh = test_mesh();
  const auto pl = fit_placements(mesh, {S2, S3});
  auto x = rnd({1, 2, 9, 7}, 5);
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)),
                            torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 2, 3).padding(1)));
  torch::manual_seed(3);
  torch::nn::Sequential ref(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)),
                            torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 2, 3).padding(1)));
  st::distribute_module(*seq, mesh);

  auto sx = st::scatter_tensor(mesh.rank() == 0 ? x : at::Tensor(), 0, mesh, pl, true);
  auto out = seq->forward(sx);  // the factory's result, no conversion
  ASSERT_TRUE(st::ShardTensor::is_shard_tensor(out));
  auto xr = x.clone().requires_grad_(true);
  auto out_ref = ref->forward(xr);
  EXPECT_TRUE(all_close(st::ShardTensor(out).full_tensor(), out_ref));

  out.square().sum().backward();
  out_ref.square().sum().backward();
  EXPECT_TRUE(all_close(st::ShardTensor(sx).grad().full_tensor(), xr.grad()));
  auto p = seq->parameters(), pr = ref->parameters();
  ASSERT_EQ(p.size(), pr.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(all_close(p[i].grad(), pr[i].grad())) << i;

  // Other containers that take at::Tensor by static type.
  std::vector<at::Tensor> v{st::distribute_tensor(x, mesh, pl),
                            st::ShardTensor(sx).redistribute(fit_placements(mesh, {S3, S2}))};
  torch::nn::ModuleList list;
  list->push_back(torch::nn::Identity());
  for (const auto& t : v) {
    auto y = list[0]->as<torch::nn::Identity>()->forward(t);
    ASSERT_TRUE(st::ShardTensor::is_shard_tensor(y));
    EXPECT_TRUE(all_close(st::ShardTensor(y).full_tensor(), x));
  }
}

namespace {

// A custom layer that skips an empty piece (Note [gradient defined
// everywhere]): `gate` and `shift` are used only on ranks whose piece is
// non-empty. relu(gate) with gate < 0 gives `gate` a gradient of exact zeros.
struct Branchy : torch::nn::Module {
  Branchy() {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    gate = register_parameter("gate", -torch::ones({4}));
    shift = register_parameter("shift", torch::full({4}, 0.5));
  }
  at::Tensor branch(const at::Tensor& y, const at::Tensor& g, const at::Tensor& s) {
    return y * (1 + torch::relu(g)) + s;
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = torch::tanh(lin(x));
    if (!st::ShardTensor::is_shard_tensor(y)) return branch(y, gate, shift);  // single process
    const st::ShardTensor sy(y);
    at::Tensor local = sy.local();
    if (local.numel() > 0) {
      std::vector<int64_t> all(sy.mesh().ndim());
      for (size_t m = 0; m < all.size(); ++m) all[m] = static_cast<int64_t>(m);
      local = branch(local, st::comm::use_replicated(gate, sy.mesh(), all),
                     st::comm::use_replicated(shift, sy.mesh(), all));
    }
    return st::ShardTensor::from_local(local, sy.mesh(), sy.placements(),
                                       sy.spec().all_shard_sizes());
  }
  torch::nn::Linear lin{nullptr};
  at::Tensor gate, shift;
};

// The optimizer state of `p` as tensors (step as a tensor); empty without state.
std::vector<at::Tensor> state_of(torch::optim::Optimizer& o, const at::Tensor& p, bool adam) {
  auto it = o.state().find(p.unsafeGetTensorImpl());
  if (it == o.state().end()) return {};
  if (adam) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    return {s.exp_avg(), s.exp_avg_sq(), torch::tensor({static_cast<double>(s.step())})};
  }
  auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
  return {s.momentum_buffer()};
}

// Exactly the same values on every rank.
bool same_everywhere(const at::Tensor& t) {
  auto c = t.to(at::kDouble).contiguous();
  return all_ranks(torch::equal(reduce_over_ranks(c, st::ReduceOp::Max),
                                reduce_over_ranks(c, st::ReduceOp::Min)));
}

}  // namespace

// Note [gradient defined everywhere]: a parameter reached on some ranks only
// gets a .grad on every rank (or on none), so SGD with momentum and Adam keep
// identical parameters and state everywhere, equal to the single process.
// Failed before the fix: on the rank with the empty piece `gate` had no .grad
// (elsewhere zeros), so weight decay moved it elsewhere only and Adam kept no
// state there.
TEST(GradientBuckets, GradientReachedOnSomeRanksOnlyIsDefinedEverywhere) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs an empty piece on one of several ranks";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  auto x = at::randn({5, 3, 4}, gen);
  auto pl = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  for (auto where : {EmptyAt::kFirst, EmptyAt::kMiddle, EmptyAt::kLast}) {
    auto sx =
        st::distribute_tensor(x, mesh, pl, false, sizes_with_empty_at(mesh, pl, x.sizes(), where));
    for (bool adam : {false, true}) {
      torch::manual_seed(3);
      Branchy ref;
      torch::manual_seed(3);
      Branchy net;
      st::distribute_module(net, mesh);
      auto make = [&](Branchy& m) -> std::unique_ptr<torch::optim::Optimizer> {
        if (adam) {
          return std::make_unique<torch::optim::Adam>(
              m.parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.1));
        }
        return std::make_unique<torch::optim::SGD>(
            m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
      };
      auto ro = make(ref);
      auto o = make(net);
      train_side_by_side(ref, *ro, x, net, *o, sx, 4);
      const std::string what = std::string(adam ? "Adam" : "SGD momentum") + ", empty piece at " +
                               std::to_string(static_cast<int>(where));
      auto ref_params = ref.named_parameters();
      for (const auto& prm : net.named_parameters()) {
        const at::Tensor& r = ref_params[prm.key()];
        EXPECT_TRUE(all_ranks(prm.value().grad().defined() == r.grad().defined()))
            << prm.key() << " " << what;
        EXPECT_TRUE(same_everywhere(prm.value())) << prm.key() << " " << what;
        EXPECT_TRUE(all_close(prm.value(), r)) << prm.key() << " " << what;
        auto mine = state_of(*o, prm.value(), adam), want = state_of(*ro, r, adam);
        ASSERT_TRUE(all_ranks(mine.size() == want.size()))
            << "optimizer state of " << prm.key() << " " << what;
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_TRUE(same_everywhere(mine[i])) << prm.key() << " state " << i << " " << what;
          EXPECT_TRUE(all_close(mine[i], want[i])) << prm.key() << " state " << i << " " << what;
        }
      }
    }
  }
}
