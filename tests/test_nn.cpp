// distribute_module: identical parameters everywhere, and after backward every
// parameter gradient equals the single-process gradient, with optimizers unchanged.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

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
