// Collectives (shardtensor/comm/primitives.h): all_reduce, all_reduce_nograd,
// use_replicated (and its gradient-sink variant, Note [gradient buckets]),
// all_gather, shard_slice, reduce_scatter, replicate_to_partial. Each is a
// torch::autograd::Function whose backward is the adjoint collective (Note
// [replicated gradients], comm/primitive_support.h), itself applied as a
// Function under create_graph (Note [differentiable adjoints]); data moves
// through the transport's all-reduce, all-gatherv and reduce-scatter.
#include <ATen/ATen.h>
#include <shardtensor/comm/primitives.h>

#include <memory>
#include <utility>
#include <vector>

#include "comm/function_output.h"
#include "comm/grad_sink.h"
#include "comm/primitive_support.h"
#include "comm/transport.h"

namespace shardtensor::comm {

using namespace internal;

namespace {

// ---- kernels (no autograd) -------------------------------------------------------

// Back from rows: the result of a primitive must not be a view (Note
// [function outputs are not views], comm/function_output.h).
at::Tensor from_rows(const at::Tensor& rows, int64_t dim) {
  return function_output(rows.movedim(0, dim).contiguous());
}

at::Tensor gather_along(const at::Tensor& local, Comm comm, int64_t dim,
                        const std::vector<int64_t>& sizes) {
  at::Tensor send = transport::send_buffer(local.movedim(dim, 0));  // piece-sized
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= local.size(d);
  if (outer > 1) {
    // Note [strided gather]: the rows land in place; no full-size transpose.
    const int64_t row_bytes = row_numel(local.sizes(), dim) / outer * local.element_size();
    at::Tensor out = at::empty(shape_with(local.sizes(), dim, sum_of(sizes)), local.options());
    transport::all_gatherv_rows(send, out, sizes, outer, row_bytes, comm);
    return out;
  }
  const int64_t row_bytes = row_numel(local.sizes(), dim) * local.element_size();
  at::Tensor recv = at::empty(rows_shape(local.sizes(), dim, sum_of(sizes)), local.options());
  std::vector<int64_t> bytes(sizes.size());
  for (size_t c = 0; c < sizes.size(); ++c) {
    bytes[c] = sizes[c] * row_bytes;
  }
  transport::all_gatherv(send, recv, bytes, comm);
  return from_rows(recv, dim);  // leading extents are 1: no copy
}

at::Tensor reduce_scatter_along(const at::Tensor& t, Comm comm, int64_t dim,
                                const std::vector<int64_t>& sizes, int64_t me) {
  at::Tensor send = transport::send_buffer(t.movedim(dim, 0));
  const int64_t row = row_numel(t.sizes(), dim);
  at::Tensor recv = at::empty(rows_shape(t.sizes(), dim, sizes[me]), t.options());
  std::vector<int64_t> numel(sizes.size());
  for (size_t c = 0; c < sizes.size(); ++c) {
    numel[c] = sizes[c] * row;
  }
  transport::reduce_scatter(send, recv, numel, ReduceOp::Sum, comm);
  return from_rows(recv, dim);
}

at::Tensor reduce_over(const at::Tensor& t, Comm comm, ReduceOp op) {
  at::Tensor out = t.clone(at::MemoryFormat::Contiguous);
  if (comm != comm_null()) {
    transport::all_reduce_(out, op, comm);
  }
  return out;
}

// ---- autograd functions -----------------------------------------------------------

struct GroupArgs {
  Comm comm = comm_null();
};

struct AxisArgs {
  Axis axis;
  int64_t dim = 0;
  std::vector<int64_t> sizes;
};

// Note [differentiable adjoints]: each Function below pairs with the one that
// applies its adjoint. Under create_graph (GradMode enabled inside backward)
// a backward calls its partner's apply() instead of the bare kernel, so the
// gradient it returns is recorded and double backward runs the adjoint of the
// adjoint, i.e. the forward again: exact to any order. The pairs, following
// Note [replicated gradients] (a backward that hands a replicated gradient to
// per-rank compute must mark that use, so its own adjoint sums):
//   AllReduceFn (sum)            <-> UseReplicatedFn (identity, adjoint sum)
//   AllGatherFn                  <-> ShardSliceFn
//   ReduceScatterFn              <-> GatherToPartialFn (all-gather used per rank)
//   ReplicateToPartialFn         <-> PartialToReplicateFn (the rank-0 summand's gradient)
// Without grad mode the backward runs the kernel directly, as before.

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, GroupArgs args) {
    save_args(ctx, args);
    return reduce_over(t, args.comm, ReduceOp::Sum);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct UseReplicatedFn : torch::autograd::Function<UseReplicatedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, GroupArgs args) {
    save_args(ctx, args);
    return t;  // returned input: autograd makes it a view with this node as grad_fn
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

variable_list AllReduceFn::backward(AutogradContext* ctx, variable_list grads) {
  // Note [replicated gradients]: the identity. Under create_graph the
  // replicated gradient is handed to per-rank compute (the summands'
  // backward), a use whose adjoint sums (Note [differentiable adjoints]).
  if (at::GradMode::is_enabled()) {
    return {UseReplicatedFn::apply(grads[0], saved_args<GroupArgs>(ctx)), Variable()};
  }
  return {grads[0], Variable()};
}

variable_list UseReplicatedFn::backward(AutogradContext* ctx, variable_list grads) {
  const auto& args = saved_args<GroupArgs>(ctx);
  if (at::GradMode::is_enabled()) return {AllReduceFn::apply(grads[0], args), Variable()};
  return {reduce_over(grads[0], args.comm, ReduceOp::Sum), Variable()};
}

/// use_replicated() of a leaf registered with a gradient sink (Note [gradient
/// buckets]): the backward hands this rank's partial gradient to the sink,
/// which sums it over the mesh in buckets, and passes nothing on to autograd.
struct SinkArgs {
  std::shared_ptr<detail::ReplicatedGradSink> sink;
  const at::TensorImpl* leaf = nullptr;
  Comm comm = comm_null();    // for the fallback under create_graph
  std::vector<int64_t> dims;  // the mesh dims the use is over
};

struct UseReplicatedSinkFn : torch::autograd::Function<UseReplicatedSinkFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, SinkArgs args) {
    save_args(ctx, std::move(args));
    return t;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& args = saved_args<SinkArgs>(ctx);
    if (!grads[0].defined()) return {Variable(), Variable()};
    if (at::GradMode::is_enabled()) {
      // create_graph: the sink's reduction is not differentiable; the
      // differentiable all-reduce here (Note [differentiable adjoints]).
      return {AllReduceFn::apply(grads[0], GroupArgs{args.comm}), Variable()};
    }
    args.sink->add_partial(args.leaf, grads[0], args.dims);
    return {Variable(), Variable()};
  }
};

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, AxisArgs args) {
    at::Tensor out = gather_along(local, args.axis.comm, args.dim, args.sizes);
    save_args(ctx, std::move(args));
    return function_output(out, {local});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ShardSliceFn : torch::autograd::Function<ShardSliceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& full, AxisArgs args) {
    const auto off = exclusive_offsets(args.sizes);
    at::Tensor out = full.narrow(args.dim, off[args.axis.me], args.sizes[args.axis.me])
                         .clone(at::MemoryFormat::Contiguous);
    save_args(ctx, std::move(args));
    return function_output(out, {full});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

variable_list AllGatherFn::backward(AutogradContext* ctx, variable_list grads) {
  const auto& a = saved_args<AxisArgs>(ctx);
  if (at::GradMode::is_enabled()) return {ShardSliceFn::apply(grads[0], a), Variable()};
  const auto off = exclusive_offsets(a.sizes);
  return {grads[0].narrow(a.dim, off[a.axis.me], a.sizes[a.axis.me]), Variable()};
}

variable_list ShardSliceFn::backward(AutogradContext* ctx, variable_list grads) {
  const auto& a = saved_args<AxisArgs>(ctx);
  if (at::GradMode::is_enabled()) return {AllGatherFn::apply(grads[0], a), Variable()};
  return {gather_along(grads[0], a.axis.comm, a.dim, a.sizes), Variable()};
}

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, AxisArgs args) {
    at::Tensor out = reduce_scatter_along(t, args.axis.comm, args.dim, args.sizes, args.axis.me);
    save_args(ctx, std::move(args));
    return function_output(out, {t});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

/// The backward of reduce_scatter as a Function (Note [differentiable
/// adjoints]): all-gathers a sharded gradient into the replicated gradient of
/// a partial value, which the summands' per-rank backward then uses; so its
/// own adjoint sums the per-rank gradients and keeps this rank's piece
/// (reduce-scatter), not a slice as all_gather's would.
struct GatherToPartialFn : torch::autograd::Function<GatherToPartialFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, AxisArgs args) {
    at::Tensor out = gather_along(local, args.axis.comm, args.dim, args.sizes);
    save_args(ctx, std::move(args));
    return function_output(out, {local});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<AxisArgs>(ctx);
    if (at::GradMode::is_enabled()) return {ReduceScatterFn::apply(grads[0], a), Variable()};
    return {reduce_scatter_along(grads[0], a.axis.comm, a.dim, a.sizes, a.axis.me), Variable()};
  }
};

