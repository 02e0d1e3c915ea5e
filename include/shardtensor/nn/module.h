#pragma once
/// \file Module distribution: replicated parameters for sharded compute, with
/// bucketed gradient reduction (Note [gradient buckets], docs/architecture.md).

#include <shardtensor/mesh/device_mesh.h>
#include <torch/arg.h>

#include <cstdint>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace shardtensor {

/// Options of distribute_module().
struct DistributeOptions {
  /// Parameter gradients are summed over the mesh in flat buffers of at most
  /// this many bytes (one dtype per bucket; a larger parameter gets a bucket
  /// of its own).
  TORCH_ARG(int64_t, bucket_cap_bytes) = int64_t{25} << 20;
  /// false: no reducer; every use of a parameter in sharded compute
  /// all-reduces its gradient immediately (one collective per use).
  TORCH_ARG(bool, bucket_gradients) = true;
};

/// Collective over the whole mesh. Broadcasts every parameter and buffer of
/// `module` (recursively) from mesh rank 0, so every rank starts identical,
/// and installs a gradient reducer for its parameters that require grad.
///
/// Gradients (Note [gradient buckets]): a parameter used by a sharded op
/// collects a different partial gradient on every rank. Instead of one
/// all-reduce per use, these partial gradients are added into flat buckets
/// (reverse registration order, one dtype per bucket, at most
/// `bucket_cap_bytes`), and a bucket is summed with a non-blocking all-reduce
/// as soon as all its parameters' gradients are complete, overlapping the rest
/// of backward. Before backward() returns, every parameter's grad() equals the
/// single-process gradient on every rank (the reduced sum is *added* to
/// grad(), so gradient accumulation over several backwards works).
///
/// Contributions that do not come through a sharded op (a parameter used in
/// plain, replicated compute, e.g. a weight penalty on plain tensors) are
/// already the full gradient on every rank and go to grad() directly,
/// unreduced; only the partial contributions are summed, so mixing both is
/// correct. A use through a view of a parameter (linear's `w.t()`) is routed
/// to the parameter's bucket too (the view is re-taken after the marking).
/// Uses over a subset of the mesh dims, or on another mesh, are all-reduced
/// by their own collective (correct, not bucketed).
/// Parameters without a gradient in a backward contribute zeros (their grad()
/// stays undefined if it was). Requirements: every rank runs the same
/// backward graph (as every sharded op already requires); backward() (not
/// torch::autograd::grad with `inputs`, which throws) and no create_graph
/// (then the uses are all-reduced immediately). The reducer lives as long as
/// the parameters are registered: calling distribute_module() again on the
/// same parameters replaces it.
///
/// Throws c10::Error on every rank if the ranks' parameter lists disagree in
/// names, shapes or dtypes, or if `bucket_cap_bytes` < 1.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const DistributeOptions& options);
/// Same, with default DistributeOptions.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh);

}  // namespace shardtensor
