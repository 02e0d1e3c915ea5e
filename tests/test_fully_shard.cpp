// fully_shard (Note [fully_shard]): three Adam steps of a U-Net, with each
// encoder/decoder block its own unit and the root holding the rest, equal three
// single-process steps on the concatenated batch (losses, parameters, Adam
// state, float64), at every data x domain layout of the ranks; each rank
// holds 1/D of the parameters and of the optimizer state.
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include <shardtensor/io/checkpoint.h>
#include "models/fsdp.h"
#include "models/unet.h"
#include "nn/fully_shard_stats.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

struct Layout {
  int64_t data, domain;
};

/// Every data x domain factorization of the world's size.
std::vector<Layout> layouts() {
  const int64_t p = test_mesh().size();
  std::vector<Layout> out;
  for (int64_t d = 1; d <= p; ++d) {
    if (p % d == 0) out.push_back({d, p / d});
  }
  return out;
}

std::string name_of(const Layout& l) {
  return std::to_string(l.data) + "x" + std::to_string(l.domain);
}

using models::NamedUnit;

/// fully_shard on every encoder/decoder block, then on the root.
std::vector<NamedUnit> shard_unet(models::UNet2d& net, const st::DeviceMesh& mesh,
                                  bool reshard_after_forward) {
  return models::fully_shard_blocks(
      *net, mesh, "data", st::FullyShardOptions().reshard_after_forward(reshard_after_forward),
      {"enc", "dec"});
}

const torch::optim::AdamParamState& adam_state(const torch::optim::Adam& opt, const at::Tensor& p) {
  const auto& state = opt.state();
  auto it = state.find(p.unsafeGetTensorImpl());
  TORCH_CHECK(it != state.end(), "no Adam state");
  return static_cast<const torch::optim::AdamParamState&>(*it->second);
}

