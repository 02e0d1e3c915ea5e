// The U-Net of the main job (examples/models/unet.h) trained sharded equals
// single-process training: forward, backward, Adam steps, with uneven shards
// whose pooling windows cross shard boundaries, on 1-D meshes and on a 2x2
// data x domain mesh; checkpoints round-trip; activation memory per rank.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "models/unet.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

/// Uneven, mostly odd shard sizes of H = 48 (divisible by 2^depth = 4), so
/// that 2x2 pooling windows straddle shard boundaries.
std::vector<int64_t> uneven_48(int64_t parts) {
  switch (parts) {
    case 1:
      return {48};
    case 2:
      return {21, 27};
    case 3:
      return {13, 21, 14};
    case 4:
      return {11, 13, 9, 15};
    default:
      return st::balanced_sizes(48, parts);
  }
}

/// Batch over the first mesh dim and H over the last on a 2x2 mesh (data x
/// domain); H over the only mesh dim otherwise.
struct Layout {
  st::Placements placements;
  st::ShardSizes sizes;
};
Layout unet_layout(const st::DeviceMesh& mesh) {
  if (mesh.ndim() == 2) {
    return {{st::Shard{0}, st::Shard{2}}, {{1, 1}, uneven_48(mesh.size(1))}};
  }
  return {{st::Shard{2}}, {uneven_48(mesh.size())}};
}

models::UNetOptions small_options(models::Up up, models::Norm norm) {
  return models::UNetOptions(2, 1).base_channels(4).depth(2).norm(norm).groups(2).up(up);
}

struct RunResult {
  std::vector<at::Tensor> losses;
  at::Tensor first_output;  // gathered
  std::map<std::string, at::Tensor> first_grads;
};

/// `steps` Adam steps of MSE training; x, y plain or ShardTensors.
RunResult train(models::UNet2d& net, const at::Tensor& x, const at::Tensor& y, int steps) {
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  RunResult r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto out = net->forward(x);
    auto loss = (out - y).pow(2).mean();
    loss.backward();
    if (s == 0) {
      r.first_output = gathered(out);
      for (const auto& p : net->named_parameters())
        r.first_grads[p.key()] = p.value().grad().clone();
    }
    r.losses.push_back(loss.detach().clone());
    opt.step();
  }
  return r;
}

void compare_training(const st::DeviceMesh& mesh, models::Up up, models::Norm norm) {
  auto x = rnd({2, 2, 48, 16}, 11);
  auto y = rnd({2, 1, 48, 16}, 12);
  const int steps = 3;
  torch::manual_seed(7);
  models::UNet2d ref(small_options(up, norm));
  torch::manual_seed(7);
  models::UNet2d net(small_options(up, norm));
  st::distribute_module(*net, mesh);
  auto ref_run = train(ref, x, y, steps);
  auto layout = unet_layout(mesh);
  auto sx = st::distribute_tensor(x, mesh, layout.placements, false, layout.sizes);
  auto sy = st::distribute_tensor(y, mesh, layout.placements, false, layout.sizes);
  auto run = train(net, sx, sy, steps);
  // Without normalization: rtol 1e-5, atol 1e-6. With GroupNorm/BatchNorm,
  // atol 1e-5 (as tests/test_norm.cpp): the statistics sum float32 partial
  // sums over the ranks in another order than libtorch's kernel; their
  // rounding scales with the magnitudes summed, and the normalization carries
  // it into every element, so entries near zero need the absolute floor
  // (seen: 1.7e-6 on outputs of magnitude 2 on the 2x2 data x domain mesh).
  const double atol = norm == models::Norm::None ? 1e-6 : 1e-5;
  EXPECT_TRUE(all_close(run.first_output, ref_run.first_output, 1e-5, atol)) << "output";
  for (const auto& [name, g] : ref_run.first_grads) {
    EXPECT_TRUE(all_close(run.first_grads.at(name), g, 1e-5, atol)) << "gradient of " << name;
  }
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(all_close(run.losses[s], ref_run.losses[s], 1e-5, atol)) << "loss at step " << s;
  }
  // Parameters after the Adam steps: rtol 1e-5 but atol 1e-5 (= 1e-3 lr).
  // Adam divides every gradient element by its own running RMS, so an element
  // whose sum cancels to ~1e-7 (terms ~1e-2, summed over other partitions in
  // float32) carries a relative error of ~1e-4 into an update of size ~lr;
  // outputs, gradients and losses above are compared at rtol 1e-5/atol 1e-6.
  // (Seen: 1.4e-6 on a transposed-conv weight at 3 ranks after 3 steps.)
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(all_close(p.value(), ref->named_parameters()[p.key()], 1e-5, 1e-5)) << p.key();
  }
  for (const auto& b : net->named_buffers()) {
    EXPECT_TRUE(all_close(b.value(), ref->named_buffers()[b.key()])) << b.key();
    // BatchNorm's running statistics stay bit-identical on every rank.
    at::Tensor root = b.value().clone();
    MPI_Bcast(root.data_ptr(), static_cast<int>(root.nbytes()), MPI_BYTE, 0, MPI_COMM_WORLD);
    EXPECT_TRUE(all_ranks(at::equal(root, b.value()))) << b.key() << " differs between ranks";
  }
}

}  // namespace

