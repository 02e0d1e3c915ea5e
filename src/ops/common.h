#pragma once
// Helpers shared by the sharding rules (private).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <shardtensor/comm/primitives.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ops/registry.h"
#include "tensor/shard_tensor_impl.h"

namespace torch::autograd {
struct AutogradContext;
}  // namespace torch::autograd

namespace shardtensor::ops {

using SpecPtr = std::shared_ptr<const ShardSpec>;

/// The spec of `t` if it is a ShardTensor, else nullptr.
const ShardSpec* spec_of(const at::Tensor& t);
SpecPtr spec_ptr_of(const at::Tensor& t);
/// The local tensor of a ShardTensor, `t` itself otherwise.
at::Tensor local_of(const at::Tensor& t);
/// Wraps a local result.
at::Tensor wrap(at::Tensor local, SpecPtr spec);

/// Local. Note [view write-back] (tensor/shard_tensor_impl.h): marks every
/// ShardTensor in `result` (a tensor or a tensor list) as a copy where
/// libtorch would return a view, so that an in-place op on it raises on every
/// rank, naming the op and `why`, instead of being lost. Callers decide from
/// metadata only (every rank marks alike). Plain tensors are left alone.
void refuse_in_place(const c10::IValue& result, const std::string& why);

/// Note [stale copy views] (ops/shape.cpp): what a copy (a result that
/// libtorch would return as a view of the ShardTensor `source`) records of its
/// source, to be made anew after a write into it. The one home of that
/// bookkeeping for shape.cpp's copy views and refuse_in_place_following's
/// copies. Local, except outdated().
struct CopyOrigin {
  /// Records `source`'s layout and alias_version now; `what` names the view
  /// op and its layouts in messages. Throws (internal) if `source` is not a
  /// ShardTensor.
  CopyOrigin(at::Tensor source, std::string what);
  /// Collective over `source`'s mesh where `source` is itself a stale copy (it
  /// is brought up to date first); otherwise local. Whether the copy must be
  /// made anew (source's alias_version moved on), identical on every rank.
  /// Throws on every rank alike when `source`'s layout changed since (an
  /// in-place view op), naming `what` and `used`'s layout: take the view again.
  bool outdated(const at::Tensor& used) const;
  /// After the copy was made anew: counts it (refreshes) and records the
  /// current version.
  void remade();
  /// After a write through the copy into the source: records the version.
  void wrote_back() { seen = detail::alias_version(source); }
  /// Local. Whether the copy shows old values (source or its own source
  /// written since).
  bool stale() const;

  at::Tensor source;
  SpecPtr spec;  // the source's layout when the copy was made
  int64_t seen;  // the source's alias_version when the copy was last made
  std::string what;
  std::shared_ptr<int64_t> refreshes = std::make_shared<int64_t>(0);
};
/// Local (marks only; the refresh it installs is collective). Note [stale
/// copy views] (ops/shape.cpp) for copies made anew by rerunning what made
/// them: `results` (the ShardTensors of one call, copies where libtorch's
/// results would be views of the ShardTensor `source`) refuse in-place ops as
/// refuse_in_place(why) makes them, and follow `source`. Before one of them,
/// or a view of one, is used (WriteBack::refresh), when source's
/// alias_version moved on since this call (every rank alike): `source` is
/// brought up to date first if it is a copy view itself; a changed layout of
/// `source` (an in-place view op) is refused on every rank, naming `what`
/// (the view op and its layouts); otherwise `remake()` (collective) returns
/// the results' new local pieces, in order, which are copied into the current
/// ones (so that views of them see the new values too; autograd records the
/// copy, as for shape.cpp's copy views). Until then they are stale
/// (WriteBack::stale: ShardTensor::local() raises). One generation for all
/// `results`: `remake` runs once per change of `source`, and the results'
/// WriteBack::refreshes counts it. Throws what `remake` throws.
void refuse_in_place_following(const std::vector<at::Tensor>& results, const std::string& why,
                               const at::Tensor& source, const std::string& what,
                               std::function<std::vector<at::Tensor>()> remake);

/// Whether the op's schema returns a view of an argument (an alias that is
/// not written), as select, view, unfold and view_as_real do.
bool returns_view(const c10::FunctionSchema& schema);

/// Pops the op's arguments off the stack (in order).
std::vector<c10::IValue> pop_args(const c10::OperatorHandle& op, Stack* stack);

// Boxed-argument helpers (local). SymInt arguments arrive as ints or as
// (concrete) SymInts depending on the caller; both are accepted.

/// Whether the schema argument is written to (in-place self, out=).
bool is_written(const c10::Argument& a);
/// An int / SymInt argument; throws c10::Error for anything else.
int64_t int_arg(const c10::IValue& v);
/// An int[] / SymInt[] argument as integers.
std::vector<int64_t> int_list(const c10::IValue& v);
/// An optional int[] / SymInt[] argument (None: nullopt).
std::optional<std::vector<int64_t>> opt_int_list(const c10::IValue& v);
/// An optional tensor argument (None: an undefined tensor).
at::Tensor opt_tensor(const c10::IValue& v);

/// "aten::add.Tensor(self=ShardTensor(global=[4, 6], placements=[Shard(0)], local=[2, 6]),
/// other=Tensor[6], alpha=1)"
std::string describe_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);

