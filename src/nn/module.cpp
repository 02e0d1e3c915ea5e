// distribute_module: make every rank's copy of a module identical.
#include <shardtensor/nn/module.h>
#include <shardtensor/tensor/shard_tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <sstream>

#include "comm/transport.h"

namespace shardtensor {

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.defined(), "distribute_module: the mesh is undefined");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    tensors.emplace_back("parameter " + p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    tensors.emplace_back("buffer " + b.key(), b.value());
  }
  // Every rank must hold the same list: compare a fingerprint before moving
  // any data, so a mismatch throws on every rank (Note [collective discipline]).
  std::ostringstream fp;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(!ShardTensor::is_shard_tensor(t), "distribute_module: ", name,
                " is a ShardTensor; parameters and buffers must be plain tensors");
    fp << name << ':' << t.sizes() << ':' << t.scalar_type() << ';';
  }
  const auto h = static_cast<int64_t>(std::hash<std::string>{}(fp.str()) >> 2);
  auto agree = at::tensor({h, -h}, at::kLong);
  comm::transport::all_reduce_(agree, ReduceOp::Max, mesh.comm());
  TORCH_CHECK(agree[0].item<int64_t>() == -agree[1].item<int64_t>(),
              "distribute_module: ranks hold modules with different parameters or buffers "
              "(names, shapes or dtypes differ); this rank has: ",
              fp.str());
  // One broadcast per dtype: parameters and buffers packed into one bucket.
  std::map<at::ScalarType, std::vector<at::Tensor>> buckets;
  for (const auto& [name, t] : tensors) {
    if (t.numel() > 0) buckets[t.scalar_type()].push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, list] : buckets) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.detach().reshape({-1}));
    at::Tensor bucket = at::cat(flat).contiguous();
    comm::transport::broadcast_(bucket, 0, mesh.comm());
    int64_t off = 0;
    for (auto& t : list) {
      t.detach().copy_(bucket.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace shardtensor
