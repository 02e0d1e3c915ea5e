#pragma once
/// \file ShardTensor: a real at::Tensor that reports the global shape and
/// holds this rank's piece.
///
/// A ShardTensor's TensorImpl carries the dispatch keys PrivateUse1 and
/// AutogradPrivateUse1; every aten op that touches one is intercepted above
/// autograd and sent to a sharding rule (see dispatch/). Only one library per
/// process can own PrivateUse1.
///
/// Note [factories return at::Tensor]: scatter_tensor, distribute_tensor,
/// ShardTensor::from_local and redistribute return a plain `at::Tensor` handle
/// whose impl is a ShardTensorImpl. libtorch's `AnyModule` (behind
/// `torch::nn::Sequential`) checks the *static* argument type, so a
/// `ShardTensor`-typed value would be rejected there; an at::Tensor goes
/// wherever an at::Tensor goes. `ShardTensor(t)` is the typed view (local(),
/// spec(), full_tensor(), grad(), redistribute()) and costs one refcount.
///
/// Autograd history lives on the local tensor (local()); the wrapper itself
/// has none. So: use `loss.backward()` on plain (replicated) results, and
/// shardtensor::backward() on sharded ones; read gradients with grad().

#include <ATen/core/Tensor.h>
#include <shardtensor/spec/shard_spec.h>

#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace shardtensor {

class ShardTensor : public at::Tensor {
 public:
  ShardTensor() = default;
  /// Local. Views `t` as a ShardTensor; throws c10::Error if it is not one.
  explicit ShardTensor(at::Tensor t);

  /// Local. True if `t` is defined and is a ShardTensor.
  static bool is_shard_tensor(const at::Tensor& t);

  /// Collective over the whole mesh when `sizes` is not given (the local
  /// extents are all-gathered), local otherwise apart from one all-reduce of
  /// an error flag. Wraps `local` (no copy; autograd history is kept).
  /// Throws c10::Error on every rank if the local shapes do not fit the
  /// placements (ranks disagree on a non-sharded extent, or on ndim), or if
  /// `sizes` is invalid or does not match `local.sizes()`.
  /// A Partial placement means every rank holds a summand.
  ///
  /// Returns a plain `at::Tensor` handle (that is a ShardTensor) so that the
  /// result goes wherever an at::Tensor goes (`torch::nn::Sequential`,
  /// `AnyModule`, `std::vector<at::Tensor>`, deduced templates); view it as
  /// `ShardTensor(t)` for the typed accessors. See Note [factories return at::Tensor].
  static at::Tensor from_local(at::Tensor local, DeviceMesh mesh, Placements placements,
                               std::optional<ShardSizes> sizes = std::nullopt);

  /// Local. Wraps `local` under `spec` without validation beyond local shape == spec.local_shape().
  static ShardTensor from_local_unchecked(at::Tensor local, std::shared_ptr<const ShardSpec> spec);

  /// Local. This rank's piece; autograd history lives here. Throws
  /// c10::Error when the tensor is a copy that libtorch would make a view
  /// (select or unbind of a sharded dim, ...) and its source was written since
  /// (Note [stale copy views]): the piece would show old values; any op, such
  /// as clone(), brings it up to date.
  const at::Tensor& local() const;
  /// Local. Layout metadata (identical on every rank).
  const ShardSpec& spec() const;
  std::shared_ptr<const ShardSpec> spec_ptr() const;
  const DeviceMesh& mesh() const { return spec().mesh(); }
  const Placements& placements() const { return spec().placements(); }

  /// Collective over the mesh dims that are not Replicate. Differentiable.
  /// The whole global tensor as a plain tensor on every rank (all-gatherv,
  /// all-reduce for Partial).
  at::Tensor full_tensor() const;

  /// Collective over the mesh dims whose placement or sizes change.
  /// Differentiable. Any placements on the same mesh: Shard(a) -> Shard(b) by
  /// all-to-all, Shard <-> Replicate, Partial -> Replicate / Shard (all-reduce,
  /// reduce-scatter), Replicate -> Partial, and Shard(a) -> Shard(a) with new
  /// explicit sizes (rebalancing). Throws on every rank, before communicating,
  /// for invalid placements or sizes, or for Shard -> Partial.
  /// Returns an at::Tensor handle (Note [factories return at::Tensor]).
  at::Tensor redistribute(Placements placements,
                          std::optional<ShardSizes> sizes = std::nullopt) const;

