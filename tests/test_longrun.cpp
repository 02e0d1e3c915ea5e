// Long runs stay flat (issue 15): 1,000 training steps of a small U-Net-shaped
// model (conv, GroupNorm, max-pool, bilinear upsampling, skip connection) on a
// sharded field. After warm-up, nothing the library holds may grow with the
// number of steps: live tensor memory, MPI communicators (meshes' and
// duplicated ones), and the traffic of one step. A leak of one small tensor
// per step, a plan or communicator cached per call, or a gradient bucket that
// is never released fails this test.
#include <torch/torch.h>

#include "comm/error_channel.h"
#include "comm/grad_sink.h"
#include "comm/halo.h"
#include "comm/repartition.h"
#include "comm/transport.h"
#include "mesh/live_comms.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

struct TinyUNetImpl : torch::nn::Module {
  torch::nn::Conv2d c1{nullptr}, c2{nullptr}, c3{nullptr};
  torch::nn::GroupNorm n1{nullptr};
  TinyUNetImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 8, 3).padding(1)));
    n1 = register_module("n1", torch::nn::GroupNorm(2, 8));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    c3 = register_module("c3", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 1, 3).padding(1)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(n1(c1(x)));
    auto d = torch::relu(c2(torch::max_pool2d(h, 2)));
    auto u = torch::nn::functional::interpolate(d, torch::nn::functional::InterpolateFuncOptions()
                                                       .scale_factor(std::vector<double>{2.0, 2.0})
                                                       .mode(torch::kBilinear)
                                                       .align_corners(false));
    return c3(torch::cat({h, u}, 1));
  }
};
TORCH_MODULE(TinyUNet);

struct Snapshot {
  int64_t memory = 0, mesh_comms = 0, dup_comms = 0, step_bytes = 0, step_messages = 0;
  // The library's caches and registries.
  size_t halo_plans = 0, grad_sinks = 0, error_channel = 0;
  size_t other_plans = 0;  // repartition, all-to-all and box-exchange plans
};

}  // namespace

TEST(LongRun, ThousandStepsStayFlat) {
  auto mesh = test_mesh();
  torch::manual_seed(3);
  TinyUNet net;
  st::distribute_module(*net, mesh);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  const P p = fit_placements(mesh, {S2, S0});
  // A fixed batch, re-sent every step: no dataset memory changes over the run.
  auto x = st::distribute_tensor(rnd({2, 2, 24, 16}, 1), mesh, p);
  auto y = st::distribute_tensor(rnd({2, 1, 24, 16}, 2), mesh, p);
  auto step = [&] {
    opt.zero_grad();
    auto loss = torch::mse_loss(net(x), y);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };
  auto snapshot = [&] {
    Snapshot s;
    st::reset_comm_stats();
    const double l = step();
    EXPECT_TRUE(std::isfinite(l));
    s.step_bytes = st::comm_stats().bytes_sent;
    s.step_messages = st::comm_stats().messages;
    s.memory = st::memory_stats().current_bytes;
    s.mesh_comms = st::detail::live_mesh_communicators();
    s.dup_comms = st::comm::transport::live_duplicates();
    s.halo_plans = st::comm::halo_plan_cache_size();
    s.other_plans = st::comm::repartition_plan_cache_size() +
                    st::comm::all_to_all_plan_cache_size() + st::comm::box_plan_cache_size();
    s.grad_sinks = st::comm::detail::grad_sink_registry_size();
    s.error_channel = st::comm::errors::tracked_entries();
    return s;
  };
  constexpr int kSteps = 1000;
  double first = 0.0, last = 0.0;
  for (int i = 0; i < 10; ++i) first = step();
  const Snapshot early = snapshot();
  for (int i = 11; i < kSteps - 1; ++i) last = step();
  const Snapshot late = snapshot();
  EXPECT_TRUE(all_ranks(late.memory == early.memory))
      << "live tensor bytes after step 11: " << early.memory << ", after step " << kSteps << ": "
      << late.memory;
  EXPECT_TRUE(all_ranks(late.mesh_comms == early.mesh_comms))
      << early.mesh_comms << " -> " << late.mesh_comms << " mesh communicators";
  EXPECT_TRUE(all_ranks(late.dup_comms == early.dup_comms))
      << early.dup_comms << " -> " << late.dup_comms << " duplicated communicators";
  EXPECT_TRUE(
      all_ranks(late.step_bytes == early.step_bytes && late.step_messages == early.step_messages))
      << "one step sent " << early.step_bytes << " B in " << early.step_messages
      << " messages at step 11 and " << late.step_bytes << " B in " << late.step_messages
      << " at step " << kSteps;
  EXPECT_TRUE(
      all_ranks(late.halo_plans == early.halo_plans && (mesh.size() == 1 || early.halo_plans > 0)))
      << early.halo_plans << " -> " << late.halo_plans << " cached halo plans";
  EXPECT_TRUE(all_ranks(late.other_plans == early.other_plans))
      << early.other_plans << " -> " << late.other_plans
      << " cached repartition, all-to-all and box-exchange plans";
  EXPECT_TRUE(all_ranks(late.grad_sinks == early.grad_sinks))
      << early.grad_sinks << " -> " << late.grad_sinks << " gradient-sink registry entries";
  EXPECT_TRUE(all_ranks(late.error_channel == early.error_channel))
      << early.error_channel << " -> " << late.error_channel << " error-channel entries";
  // It trained (a flat run that does nothing would pass the checks above).
  EXPECT_LT(last, first);
}