void check_unet_layout(const Layout& l, bool zero3) {
  SCOPED_TRACE("layout " + name_of(l) + (zero3 ? " ZeRO-3" : " ZeRO-2"));
  auto mesh = st::DeviceMesh::create({l.data, l.domain}, {"data", "domain"});
  const int64_t batch = l.data + 1;  // uneven over the data dim
  auto x = rnd({batch, 2, 16, 12}, 31).to(at::kDouble);
  auto y = rnd({batch, 1, 16, 12}, 32).to(at::kDouble);
  auto opts =
      models::UNetOptions(2, 1).base_channels(4).depth(2).norm(models::Norm::Group).groups(2);
  torch::manual_seed(5);
  models::UNet2d ref(opts);
  ref->to(at::kDouble);
  torch::manual_seed(50 + mesh.rank());  // different on every rank: fully_shard broadcasts
  models::UNet2d net(opts);
  net->to(at::kDouble);
  // Rank 0's initial values must be the reference's.
  if (mesh.rank() == 0) {
    torch::NoGradGuard g;
    auto rp = ref->named_parameters();
    for (auto& p : net->named_parameters()) p.value().copy_(rp[p.key()]);
  }
  auto units = shard_unet(net, mesh, zero3);
  ASSERT_GE(units.size(), 3u);  // blocks enc*, dec*, and the root
  for (const auto& u : units) {
    EXPECT_TRUE(u.unit.is_sharded()) << u.prefix;
    EXPECT_EQ(u.unit.shard().numel(), (u.unit.numel() + l.data - 1) / l.data) << u.prefix;
  }
  auto shards = st::fully_shard_parameters(*net);
  EXPECT_EQ(shards.size(), units.size());
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(shards, torch::optim::AdamOptions(1e-2));
  // Batch over "data", rows over "domain".
  st::Placements p{st::Shard{0}, st::Shard{2}};
  auto sx = st::distribute_tensor(x, mesh, p);
  auto sy = st::distribute_tensor(y, mesh, p);
  const auto before = st::detail::fully_shard_overlap_stats();
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    auto ref_loss = (ref->forward(x) - y).pow(2).mean();
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    auto loss = (net->forward(sx) - sy).pow(2).mean();
    // After forward: ZeRO-3 has freed every block but the last one used;
    // ZeRO-2 holds them all; the root is gathered.
    int64_t gathered = 0;
    for (const auto& u : units) gathered += u.unit.is_sharded() ? 0 : 1;
    EXPECT_EQ(gathered, zero3 ? 2 : static_cast<int64_t>(units.size())) << "step " << step;
    loss.backward();
    for (const auto& u : units) EXPECT_TRUE(u.unit.is_sharded()) << "after backward: " << u.prefix;
    EXPECT_TRUE(all_close(loss, ref_loss, 1e-10, 0)) << "loss at step " << step;
    opt.step();
  }
  // Note [fully_shard prefetch]: from the second step on, every block but
  // the first is gathered early in forward; with ZeRO-3 every block's
  // backward starts the gather of the block before it (skip connections
  // included); each early gather is used, none is stale.
  const auto after = st::detail::fully_shard_overlap_stats();
  const int64_t blocks = static_cast<int64_t>(units.size()) - 1;
  const int64_t fwd = l.data > 1 ? 2 * (blocks - 1) : 0;
  const int64_t bwd = l.data > 1 && zero3 ? 3 * (blocks - 1) : 0;
  EXPECT_EQ(after.forward_prefetches - before.forward_prefetches, fwd);
  EXPECT_EQ(after.backward_prefetches - before.backward_prefetches, bwd);
  EXPECT_EQ(after.prefetches_used - before.prefetches_used, fwd + bwd);
  EXPECT_EQ(after.stale_prefetches, before.stale_prefetches);
  // One gradient reduce-scatter per unit and step, each but the step's last
  // finished only when the next unit's started.
  const int64_t reductions = l.data > 1 ? 3 * (blocks + 1) : 0;
  EXPECT_EQ(after.reductions_started - before.reductions_started, reductions);
  EXPECT_EQ(after.reductions_finished_late - before.reductions_finished_late,
            l.data > 1 ? 3 * blocks : 0);
  auto rp = ref->named_parameters();
  for (const auto& u : units) {
    const auto full = u.unit.full_state_dict();
    const auto& st_ = adam_state(opt, u.unit.shard());
    EXPECT_EQ(st_.exp_avg().numel(), u.unit.shard_numel());  // 1/D of the state
    const auto m1 = u.unit.unflatten(st_.exp_avg());
    const auto m2 = u.unit.unflatten(st_.exp_avg_sq());
    for (size_t i = 0; i < full.size(); ++i) {
      const std::string name = u.prefix + full[i].first;
      const at::Tensor& r = rp[name];
      EXPECT_TRUE(all_close(full[i].second, r, 1e-10, 1e-14)) << "parameter " << name;
      const auto& rs = adam_state(ref_opt, r);
      EXPECT_TRUE(all_close(m1[i], rs.exp_avg(), 1e-10, 1e-16)) << "exp_avg of " << name;
      EXPECT_TRUE(all_close(m2[i], rs.exp_avg_sq(), 1e-10, 1e-20)) << "exp_avg_sq of " << name;
      EXPECT_EQ(st_.step(), rs.step());
    }
  }
}