/// Throws c10::Error naming the op, the shapes and the placements of every argument.
[[noreturn]] void fail(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                       const std::string& why);

/// Local. The op's arguments, copied from the top of `stack` without popping
/// them (for rule predicates, Note [partial rules]).
std::vector<c10::IValue> peek_args(const c10::OperatorHandle& op, const Stack& stack);

/// Local. The spec of `self` (args[0]); throws (naming the op) unless it is a ShardTensor.
const ShardSpec& self_spec(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);

/// Local. `dim` wrapped against a tensor of `ndim` dims (a 0-d tensor takes 0
/// and -1, as libtorch's); throws (naming the op) when it is out of range.
int64_t wrap_dim(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, int64_t ndim,
                 int64_t dim);

/// Local. The layout of a tensor of `shape` replicated over every dim of `mesh`.
ShardSpec replicated_spec(const DeviceMesh& mesh, c10::IntArrayRef shape);

/// Local. "[2, 3]": a shape or a list of dims, as libtorch prints it.
std::string shape_str(c10::IntArrayRef v);

/// Every ShardTensor in `args` (tensor lists included), in order.
std::vector<at::Tensor> shard_args(const std::vector<c10::IValue>& args);

/// The common mesh of all ShardTensor arguments; throws (naming the op) if they differ.
DeviceMesh common_mesh(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);

/// Mesh dims on which `spec` is Shard.
std::vector<int64_t> sharded_mesh_dims(const ShardSpec& spec);

/// The layout that an operand of shape `shape` (right-aligned against `out`'s
/// shape, as broadcasting does) must have to be combined elementwise with a
/// result laid out as `out`: Shard where the operand spans the sharded dim at
/// full size, Replicate where it broadcasts. Sizes are inherited.
ShardSpec operand_spec(const ShardSpec& out, c10::IntArrayRef shape);

/// Local. operand_spec(out, shape), and Partial where `out` is Partial: the
/// layout of an addend (a bias, a Partial operand of add) that joins a pending
/// sum (Note [pending partial sums], ops/pointwise.cpp). A replicated operand
/// brought to it holds its value on coordinate 0 of those mesh dims and zeros
/// elsewhere (comm::replicate_to_partial), so it is counted once.
ShardSpec pending_operand_spec(const ShardSpec& out, c10::IntArrayRef shape);

/// Converts an operand (a plain tensor, taken as replicated, or a ShardTensor
/// in any layout on the same mesh) to the local piece of layout `target`.
/// `compute` is the layout of the computation it takes part in: on mesh dims
/// where `compute` is Shard but `target` is Replicate, or `compute` is Partial
/// and `target` Replicate (an operand of every summand, Note [pending partial
/// sums]), the operand is marked with comm::use_replicated so that its gradient
/// is summed over those dims (Note [replicated gradients]). Differentiable;
/// collective as redistribution is.
at::Tensor to_layout(const at::Tensor& operand, const ShardSpec& target, const ShardSpec& compute);