TEST(UNet, InterpolateUpAdamStepsEqualSingleProcess) {
  compare_training(test_mesh(), models::Up::Interpolate, models::Norm::None);
}

TEST(UNet, TransposedUpAdamStepsEqualSingleProcess) {
  compare_training(test_mesh(), models::Up::Transposed, models::Norm::None);
}

TEST(UNet, GroupNormAdamStepsEqualSingleProcess) {
  compare_training(test_mesh(), models::Up::Interpolate, models::Norm::Group);
}

TEST(UNet, BatchNormAdamStepsEqualSingleProcess) {
  compare_training(test_mesh(), models::Up::Transposed, models::Norm::Batch);
}

TEST(UNet, DataTimesDomainMesh) {
  // An explicit {"data", "domain"} mesh: batch over data, H over domain.
  const int64_t P = st::world_size();
  if (P % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  auto mesh = st::DeviceMesh::create({2, P / 2}, {"data", "domain"});
  compare_training(mesh, models::Up::Interpolate, models::Norm::None);
  compare_training(mesh, models::Up::Interpolate, models::Norm::Group);
  compare_training(mesh, models::Up::Transposed, models::Norm::Batch);
}

TEST(UNet, CheckpointRoundTrip) {
  auto mesh = test_mesh();
  auto x = rnd({2, 2, 48, 16}, 21);
  auto y = rnd({2, 1, 48, 16}, 22);
  torch::manual_seed(3);
  models::UNet2d net(small_options(models::Up::Interpolate, models::Norm::Batch));
  st::distribute_module(*net, mesh);
  auto layout = unet_layout(mesh);
  train(net, st::distribute_tensor(x, mesh, layout.placements, false, layout.sizes),
        st::distribute_tensor(y, mesh, layout.placements, false, layout.sizes), 2);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("shardtensor_unet_ckpt_np" + std::to_string(st::world_size()) +
                             (is_mesh_2x2() ? "_2x2" : "") + ".pt"))
                               .string();
  if (mesh.rank() == 0) torch::save(net, path);
  MPI_Barrier(MPI_COMM_WORLD);
  // Into a single-process module (differently initialised): bit-equal.
  torch::manual_seed(100 + mesh.rank());
  models::UNet2d single(small_options(models::Up::Interpolate, models::Norm::Batch));
  torch::load(single, path);
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(all_close(single->named_parameters()[p.key()], p.value(), 0, 0)) << p.key();
  }
  for (const auto& b : net->named_buffers()) {
    EXPECT_TRUE(all_close(single->named_buffers()[b.key()], b.value(), 0, 0)) << b.key();
  }
  // The single-process module computes what the sharded one does.
  auto sx = st::distribute_tensor(x, mesh, layout.placements, false, layout.sizes);
  // (eval mode: BatchNorm uses the loaded running statistics.)
  net->eval();
  single->eval();
  EXPECT_TRUE(all_close(gathered(net->forward(sx)), single->forward(x)));
  single->train();
  // And back: load on every rank, distribute, train on: equal to continuing single-process.
  torch::manual_seed(200 + mesh.rank());
  models::UNet2d again(small_options(models::Up::Interpolate, models::Norm::Batch));
  torch::load(again, path);
  st::distribute_module(*again, mesh);
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(all_close(again->named_parameters()[p.key()], p.value(), 0, 0)) << p.key();
  }
  // One more training step: its loss and gradients (compared before the
  // optimizer: Adam's first step turns near-zero, BatchNorm-invariant gradient
  // entries into +-lr). atol 1e-5 for BatchNorm, see compare_training.
  auto r1 =
      train(again, sx, st::distribute_tensor(y, mesh, layout.placements, false, layout.sizes), 1);
  auto r2 = train(single, x, y, 1);
  EXPECT_TRUE(all_close(r1.losses[0], r2.losses[0], 1e-5, 1e-5));
  for (const auto& [name, g] : r2.first_grads) {
    EXPECT_TRUE(all_close(r1.first_grads.at(name), g, 1e-5, 1e-5)) << "gradient of " << name;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (mesh.rank() == 0) std::filesystem::remove(path);
}