variable_list ReduceScatterFn::backward(AutogradContext* ctx, variable_list grads) {
  const auto& a = saved_args<AxisArgs>(ctx);
  if (at::GradMode::is_enabled()) return {GatherToPartialFn::apply(grads[0], a), Variable()};
  return {gather_along(grads[0], a.axis.comm, a.dim, a.sizes), Variable()};
}

struct ReplicateToPartialFn : torch::autograd::Function<ReplicateToPartialFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, int64_t coordinate) {
    ctx->saved_data["coordinate"] = coordinate;
    return coordinate == 0 ? t.clone(at::MemoryFormat::Contiguous) : at::zeros_like(t);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

/// The backward of replicate_to_partial as a Function (Note [differentiable
/// adjoints]): the gradient of the replicated input is the gradient of the
/// summand that coordinate 0 holds (identical on every rank, Note [replicated
/// gradients]), so forward is the identity and the adjoint puts the incoming
/// gradient on coordinate 0 only (replicate_to_partial again).
struct PartialToReplicateFn : torch::autograd::Function<PartialToReplicateFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, int64_t coordinate) {
    ctx->saved_data["coordinate"] = coordinate;
    return t;  // returned input: autograd makes it a view with this node as grad_fn
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t c = ctx->saved_data.at("coordinate").toInt();
    if (at::GradMode::is_enabled()) return {ReplicateToPartialFn::apply(grads[0], c), Variable()};
    return {c == 0 ? grads[0] : at::zeros_like(grads[0]), Variable()};
  }
};