  /// Local. The gradient accumulated in local() as a ShardTensor with the same
  /// spec (Partial mesh dims become Replicate: every summand's gradient is the
  /// whole gradient), or an undefined tensor if there is none.
  ShardTensor grad() const;

  /// Local. Whether local() requires grad (the wrapper itself carries no autograd state).
  bool requires_grad() const;

  /// Local. "ShardTensor(global=[..], placements=[..], local=[..], mesh=[..])".
  std::string to_string() const;
};

/// Local. Prints to_string() (global shape, placements, local shape), then the local values.
std::ostream& operator<<(std::ostream& os, const ShardTensor& t);

/// Collective over the mesh. Only `src` (a rank of mesh.comm()) needs `full`
/// (on any device); the others may pass an undefined tensor. Shape and dtype
/// are broadcast, then each rank receives only its own piece (a scatterv),
/// never the whole tensor. The piece lives on `device`, or on mesh.device()
/// when none is given (each rank its own GPU on a CUDA mesh), and is a leaf
/// that requires grad if `requires_grad`. Throws on every rank if `full` on
/// src does not fit the placements.
/// Returns an at::Tensor handle (Note [factories return at::Tensor]).
at::Tensor scatter_tensor(const at::Tensor& full, int src, const DeviceMesh& mesh,
                          Placements placements, bool requires_grad = false,
                          std::optional<c10::Device> device = std::nullopt);

/// Local (no communication): every rank has `full` and keeps a contiguous copy
/// of its piece, a leaf that requires grad if `requires_grad`, on `device`, or
/// on mesh.device() when none is given (as PyTorch's distribute_tensor moves
/// a tensor to its mesh's device type).
/// Partial placements keep the value on coordinate 0 and zeros elsewhere.
/// Returns an at::Tensor handle (Note [factories return at::Tensor]).
at::Tensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, Placements placements,
                             bool requires_grad = false,
                             std::optional<ShardSizes> sizes = std::nullopt,
                             std::optional<c10::Device> device = std::nullopt);

/// Collective when `output` is a ShardTensor (as its backward is). Runs the
/// backward pass from any tensor, sharded or plain. `grad_output` may be a
/// ShardTensor with the same spec, a plain tensor of the global shape (sliced
/// to this rank's piece), or undefined for a single-element output.
/// `retain_graph` and `create_graph` as in torch::autograd::backward; with
/// create_graph the accumulated gradients are differentiable (Note
/// [differentiable adjoints], docs/architecture.md). Throws (on every rank
/// alike) if grad_output does not match the output's global shape.
void backward(const at::Tensor& output, const at::Tensor& grad_output = {},
              std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);

/// Collective (it runs a backward pass: every rank of the meshes involved must
/// call it, with the same outputs and inputs). torch::autograd::grad for
/// ShardTensors and plain tensors alike: returns d(outputs)/d(inputs), one per
/// input; a ShardTensor input's gradient is a ShardTensor laid out like it
/// (Partial mesh dims become Replicate), a plain input's is plain, an unused
/// input's is undefined when allow_unused. `grad_outputs` is empty (every
/// output has one element) or one per output, each as for backward().
/// With create_graph=true the gradients are differentiable: a scalar made of
/// them can be differentiated again (shardtensor::grad or backward), giving
/// exact second derivatives (gradient penalties, PINN residuals; Note
/// [differentiable adjoints], docs/custom_layers.md "Higher-order gradients").
/// Double backward through an op that cannot give it exactly throws a
/// c10::Error naming the op on every rank.
///
/// ```cpp
/// auto y = model(x);                                   // x: a ShardTensor
/// auto loss = y.square().mean();                       // plain, replicated
/// auto gx = shardtensor::grad({loss}, {x}, {}, true, /*create_graph=*/true)[0];
/// auto penalty = (gx * gx).sum();                      // plain, replicated
/// penalty.backward();                                  // second derivatives
/// ```
/// Throws (on every rank alike) if the counts differ, an input does not
/// require grad, or an input is unused and allow_unused is false.
std::vector<at::Tensor> grad(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& grad_outputs = {},
                             std::optional<bool> retain_graph = std::nullopt,
                             bool create_graph = false, bool allow_unused = false);

}  // namespace shardtensor