TEST(UNet, TrainingStepMemoryPerRank) {
  // Peak tensor memory of one training step (forward, backward, Adam step)
  // per rank, sharded over H, against the single-process peak / P.
  auto mesh = test_mesh();
  const int64_t P = mesh.size();
  auto opts = models::UNetOptions(2, 1).base_channels(8).depth(3).norm(models::Norm::Group);
  auto x = rnd({1, 2, 512, 256}, 31);
  auto y = rnd({1, 1, 512, 256}, 32);
  auto step = [](models::UNet2d& net, torch::optim::Adam& opt, const at::Tensor& xx,
                 const at::Tensor& yy) {
    const int64_t base = st::memory_stats().current_bytes;
    st::reset_peak_memory_stats();
    opt.zero_grad();
    (net->forward(xx) - yy).pow(2).mean().backward();
    opt.step();
    return st::memory_stats().peak_bytes - base;
  };
  int64_t single = 0, sharded = 0;
  {
    torch::manual_seed(5);
    models::UNet2d net(opts);
    torch::optim::Adam opt(net->parameters());
    step(net, opt, x, y);  // first step allocates Adam's state
    single = step(net, opt, x, y);
  }
  {
    torch::manual_seed(5);
    models::UNet2d net(opts);
    st::distribute_module(*net, mesh);
    torch::optim::Adam opt(net->parameters());
    auto p = fit_placements(mesh, {st::Shard{2}, st::Shard{3}});
    auto sx = st::distribute_tensor(x, mesh, p);
    auto sy = st::distribute_tensor(y, mesh, p);
    step(net, opt, sx, sy);
    sharded = step(net, opt, sx, sy);
  }
  const double ratio = static_cast<double>(sharded) / (static_cast<double>(single) / P);
  if (mesh.rank() == 0) {
    std::printf(
        "[ unet memory ] P=%lld single-process step peak %.2f MB, sharded peak %.2f MB per rank, "
        "ratio to single/P = %.3f\n",
        static_cast<long long>(P), single / 1e6, sharded / 1e6, ratio);
  }
  // Every rank count and the 2x2 mesh (measured: 1.000 at P = 1, 1.002-1.008
  // at P = 2-4 and on 2x2).
  EXPECT_TRUE(all_ranks(ratio <= 1.1)) << "ratio " << ratio;
}
