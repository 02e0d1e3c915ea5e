#pragma once
// ShardTensorImpl: the TensorImpl behind every ShardTensor (private header).
#include <c10/core/TensorImpl.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <memory>

namespace shardtensor::detail {

/// A TensorImpl with the global sizes, no storage (access throws), dispatch
/// keys {PrivateUse1, AutogradPrivateUse1}, holding the local tensor and the
/// spec. Autograd state lives on local_, never on the wrapper.
class ShardTensorImpl final : public c10::TensorImpl {
 public:
  ShardTensorImpl(at::Tensor local, std::shared_ptr<const ShardSpec> spec);

  const at::Tensor& local() const { return local_; }
  const std::shared_ptr<const ShardSpec>& spec() const { return spec_; }

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  const char* tensorimpl_type_name() const override { return "ShardTensorImpl"; }

  at::Tensor local_;
  std::shared_ptr<const ShardSpec> spec_;
};

/// Local. The impl of `t` if it is a ShardTensor, else nullptr.
ShardTensorImpl* shard_impl(const at::Tensor& t);

/// Local. Wraps `local` (whose shape must equal spec->local_shape()) as a ShardTensor.
at::Tensor make_shard_tensor(at::Tensor local, std::shared_ptr<const ShardSpec> spec);

/// Collective over the mesh dims whose placement or sizes differ. Differentiable.
/// Moves `local` (laid out per `src`) to the layout `dst` (same mesh and global shape).
at::Tensor redistribute_local(const at::Tensor& local, const ShardSpec& src, const ShardSpec& dst);

/// Local. This rank's piece of a replicated `full` tensor under `spec`
/// (narrow along each sharded dim; a view, not a copy). Partial placements
/// are treated as Replicate.
at::Tensor local_slice(const at::Tensor& full, const ShardSpec& spec);

}  // namespace shardtensor::detail
