#pragma once
/// \file Module distribution: replicated parameters for sharded compute.

#include <shardtensor/mesh/device_mesh.h>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace shardtensor {

/// Collective over the whole mesh. Broadcasts every parameter and buffer of
/// `module` (recursively) from mesh rank 0, so every rank starts identical.
/// Gradients need no further synchronization: a parameter used by a sharded
/// op receives the sum of every rank's contribution in its backward (see
/// Note [replicated gradients]), so after backward() every parameter's grad()
/// equals the single-process gradient on every rank.
/// Throws c10::Error on every rank if the ranks' parameter lists disagree in
/// names, shapes or dtypes.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh);

}  // namespace shardtensor