variable_list ReplicateToPartialFn::backward(AutogradContext* ctx, variable_list grads) {
  // Note [replicated gradients]: the identity (without grad mode).
  if (at::GradMode::is_enabled()) {
    return {PartialToReplicateFn::apply(grads[0], ctx->saved_data.at("coordinate").toInt()),
            Variable()};
  }
  return {grads[0], Variable()};
}

/// Validation shared by all_gather, shard_slice and reduce_scatter. `local_is_piece`:
/// the local extent along dim must be sizes[me] (else the full extent).
AxisArgs axis_args(Prim p, const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim,
                   int64_t dim, const std::vector<int64_t>& sizes, bool local_is_piece) {
  AxisArgs args;
  args.axis = axis(p, mesh, mesh_dim);
  TORCH_CHECK(t.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  args.dim = wrap_dim(checks, dim, t, "dim");
  if (check_sizes(checks, sizes, args.axis, "sizes") && checks.ok()) {
    const int64_t want = local_is_piece ? sizes[args.axis.me] : sum_of(sizes);
    checks.require(t.size(args.dim) == want, "the local tensor has extent ", t.size(args.dim),
                   " along dim ", args.dim, " but ",
                   local_is_piece ? "sizes[coordinate]" : "sum(sizes)", " = ", want,
                   " (coordinate ", args.axis.me, " of mesh dim ", args.axis.mesh_dim, ")");
  }
  Fingerprint fp;
  fp.add(args.axis.mesh_dim).add(dim).add(sizes).add_shape(t, {args.dim});
  agree_or_throw(p, args.axis.comm, fp, checks);
  args.sizes = sizes;
  return args;
}

}  // namespace

// ---- public API -------------------------------------------------------------------

at::Tensor all_reduce(const at::Tensor& t, const DeviceMesh& mesh,
                      const std::vector<int64_t>& mesh_dims) {
  const Prim p = Prim::AllReduce;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  if (g.comm == comm_null()) {
    return AllReduceFn::apply(t, GroupArgs{});
  }
  Checks checks(p);
  Fingerprint fp;
  fp.add(g.dims).add_shape(t, {});
  agree_or_throw(p, g.comm, fp, checks);
  return AllReduceFn::apply(t, GroupArgs{g.comm});
}

