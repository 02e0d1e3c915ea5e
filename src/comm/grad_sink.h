#pragma once
// Gradient sinks: where use_replicated() sends the partial gradients of a
// registered replicated leaf instead of all-reducing them (private; used by
// nn/ for distribute_module's bucketed gradient reduction).
//
// See Note [gradient buckets] (src/nn/module.cpp, docs/architecture.md).
#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <memory>
#include <vector>

namespace shardtensor::comm::detail {

/// Receives, during backward, this rank's partial gradient of a registered
/// leaf for every use of it in sharded compute that would otherwise be
/// all-reduced over the whole mesh. The sink owns the reduction.
class ReplicatedGradSink {
 public:
  virtual ~ReplicatedGradSink() = default;
  /// Local. `leaf` is the registered tensor; `grad` has its shape and is
  /// this rank's summand of a sum over `mesh_dims` (sorted) of the mesh.
  virtual void add_partial(const at::TensorImpl* leaf, const at::Tensor& grad,
                           const std::vector<int64_t>& mesh_dims) = 0;
  /// Local. Whether the sink takes the partial gradients of uses over
  /// `mesh_dims` (sorted) of a mesh with `mesh_ndim` dims; the default takes
  /// uses over all dims only (the others are all-reduced by use_replicated).
  virtual bool takes(int64_t mesh_ndim, const std::vector<int64_t>& mesh_dims) const {
    return static_cast<int64_t>(mesh_dims.size()) == mesh_ndim;
  }
  /// Called by use_replicated() before `leaf` (or a view of it) is used, on
  /// any mesh and over any dims, while grad mode is whatever the caller's is.
  /// The default does nothing; fully_shard's units gather their parameters
  /// here (collective over their data dim, Note [fully_shard]).
  virtual void before_use(const at::TensorImpl* /*leaf*/) {}
  /// Local. Whether before_use() does anything; once a registered sink says
  /// so, the dispatcher offers every plain tensor argument of an op on
  /// ShardTensors to before_replicated_use().
  virtual bool wants_before_use() const { return false; }
};

/// Local. Routes the partial gradients of `leaf` (a leaf tensor, e.g. a
/// parameter) used through use_replicated() over *all* dims of `mesh` to
/// `sink`; a null sink removes the registration. The registry keeps the sink
/// alive while any tensor is registered to it.
void set_grad_sink(const at::Tensor& leaf, const DeviceMesh& mesh,
                   std::shared_ptr<ReplicatedGradSink> sink);

/// Local. The sink registered for `t` if `t` is a registered leaf on `mesh`
/// and the sink takes uses over `mesh_dims` (sorted; by default only all of
/// the mesh's dims); else nullptr.
std::shared_ptr<ReplicatedGradSink> grad_sink_for(const at::Tensor& t, const DeviceMesh& mesh,
                                                  const std::vector<int64_t>& mesh_dims);

/// Calls before_use() of the sink registered for `t` (or for the base of a
/// view `t`), if any; whatever that sink communicates. Cheap when nothing is
/// registered.
void before_replicated_use(const at::Tensor& t);

/// Local. Whether a sink that wants before_use() was ever registered (a
/// relaxed atomic read: the dispatcher's fast path).
bool before_use_enabled();

/// Local. Number of entries in the sink registry (live registered leaves,
/// plus dead ones not yet swept); the long-run test asserts it stays constant.
size_t grad_sink_registry_size();

}  // namespace shardtensor::comm::detail
