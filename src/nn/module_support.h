#pragma once
// Helpers shared by distribute_module (nn/module.cpp) and fully_shard
// (nn/fully_shard.cpp); private to nn/.
#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <string>
#include <utility>
#include <vector>

namespace shardtensor::nn_detail {

/// Collective over every rank of `mesh`. Checks that every rank holds the
/// same named tensors (names, shapes, dtypes, requires_grad) and the same
/// `extra` text; reads no data. Throws c10::Error on every rank, naming
/// `what`, if the lists differ or a tensor is a ShardTensor.
void agree_on_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const DeviceMesh& mesh, const char* what, const std::string& extra);

/// Collective over every rank of `mesh` (after agree_on_tensors). Overwrites
/// the tensors with mesh rank 0's values, one broadcast per dtype.
void broadcast_from_rank0(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const DeviceMesh& mesh);

}  // namespace shardtensor::nn_detail
