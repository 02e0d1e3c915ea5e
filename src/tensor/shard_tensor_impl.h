#pragma once
// ShardTensorImpl: the TensorImpl behind every ShardTensor (private header).
#include <c10/core/TensorImpl.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <functional>
#include <memory>
#include <string>

namespace shardtensor::detail {

/// Note [view write-back]: a view op on a ShardTensor gives a view of the
/// local piece where it can (slice, narrow, transpose, unsqueeze, ...), so
/// in-place ops through it reach the source. Where the rule had to copy or
/// communicate (select or squeeze of a sharded dim, a view that redistributes
/// or copies a piece), the result carries a WriteBack: after an in-place op on
/// the result, the dispatcher calls `fn(result)`, which writes the new values
/// back into the source (and, through the source's own WriteBack, further up a
/// chain of views). `fn` is collective only where the rule's decision to
/// copy depended on metadata alone (so every rank holds one). A result that
/// cannot write back carries a WriteBack without `fn`: an in-place op on it
/// (or on a view of it) raises `refusal` on every rank instead of being
/// silently lost. Who writes back: select, squeeze, diagonal and unbind of a
/// sharded dim, view/unflatten that replicate or copy. Who refuses
/// (ops::refuse_in_place): unfold along a sharded dim and view ops through
/// the generic fallback (as_strided, view_as_real, ...; a result that cannot
/// be re-sharded comes back as a replicated ShardTensor rather than a plain
/// tensor, so that the dispatcher sees the write), which follow their source
/// all the same (ops::refuse_in_place_following, Note [stale copy views]), and
/// view ops of the pointwise family (alias, detach, real, ...) whose operand
/// had to change layout (a Partial one), which do not yet.
/// Gradients flow through written views as in libtorch: Note [function
/// outputs are not views] (comm/function_output.h).
struct WriteBack {
  std::function<void(const at::Tensor& result)> fn;
  std::string refusal;
  /// Note [stale copy views] (ops/shape.cpp): set on a copy view and on every
  /// view of one. Brings the copy's values up to date with its source when the
  /// source was written since the copy was made (or last brought up to date).
  /// Collective over the source's mesh; every rank decides alike, from
  /// alias_version(). The dispatcher calls it before the tensor is used by any
  /// op, as an input or as the written tensor.
  std::function<void(const at::Tensor& self)> refresh;
  /// Local. Whether `refresh` would make the copy anew now (its source, or
  /// a source further up, was written since): identical on every rank.
  /// ShardTensor::local() refuses a stale copy (Note [stale copy views]).
  std::function<bool(const at::Tensor& self)> stale;
  /// How often the copy was made anew by `refresh` (shared by the views of
  /// one copy); part of alias_version().
  std::shared_ptr<int64_t> refreshes;
};

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

  /// Note [view write-back]; nullptr for tensors that are not such views.
  const std::shared_ptr<const WriteBack>& write_back() const { return write_back_; }
  void set_write_back(std::shared_ptr<const WriteBack> wb) { write_back_ = std::move(wb); }

  /// Local. Note [wrapper strides] (ops/shape.cpp): gives the wrapper the
  /// strides that libtorch's own tensor of the same global shape would have
  /// after the same view ops (a permuted or sliced view is not contiguous), so
  /// that is_contiguous() and contiguous() answer as in libtorch. Metadata
  /// only: the piece's own strides are unchanged. Throws if `strides` does not
  /// have one entry per dim.
  void set_global_strides(c10::IntArrayRef strides);

  /// Note [wrapper autograd]: the local piece's gradient accumulator, kept
  /// alive while a hook mirrors its gradient into this wrapper's grad().
  std::shared_ptr<void>& grad_mirror() { return grad_mirror_; }

 private:
  const char* tensorimpl_type_name() const override { return "ShardTensorImpl"; }

  at::Tensor local_;
  std::shared_ptr<const ShardSpec> spec_;
  std::shared_ptr<const WriteBack> write_back_;
  std::shared_ptr<void> grad_mirror_;
};

/// Local. The impl of `t` if it is a ShardTensor, else nullptr.
ShardTensorImpl* shard_impl(const at::Tensor& t);

/// Local. Note [stale copy views] (ops/shape.cpp): the version of the values
/// the ShardTensor `t` shows: its wrapper's version counter (shared by the
/// wrappers that are true views of one another, bumped by the dispatcher on
/// every in-place write, so identical on every rank) plus the number of times
/// the copy it views was made anew. 0 without a version counter (inference
/// tensors).
int64_t alias_version(const at::Tensor& t);

/// Local. Bumps the version counter of `t`'s wrapper (no-op without one).
void bump_alias_version(const at::Tensor& t);

/// Note [stale copy views] (ops/shape.cpp): brings `t` up to date with its
/// source if it is a copy view (or a view of one) whose source was written
/// since; nothing otherwise. Collective over the source's mesh where it acts,
/// and every rank decides alike. The dispatcher calls it for every operand;
/// full_tensor() and redistribute() too.
void refresh_copy_view(const at::Tensor& t);

/// Local. Whether `t` is a copy view (or a view of one) whose source was
/// written since the copy was last made: its local piece shows old values
/// until an op or full_tensor() brings it up to date (refresh_copy_view).
/// Identical on every rank. Does not throw.
bool stale_copy_view(const at::Tensor& t);

/// Local. Note [wrapper autograd]: mirrors local().requires_grad() on the
/// wrapper's own (libtorch) autograd meta, and for a leaf piece that requires
/// grad makes the wrapper's grad() follow the piece's gradient.
void mirror_requires_grad(const at::Tensor& wrapper);

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