at::Tensor all_reduce_nograd(const at::Tensor& t, const DeviceMesh& mesh,
                             const std::vector<int64_t>& mesh_dims, ReduceOp op) {
  const Prim p = Prim::AllReduceNograd;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  at::Tensor in = t.detach();
  if (g.comm == comm_null()) {
    return in.clone(at::MemoryFormat::Contiguous);
  }
  Checks checks(p);
  Fingerprint fp;
  fp.add(g.dims).add(static_cast<int64_t>(op)).add_shape(t, {});
  agree_or_throw(p, g.comm, fp, checks);
  return reduce_over(in, g.comm, op);
}

// Note [weight view backward]: the view `t` of `base` taken again on
// `marked` (a tensor with base's geometry). A transpose (linear's w.t()) or a
// same-strided reshape is re-taken as that view, whose backward is a
// transpose or a view of the gradient; only other views go through
// as_strided, whose backward allocates a zeroed buffer of the base's storage
// and scatters into it (AsStridedBackward).
namespace {
at::Tensor retake_view(const at::Tensor& marked, const at::Tensor& t) {
  const at::Tensor base(t._base());
  if (t.storage_offset() == base.storage_offset()) {
    if (t.dim() == 2 && base.dim() == 2 && t.size(0) == base.size(1) && t.size(1) == base.size(0) &&
        t.stride(0) == base.stride(1) && t.stride(1) == base.stride(0)) {
      return marked.t();
    }
    if (base.is_contiguous() && t.is_contiguous() && t.numel() == base.numel()) {
      return marked.view(t.sizes());
    }
  }
  return marked.as_strided(t.sizes(), t.strides(), t.storage_offset());
}
}  // namespace

at::Tensor use_replicated(const at::Tensor& t, const DeviceMesh& mesh,
                          const std::vector<int64_t>& mesh_dims) {
  const Prim p = Prim::UseReplicated;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  detail::before_replicated_use(t);  // fully_shard gathers here (Note [fully_shard])
  if (g.comm != comm_null()) {
    Checks checks(p);
    Fingerprint fp;
    fp.add(g.dims).add_shape(t, {});
    agree_or_throw(p, g.comm, fp, checks);
  }
  if (auto sink = detail::grad_sink_for(t, mesh, g.dims)) {
    return UseReplicatedSinkFn::apply(
        t, SinkArgs{std::move(sink), t.unsafeGetTensorImpl(), g.comm, g.dims});
  }
  if (t.is_view() && t.requires_grad()) {
    // A view of a registered leaf (linear's w.t()): route the leaf itself to
    // its sink and take the same view again, so that autograd maps the
    // view's gradient back onto the leaf's shape.
    const at::Tensor base(t._base());
    if (auto sink = detail::grad_sink_for(base, mesh, g.dims)) {
      at::Tensor marked = UseReplicatedSinkFn::apply(
          base, SinkArgs{std::move(sink), base.unsafeGetTensorImpl(), g.comm, g.dims});
      return retake_view(marked, t);
    }
  }
  return UseReplicatedFn::apply(t, GroupArgs{g.comm});
}

at::Tensor all_gather(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t dim, const std::vector<int64_t>& sizes) {
  return AllGatherFn::apply(local,
                            axis_args(Prim::AllGather, local, mesh, mesh_dim, dim, sizes, true));
}

at::Tensor shard_slice(const at::Tensor& full, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<int64_t>& sizes) {
  return ShardSliceFn::apply(full,
                             axis_args(Prim::ShardSlice, full, mesh, mesh_dim, dim, sizes, false));
}

at::Tensor reduce_scatter(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim,
                          int64_t dim, const std::vector<int64_t>& sizes) {
  return ReduceScatterFn::apply(
      t, axis_args(Prim::ReduceScatter, t, mesh, mesh_dim, dim, sizes, false));
}

at::Tensor replicate_to_partial(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim) {
  const Prim p = Prim::ReplicateToPartial;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  Checks checks(p);
  Fingerprint fp;
  fp.add(a.mesh_dim).add_shape(t, {});
  agree_or_throw(p, a.comm, fp, checks);
  return ReplicateToPartialFn::apply(t, a.me);
}

}  // namespace shardtensor::comm