/// Same layout with every Partial placement turned into Replicate.
ShardSpec without_partial(const ShardSpec& spec);

/// Note [pending partial sums]: `t` with every Partial mesh dim summed
/// (Partial -> Replicate, differentiable), for consumers that need the value;
/// a plain tensor, or a ShardTensor without Partial, is returned as is.
/// Collective over the Partial mesh dims (same spec on every rank).
at::Tensor summed_partial(const at::Tensor& t);

/// Spec with new placements/shape/sizes on the same mesh, as a shared pointer.
SpecPtr make_spec(const DeviceMesh& mesh, Placements placements, std::vector<int64_t> shape,
                  std::optional<ShardSizes> sizes = std::nullopt);

/// Wraps the op's results: results that alias a written argument (in-place,
/// out=) return that argument; others are wrapped with `spec`, or returned
/// plain if `spec` is null. Pushes them on the stack.
void push_results(const c10::OperatorHandle& op, const std::vector<c10::IValue>& orig_args,
                  Stack* results, const SpecPtr& spec, Stack* stack);

/// Local. Whether converting a piece laid out as `src` to `dst` replicates
/// more than the piece (some mesh dim goes from Shard to Replicate).
/// Depends on metadata only, so every rank agrees.
bool gathers(const ShardSpec& src, const ShardSpec& dst);

/// Local. Bytes this rank receives beyond its piece when converting `src` to
/// `dst` (0 if the piece does not grow).
int64_t gathered_bytes(const ShardSpec& src, const ShardSpec& dst, int64_t itemsize);

/// Note [visible gathers] for rules that replicate more than a rank's piece.
/// Call before the communication, on every rank: in strict mode throws (on
/// every rank, naming the op, `what` and the arguments); otherwise counts
/// `bytes` in CommStats::gathered_bytes and warns once per op on mesh rank 0.
void note_gather(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                 const DeviceMesh& mesh, int64_t bytes, const std::string& what);

/// Note [reduced precision]: float16 and bfloat16 pieces. Rules that combine
/// partial results across ranks (sums, statistics, online softmax) compute
/// and communicate them in float32 and round once, at the end, to the input's
/// dtype, so the sharded result is at least as accurate as libtorch's own
/// kernels (which accumulate in float32 too). Local.
/// The accumulation dtype: float32 for float16/bfloat16, `t` otherwise.
at::ScalarType acc_dtype(at::ScalarType t);
/// Whether `t` is float16 or bfloat16.
bool is_reduced_float(at::ScalarType t);

/// Local. The identity of max (`is_max`) or min for dtype `t`: -inf / +inf
/// for floating types, the lowest / highest value for integral types, false /
/// true for bool. Used where an empty piece contributes to a max or min across
/// ranks (reductions, cummax/cummin). Throws for complex and other dtypes
/// without an order.
at::Scalar extreme_identity(at::ScalarType t, bool is_max);

/// Note [reduced precision]. A tiny plain call of the op family's libtorch
/// kernel with the given dtypes (the input's first, then its parameters';
/// at::ScalarType::Undefined for an absent one), on an input that requires
/// grad when `requires_grad`.
using DtypeProbe =
    std::function<at::Tensor(c10::ArrayRef<at::ScalarType> dtypes, bool requires_grad)>;

