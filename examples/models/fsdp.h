#pragma once
// fully_shard per block (Note [fully_shard]): each direct child of a model whose
// name starts with one of `block_prefixes` becomes its own unit, then the root
// takes the rest. Shared by examples/unet_train.cpp and tests/test_fully_shard.cpp.
#include <shardtensor/nn/fully_shard.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace models {

/// A unit and the prefix of its parameter names in the whole model.
struct NamedUnit {
  std::string prefix;
  shardtensor::FullyShard unit;
};

/// Collective over the mesh (one fully_shard call per unit).
inline std::vector<NamedUnit> fully_shard_blocks(torch::nn::Module& model,
                                                 const shardtensor::DeviceMesh& mesh,
                                                 const std::string& dim,
                                                 const shardtensor::FullyShardOptions& options,
                                                 const std::vector<std::string>& block_prefixes) {
  std::vector<NamedUnit> units;
  for (const auto& child : model.named_children()) {
    for (const auto& pre : block_prefixes) {
      if (child.key().rfind(pre, 0) == 0) {
        units.push_back(
            {child.key() + ".", shardtensor::fully_shard(*child.value(), mesh, dim, options)});
        break;
      }
    }
  }
  units.push_back({"", shardtensor::fully_shard(model, mesh, dim, options)});
  return units;
}

}  // namespace models