struct Scale : torch::nn::Module {
  Scale() { w = register_parameter("w", torch::full({3}, 1.5, at::kDouble)); }
  at::Tensor forward(const at::Tensor& x) { return x * w; }
  at::Tensor w;
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    scale = register_module("scale", std::make_shared<Scale>());
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return scale->forward(fc2(torch::tanh(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::shared_ptr<Scale> scale;
};

}  // namespace

TEST(FullyShard, UNetAdamStepsEqualSingleProcessAtEveryLayout) {
  for (const auto& l : layouts()) {
    check_unet_layout(l, /*zero3=*/true);
    check_unet_layout(l, /*zero3=*/false);
  }
}

// A unit with fewer elements than D (Scale: 3), a plain use of a parameter
// (a weight penalty: whole gradient, no sum), clip_grad_norm_ against
// torch's, and full state dicts in and out.
TEST(FullyShard, SmallUnitsPlainUsesAndClipping) {
  for (const auto& l : layouts()) {
    SCOPED_TRACE("layout " + name_of(l));
    auto mesh = st::DeviceMesh::create({l.data, l.domain}, {"data", "domain"});
    auto x = rnd({2 * l.data + 1, 9, 5}, 41).to(at::kDouble);
    auto y = rnd({2 * l.data + 1, 9, 3}, 42).to(at::kDouble);
    torch::manual_seed(3);
    Net ref;
    torch::manual_seed(3);
    Net net;
    auto u_scale = st::fully_shard(*net.scale, mesh, "data");
    auto u_fc1 = st::fully_shard(*net.fc1, mesh, "data");
    auto u_root = st::fully_shard(net, mesh, "data");
    EXPECT_EQ(u_scale.shard_numel(), (3 + l.data - 1) / l.data);
    const std::vector<st::FullyShard> units{u_scale, u_fc1, u_root};
    torch::optim::AdamW ref_opt(ref.parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(st::fully_shard_parameters(net), torch::optim::AdamWOptions(1e-2));
    auto sx = st::distribute_tensor(x, mesh, {st::Shard{0}, st::Shard{1}});
    auto sy = st::distribute_tensor(y, mesh, {st::Shard{0}, st::Shard{1}});
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      auto ref_loss = (ref.forward(x) - y).pow(2).mean() + 0.1 * ref.fc2->weight.pow(2).sum();
      ref_loss.backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref.parameters(), 0.05);
      ref_opt.step();
      opt.zero_grad();
      auto out = net.forward(sx);
      u_root.unshard();  // a plain use below
      auto loss = (out - sy).pow(2).mean() + 0.1 * net.fc2->weight.pow(2).sum();
      loss.backward();
      EXPECT_TRUE(net.fc2->weight.grad().defined() == false) << "module parameters get no grad";
      const double norm = st::clip_grad_norm_(units, 0.05);
      EXPECT_NEAR(norm, ref_norm, 1e-10 * ref_norm) << "step " << step;
      EXPECT_TRUE(all_close(loss, ref_loss, 1e-10, 0)) << "loss at step " << step;
      opt.step();
    }
    auto rp = ref.named_parameters();
    const std::vector<std::string> pre{"scale.", "fc1.", ""};
    for (size_t k = 0; k < units.size(); ++k) {
      for (const auto& [n, v] : units[k].full_state_dict()) {
        EXPECT_TRUE(all_close(v, rp[pre[k] + n], 1e-10, 1e-14)) << pre[k] + n;
      }
    }
    // Full state in: a fresh model takes the trained values.
    torch::manual_seed(77);
    Net other;
    auto o_scale = st::fully_shard(*other.scale, mesh, "data");
    auto o_root = st::fully_shard(other, mesh, "data");
    o_scale.load_full_state_dict(u_scale.full_state_dict());
    std::vector<std::pair<std::string, at::Tensor>> root_state;
    for (const auto& [n, v] : u_root.full_state_dict()) root_state.emplace_back(n, v);
    for (const auto& [n, v] : u_fc1.full_state_dict()) root_state.emplace_back("fc1." + n, v);
    o_root.load_full_state_dict(root_state);
    auto a = net.forward(sx), b = other.forward(sx);
    EXPECT_TRUE(all_close(gathered(a), gathered(b), 0, 0));
  }
}

// Note [fully_shard prefetch]: gathers started early are used, gradient
// reduce-scatters run while the next unit's backward computes, and a shard
// changed while its early gather was in flight is never used.
TEST(FullyShard, PrefetchOverlapsAndNeverUsesAStaleShard) {
  for (const auto& l : layouts()) {
    SCOPED_TRACE("layout " + name_of(l));
    auto mesh = st::DeviceMesh::create({l.data, l.domain}, {"data", "domain"});
    auto x = rnd({2 * l.data + 1, 9, 5}, 43).to(at::kDouble);
    auto y = rnd({2 * l.data + 1, 9, 3}, 44).to(at::kDouble);
    torch::manual_seed(4);
    Net ref;
    torch::manual_seed(4);
    Net net;
    auto u_scale = st::fully_shard(*net.scale, mesh, "data");
    auto u_fc1 = st::fully_shard(*net.fc1, mesh, "data");
    auto u_root = st::fully_shard(net, mesh, "data");
    torch::optim::SGD ref_opt(ref.parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt(st::fully_shard_parameters(net), torch::optim::SGDOptions(0.1));
    auto sx = st::distribute_tensor(x, mesh, {st::Shard{0}, st::Shard{1}});
    auto sy = st::distribute_tensor(y, mesh, {st::Shard{0}, st::Shard{1}});
    // Forward order fc1, scale (the root's fc2 runs between them). Counted
    // from step 1: step 0 records the order (and its backward may regather a
    // unit that an earlier forward without backward left in the order).
    // One SGD step of both models; the losses must agree.
    auto step_both = [&](const std::string& what) {
      ref_opt.zero_grad();
      auto ref_loss = (ref.forward(x) - y).pow(2).mean();
      ref_loss.backward();
      ref_opt.step();
      opt.zero_grad();
      auto loss = (net.forward(sx) - sy).pow(2).mean();
      loss.backward();
      EXPECT_TRUE(all_close(loss, ref_loss, 1e-10, 0)) << what;
      opt.step();
    };
    st::detail::FullyShardOverlapStats before;
    for (int step = 0; step < 2; ++step) {
      if (step == 1) before = st::detail::fully_shard_overlap_stats();
      step_both("loss at step " + std::to_string(step));
    }
    const auto mid = st::detail::fully_shard_overlap_stats();
    const int64_t early = l.data > 1 ? 1 : 0;
    // Step 1 gathers scale early when fc1 starts; the backward of scale
    // starts fc1's gather (fc1 was freed when scale started).
    EXPECT_EQ(mid.forward_prefetches - before.forward_prefetches, early);
    EXPECT_EQ(mid.backward_prefetches - before.backward_prefetches, early);
    EXPECT_EQ(mid.prefetches_used - before.prefetches_used, 2 * early);
    EXPECT_EQ(mid.stale_prefetches, before.stale_prefetches);
    // One reduce-scatter per unit over the data dim; the first two are
    // finished when the next one starts.
    EXPECT_EQ(mid.reductions_started - before.reductions_started, 3 * early);
    EXPECT_EQ(mid.reductions_finished_late - before.reductions_finished_late, 2 * early);
    // fc1 alone starts scale's gather (scale came after fc1 last time); the
    // shard then changes before scale is used: the use must see the change.
    auto h = net.fc1->forward(sx);
    {
      torch::NoGradGuard no_grad;
      u_scale.shard().add_(0.25);
      ref.scale->w.add_(0.25);
    }
    auto out = net.forward(sx);
    auto ref_out = ref.forward(x);
    EXPECT_TRUE(all_close(gathered(out), ref_out, 1e-12, 0)) << "a stale early gather was used";
    const auto late = st::detail::fully_shard_overlap_stats();
    EXPECT_EQ(late.forward_prefetches - mid.forward_prefetches, early);
    EXPECT_EQ(late.stale_prefetches - mid.stale_prefetches, early);
    // And the step after it is still exact.
    ref_opt.zero_grad();
    (ref_out - y).pow(2).mean().backward();
    ref_opt.step();
    opt.zero_grad();
    (out - sy).pow(2).mean().backward();
    opt.step();
    // SHARDTENSOR_FSDP_PREFETCH=0: nothing starts early, the result is the same.
    {
      setenv("SHARDTENSOR_FSDP_PREFETCH", "0", 1);
      const auto off = st::detail::fully_shard_overlap_stats();
      for (int step = 0; step < 2; ++step) {
        step_both("loss without prefetch, step " + std::to_string(step));
      }
      unsetenv("SHARDTENSOR_FSDP_PREFETCH");
      const auto on = st::detail::fully_shard_overlap_stats();
      EXPECT_EQ(on.forward_prefetches, off.forward_prefetches);
      EXPECT_EQ(on.backward_prefetches, off.backward_prefetches);
      EXPECT_EQ(on.reductions_finished_late, off.reductions_finished_late);
    }
    auto rp = ref.named_parameters();
    const std::vector<std::string> pre{"scale.", "fc1.", ""};
    const std::vector<st::FullyShard> units{u_scale, u_fc1, u_root};
    for (size_t k = 0; k < units.size(); ++k) {
      for (const auto& [n, v] : units[k].full_state_dict()) {
        EXPECT_TRUE(all_close(v, rp[pre[k] + n], 1e-10, 1e-14)) << pre[k] + n;
      }
    }
  }
}

TEST(FullyShard, RejectsBadInputOnEveryRank) {
  auto mesh = st::DeviceMesh::create({test_mesh().size()}, {"data"});
  torch::nn::Linear lin(3, 2);
  bool threw = false;
  try {
    st::fully_shard(*lin, mesh, "domain");
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("'domain' is not a dim of the mesh") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
  // Mixed dtypes in one unit.
  torch::nn::Linear mixed(3, 2);
  mixed->bias.set_data(mixed->bias.to(at::kDouble));
  threw = false;
  try {
    st::fully_shard(*mixed, mesh, "data");
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("is Double but weight is Float") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
  // The same parameters twice.
  torch::nn::Linear twice(3, 2);
  st::fully_shard(*twice, mesh, "data");
  threw = false;
  try {
    std::vector<std::pair<std::string, at::Tensor>> ps{{"weight", twice->weight}};
    st::fully_shard(ps, {}, mesh, "data", st::FullyShardOptions(), false);
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("already in a fully_shard unit") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
}

// Note [fully_shard checkpoint]: two Adam steps at 2x2, a checkpoint, then a
// different model and optimizer at 4x1 load it and take the third step; the
// result equals three single-process steps.
TEST(FullyShard, CheckpointSavedAt2x2ContinuesAt4x1) {
  if (test_mesh().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  auto x = rnd({4, 2, 16, 12}, 61).to(at::kDouble);
  auto y = rnd({4, 1, 16, 12}, 62).to(at::kDouble);
  auto opts =
      models::UNetOptions(2, 1).base_channels(4).depth(2).norm(models::Norm::Group).groups(2);
  torch::manual_seed(8);
  models::UNet2d ref(opts);
  ref->to(at::kDouble);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<at::Tensor> ref_losses;
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    auto l = (ref->forward(x) - y).pow(2).mean();
    l.backward();
    ref_opt.step();
    ref_losses.push_back(l.detach());
  }
  const std::string dir = "test_fully_shard_checkpoint";
  st::Placements p{st::Shard{0}, st::Shard{2}};
  {
    auto mesh = st::DeviceMesh::create({2, 2}, {"data", "domain"});
    torch::manual_seed(8);
    models::UNet2d net(opts);
    net->to(at::kDouble);
    shard_unet(net, mesh, true);
    torch::optim::Adam opt(st::fully_shard_parameters(*net), torch::optim::AdamOptions(1e-2));
    auto sx = st::distribute_tensor(x, mesh, p), sy = st::distribute_tensor(y, mesh, p);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      auto l = (net->forward(sx) - sy).pow(2).mean();
      l.backward();
      opt.step();
      EXPECT_TRUE(all_close(l, ref_losses[step], 1e-10, 0)) << "2x2 step " << step;
    }
    st::io::save_checkpoint(
        dir, mesh,
        st::io::CheckpointState().tensors(st::io::fully_shard_tensors(*net, mesh, &opt)).step(2));
  }
  auto mesh = st::DeviceMesh::create({4, 1}, {"data", "domain"});
  torch::manual_seed(1234);  // another initialization: everything comes from the checkpoint
  models::UNet2d net(opts);
  net->to(at::kDouble);
  auto units = shard_unet(net, mesh, true);
  torch::optim::Adam opt(st::fully_shard_parameters(*net), torch::optim::AdamOptions(1e-2));
  auto loaded = st::io::load_checkpoint(
      dir, mesh, st::io::LoadOptions().layouts(st::io::fully_shard_layouts(*net, mesh, &opt)));
  EXPECT_EQ(loaded.step, 2);
  st::io::load_fully_shard_tensors(loaded, *net, &opt);
  auto sx = st::distribute_tensor(x, mesh, p), sy = st::distribute_tensor(y, mesh, p);
  opt.zero_grad();
  auto l = (net->forward(sx) - sy).pow(2).mean();
  l.backward();
  opt.step();
  EXPECT_TRUE(all_close(l, ref_losses[2], 1e-10, 0)) << "4x1 step 2";
  auto rp = ref->named_parameters();
  for (const auto& u : units) {
    const auto full = u.unit.full_state_dict();
    const auto& s = adam_state(opt, u.unit.shard());
    const auto m2 = u.unit.unflatten(s.exp_avg_sq());
    EXPECT_EQ(s.step(), 3);
    for (size_t i = 0; i < full.size(); ++i) {
      const std::string name = u.prefix + full[i].first;
      EXPECT_TRUE(all_close(full[i].second, rp[name], 1e-10, 1e-14)) << name;
      EXPECT_TRUE(all_close(m2[i], adam_state(ref_opt, rp[name]).exp_avg_sq(), 1e-10, 1e-20))
          << name;
    }
  }
}