/// Note [reduced precision]. Local, and the same verdict on every rank (it
/// depends on the dtypes alone), so call it before any communication. Unless
/// every dtype in `dtypes` is the same float32/float64, runs `probe` (with
/// autocast off, and its backward when `backward`); if libtorch throws,
/// throws on every rank a c10::Error naming the op, its shapes and
/// placements, with libtorch's own message. This keeps a rule that composes
/// the op from other kernels from succeeding where libtorch's kernel fails
/// (no float16 kernel, a parameter dtype libtorch refuses), and keeps ranks
/// with empty pieces (which may never call the kernel) from going on to a
/// collective alone. A probe may also TORCH_CHECK its result (a kernel this
/// libtorch computes wrongly). Verdicts are cached per (family, dtypes, backward).
void check_dtype_support(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                         const char* family, std::vector<at::ScalarType> dtypes, bool backward,
                         const DtypeProbe& probe);
/// The same verdict as a message ("" when supported), for callers that are not ops.
std::string dtype_support_error(const char* family, std::vector<at::ScalarType> dtypes,
                                bool backward, const DtypeProbe& probe);
/// The dtype of `t`, at::ScalarType::Undefined when `t` is undefined.
at::ScalarType dtype_or_none(const at::Tensor& t);
/// A tensor of ones of `shape` and `dtype` for a probe, undefined when `dtype` is Undefined.
at::Tensor probe_ones(c10::IntArrayRef shape, at::ScalarType dtype, bool requires_grad = false);
/// Whether the backward pass of a call on `t` will run (grad mode on and `t` requires grad).
bool will_backward(const at::Tensor& t);

/// Local, differentiable: at::constant_pad_nd(x, pad, value) on a local piece.
/// It once replaced libtorch 1.13's op, which refused any dim the pad list
/// covers whose padded extent is 0 (a piece empty along a sharded dim threw on
/// that rank alone); 2.13 pads such pieces and trims a dim to exactly 0, so it
/// is now the plain op, and callers may call at::constant_pad_nd directly.
inline at::Tensor constant_pad_piece(const at::Tensor& x, c10::IntArrayRef pad,
                                     const at::Scalar& value) {
  return at::constant_pad_nd(x, pad, value);
}

/// Note [plain fast path]: P = 1, or every mesh dim that shards an op's
/// non-local dims has size 1. Local (metadata only, so every rank agrees).
/// Whether an op that is independent along the tensor dims `local_dims` (the
/// batch dim of a convolution, N and C of a pooling, ...) can run as the plain
/// libtorch call on the local piece: every mesh dim of size > 1 is Replicate
/// or Shard on one of `local_dims` with no empty piece, no tensor dim is
/// sharded by two mesh dims, and the local piece is not empty.
bool runs_plain(const ShardSpec& spec, const at::Tensor& local,
                const std::vector<int64_t>& local_dims);

/// Note [plain fast path]. Runs `op` itself on the local piece of args[0]
/// (the ShardTensor input), every other tensor argument taken as replicated
/// (to_layout; plain parameters pass through unchanged, marked with
/// use_replicated only where a mesh dim of size > 1 shards the input), and
/// pushes the results wrapped with plain_output_spec(). No copy and no
/// communication beyond what libtorch's call does; autograd is libtorch's.
void call_plain(const c10::OperatorHandle& op, std::vector<c10::IValue> args, Stack* stack);

/// Local. The layout of a result of the plain path: the input's placements
/// (Partial -> Replicate), global extent and sizes kept on dims that a mesh
/// dim of size > 1 shards, the result's own extent elsewhere.
SpecPtr plain_output_spec(const ShardSpec& in, c10::IntArrayRef out_local);

/// The backward of the autograd Function `name` (`Fn::backward` calls this
/// with its formula): runs `formula` as an outermost op when no op is running
/// on this thread, so that an error it raises on some ranks only reaches
/// every rank (Note [carried rule errors] in comm/error_channel.h). Throws
/// what `formula` throws, or c10::Error when another rank's formula raised.
using BackwardFormula = std::vector<at::Tensor> (*)(torch::autograd::AutogradContext*,
                                                    std::vector<at::Tensor>);
std::vector<at::Tensor> carried_backward(const char* name, torch::autograd::AutogradContext* ctx,
                                         std::vector<at::Tensor> grads, BackwardFormula formula);

}  // namespace shardtensor::ops
