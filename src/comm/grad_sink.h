#pragma once
// Gradient sinks: where use_replicated() sends the partial gradients of a
// registered replicated leaf instead of all-reducing them (private; used by
// nn/ for distribute_module's bucketed gradient reduction).
//
// See Note [gradient buckets] (src/nn/module.cpp, docs/architecture.md).
#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <memory>

namespace shardtensor::comm::detail {

/// Receives, during backward, this rank's partial gradient of a registered
/// leaf for every use of it in sharded compute that would otherwise be
/// all-reduced over the whole mesh. The sink owns the reduction.
class ReplicatedGradSink {
 public:
  virtual ~ReplicatedGradSink() = default;
  /// Local. `leaf` is the registered tensor; `grad` has its shape.
  virtual void add_partial(const at::TensorImpl* leaf, const at::Tensor& grad) = 0;
};

/// Local. Routes the partial gradients of `leaf` (a leaf tensor, e.g. a
/// parameter) used through use_replicated() over *all* dims of `mesh` to
/// `sink`; a null sink removes the registration. The registry keeps the sink
/// alive while any tensor is registered to it.
void set_grad_sink(const at::Tensor& leaf, const DeviceMesh& mesh,
                   std::shared_ptr<ReplicatedGradSink> sink);

/// Local. The sink registered for `t` if `t` is a registered leaf on `mesh`
/// and `mesh_dims` (sorted) are all of the mesh's dims; else nullptr.
std::shared_ptr<ReplicatedGradSink> grad_sink_for(const at::Tensor& t, const DeviceMesh& mesh,
                                                  const std::vector<int64_t>& mesh_dims);

/// Local. Number of entries in the sink registry (live registered leaves,
/// plus dead ones not yet swept); the long-run test asserts it stays constant.
size_t grad_sink_registry_size();

}  // namespace shardtensor::comm::detail
