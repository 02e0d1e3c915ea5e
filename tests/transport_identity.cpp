// Bit-identity across transports (issue 24, Note [ordered sums] in
// src/comm/transport_mpi.cpp): the same computation, launched once under
// mpirun (MPI transport) and once the torchrun way (c10d / Gloo), must give
// the same bits at the same layout. Rank 0 prints one line per result,
// "digest <name> <hex>", a 64-bit FNV-1a hash of the gathered bytes;
// tests/transport_identity.py runs both launches and compares the lines.
// The results cover every reduction path: sums over a sharded dim in four
// dtypes (all_reduce_), a contraction over a sharded dim (Partial), GroupNorm
// forward and backward, a U-Net step under distribute_module (the gradient
// buckets' non-blocking all-reduce) and one under fully_shard (reduce-scatter
// and all-gather over the data dim, sums over the domain dim).
#include <torch/torch.h>

#include <cinttypes>
#include <cstdio>
#include <string>

#include <shardtensor/core/launch.h>
#include <shardtensor/shardtensor.h>
#include "models/fsdp.h"
#include "models/unet.h"

namespace st = shardtensor;

namespace {

uint64_t fnv1a(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < c.numel() * c.element_size(); ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

void report(const std::string& name, const at::Tensor& t) {
  at::Tensor full = st::ShardTensor::is_shard_tensor(t) ? st::ShardTensor(t).full_tensor() : t;
  if (st::world_rank() == 0) {
    std::printf("digest %s %016" PRIx64 "\n", name.c_str(), fnv1a(full));
    std::fflush(stdout);
  }
}

at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (at::isComplexType(dtype)) return at::randn(sizes, g, at::TensorOptions().dtype(dtype));
  return at::randn(sizes, g, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

models::UNetOptions unet_options() {
  return models::UNetOptions(2, 1).base_channels(4).depth(2).norm(models::Norm::Group).groups(2);
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  at::set_num_threads(1);
  const int64_t p = st::world_size();
  auto mesh = st::DeviceMesh::create({p}, {"x"});
  // Sums over a sharded dim (uneven: 7p + 3 rows).
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kComplexFloat}) {
    auto x = randn({7 * p + 3, 5}, dtype, 1);
    auto sx = st::distribute_tensor(x, mesh, {st::Shard{0}});
    report(std::string("sum.") + c10::toString(dtype), sx.sum(0));
    report(std::string("mean.") + c10::toString(dtype), sx.mean());
  }
  // A contraction over a sharded dim.
  {
    auto a = randn({6, 13 * p + 1}, at::kFloat, 2), b = randn({13 * p + 1, 4}, at::kFloat, 3);
    auto sa = st::distribute_tensor(a, mesh, {st::Shard{1}});
    auto sb = st::distribute_tensor(b, mesh, {st::Shard{0}});
    report("matmul", sa.matmul(sb));
  }
  // GroupNorm forward and backward on rows sharded.
  {
    auto x = randn({2, 4, 5 * p + 2, 6}, at::kFloat, 4).requires_grad_(false);
    auto sx = st::distribute_tensor(x, mesh, {st::Shard{2}}).requires_grad_(true);
    auto w = randn({4}, at::kFloat, 5).requires_grad_(true);
    auto y = at::group_norm(sx, 2, w, {}, 1e-5);
    report("group_norm", y);
    y.pow(2).sum().backward();
    report("group_norm.grad_input", sx.grad());
    report("group_norm.grad_weight", w.grad());
  }
  // A U-Net step under distribute_module (bucketed gradient all-reduce).
  {
    torch::manual_seed(7);
    models::UNet2d net(unet_options());
    st::distribute_module(*net, mesh);
    auto x = randn({2, 2, 8 * p, 12}, at::kFloat, 6), y = randn({2, 1, 8 * p, 12}, at::kFloat, 7);
    auto sx = st::distribute_tensor(x, mesh, {st::Shard{2}});
    auto sy = st::distribute_tensor(y, mesh, {st::Shard{2}});
    auto loss = (net->forward(sx) - sy).pow(2).mean();
    loss.backward();
    report("unet.loss", loss);
    for (const auto& prm : net->named_parameters())
      report("unet.grad." + prm.key(), prm.value().grad());
  }
  // A U-Net step under fully_shard on a data x domain mesh when P allows.
  if (p >= 2) {
    const int64_t data = p % 2 == 0 ? 2 : p, domain = p / data;
    auto mesh2 = st::DeviceMesh::create({data, domain}, {"data", "domain"});
    torch::manual_seed(8);
    models::UNet2d net(unet_options());
    auto units =
        models::fully_shard_blocks(*net, mesh2, "data", st::FullyShardOptions(), {"enc", "dec"});
    auto x = randn({data + 1, 2, 8 * domain, 12}, at::kFloat, 8);
    auto y = randn({data + 1, 1, 8 * domain, 12}, at::kFloat, 9);
    st::Placements pl{st::Shard{0}, st::Shard{2}};
    auto loss =
        (net->forward(st::distribute_tensor(x, mesh2, pl)) - st::distribute_tensor(y, mesh2, pl))
            .pow(2)
            .mean();
    loss.backward();
    report("fsdp.loss", loss);
    for (const auto& u : units) {
      // Every rank's shard of the gradient, gathered.
      for (const auto& g : u.unit.unflatten(u.unit.shard().grad())) {
        report("fsdp.grad." + u.prefix, g);
      }
    }
  }
  if (st::world_rank() == 0) {
    std::printf("transport identity: %s\n", st::current_transport().c_str());
    // Note [host staging]: nonzero only with SHARDTENSOR_STAGE_HOST=1 on a CPU machine.
    std::printf("staged bytes: %lld\n", static_cast<long long>(st::comm_stats().staged_bytes));
  }
  return 0;
}
