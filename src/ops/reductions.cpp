// Reductions: sum, nansum, mean, amax/amin, max/min (all-element and .dim),
// argmax/argmin, prod, var/std (and var_mean/std_mean), norm and
// linalg_vector_norm, all/any, count_nonzero, logsumexp, _local_scalar_dense.
//
// Note [reduction layout]: reducing over the set R of tensor dims
//  - removes the dims of R (size 1 with keepdim) and renumbers the remaining
//    Shard dims; shard sizes of the remaining dims are inherited;
//  - on every mesh dim that shards a dim of R, the per-rank partial results
//    are combined with one collective over that mesh dim, and the result is
//    Replicate there;
//  - when R is every dim, the result is a PLAIN tensor, identical on every
//    rank and connected to autograd (so `x.mean().backward()` works);
//  - when no mesh dim shards a dim of R (and no Partial must be summed), the
//    op runs unchanged on the local tensor, without communication: exactly
//    libtorch's numerics (except var/std, Note [variance]).
// Partial inputs are summed first (these ops are not linear), except for sum
// and mean, which keep Partial on the result (or sum it into a plain one).
//
// Note [gradient carriers]: for reductions whose value is combined with
// non-differentiable collectives (max, min, norms), the value is computed on
// detached tensors and the gradient is attached with carry_grad(value,
// carrier): forward returns `value`, backward hands the incoming gradient to
// `carrier` unchanged. The carrier is a local, differentiable expression whose
// gradient with respect to the local input is exactly libtorch's formula, e.g.
// sum_R(x * w) with w = mask / tie_count for amax. This is `value.detach() +
// (carrier - carrier.detach())` without the NaN that construction produces
// when the carrier is infinite, and it needs no backward communication: the
// result is replicated, so its gradient is already the full gradient on every
// rank (Note [replicated gradients]), and each rank routes it to its piece.
//
// Under create_graph the carrier's gradient is recorded, so the second
// derivative is the carrier's: exact when the carrier's gradient is the
// op's gradient as a function of x (not only its value at this x). Every
// carrier below is: the max/min ones are linear with constant weights
// (libtorch's second derivative is zero too), std and the p-norms use the
// differentiable global sum and a masked root whose gradient is libtorch's
// (zero where the result is zero). The one exception, a norm of negative
// order, is flagged and throws on every rank in double backward.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/WrapDimMinimal.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>

#include "ops/carry_grad.h"
#include "ops/common.h"

namespace shardtensor::ops {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kNoIndex = std::numeric_limits<int64_t>::max();

// ---------------------------------------------------------------- helpers

// sqrt(s) for s >= 0 as a carrier (Note [gradient carriers]): its gradient is
// 1 / (2 sqrt(s)), and 0 where s == 0 (libtorch's std and norm backward), to
// every order; pow(s, 1/ord) likewise for a p-norm.
at::Tensor masked_root(const at::Tensor& s, double ord) {
  at::Tensor pos = s.detach() != 0;
  at::Tensor safe = at::where(pos, s, at::ones_like(s));
  return at::where(pos, ord == 2 ? safe.sqrt() : safe.pow(1.0 / ord), s * 0);
}

// The layout of one reduction (Note [reduction layout]).
struct Plan {
  std::vector<int64_t> dims;  // reduced tensor dims, ascending
  bool keepdim = false;
  bool all = false;                   // every dim reduced: plain result
  std::vector<int64_t> mesh_dims;     // mesh dims that shard a reduced dim
  std::vector<int64_t> partial_dims;  // mesh dims that are Partial in the input
  SpecPtr out;                        // result layout (null when `all`)
  int64_t count = 1;                  // input elements per result element
  std::vector<int64_t> kshape;        // this rank's result shape with keepdim
};

// `dims`: nullopt or empty means every dim (as libtorch 1.13 and 2.13 do for
// these ops; on 2.13 checked for each op that calls this with dim=[]).
Plan make_plan(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
               const ShardSpec& in, const std::optional<std::vector<int64_t>>& dims, bool keepdim) {
  const int64_t nd = in.ndim();
  std::vector<bool> red(nd, dims == std::nullopt || dims->empty());
  if (dims) {
    for (int64_t d : *dims) {
      int64_t w = 0;
      try {
        w = c10::maybe_wrap_dim(d, nd);
      } catch (const c10::Error& e) {
        fail(op, args, e.what_without_backtrace());
      }
      if (nd == 0) continue;
      if (red[w]) {
        fail(op, args, "dim " + std::to_string(w) + " appears multiple times in the list of dims");
      }
      red[w] = true;
    }
  }
  Plan p;
  p.keepdim = keepdim;
  p.all = true;
  for (int64_t d = 0; d < nd; ++d) {
    if (red[d]) {
      p.dims.push_back(d);
      p.count *= in.global_shape()[d];
    } else {
      p.all = false;
    }
  }
  const DeviceMesh& mesh = in.mesh();
  Placements pl;
  ShardSizes sizes;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const Placement& q = in.placements()[m];
    if (is_shard(q)) {
      const int64_t d = shard_dim(q);
      if (red[d]) {
        p.mesh_dims.push_back(m);
        pl.push_back(Replicate{});
        sizes.push_back({});
      } else {
        int64_t before = 0;
        for (int64_t e = 0; e < d; ++e) before += red[e] ? 1 : 0;
        pl.push_back(Shard{keepdim ? d : d - before});
        sizes.push_back(in.shard_sizes(m));
      }
    } else {
      if (is_partial(q)) p.partial_dims.push_back(m);
      pl.push_back(q);
      sizes.push_back({});
    }
  }
  std::vector<int64_t> shape;
  p.kshape = in.local_shape();
  for (int64_t d = 0; d < nd; ++d) {
    if (red[d]) {
      p.kshape[d] = 1;
      if (keepdim) shape.push_back(1);
    } else {
      shape.push_back(in.global_shape()[d]);
    }
  }
  if (!p.all) p.out = make_spec(mesh, pl, shape, sizes);
  return p;
}

// Drops the reduced dims of a keepdim-shaped local result unless keepdim.
at::Tensor finish(const at::Tensor& t, const Plan& p) {
  if (p.keepdim) return t;
  at::Tensor r = t;
  for (auto it = p.dims.rbegin(); it != p.dims.rend(); ++it) r = r.squeeze(*it);
  return r;
}

c10::IValue result(const at::Tensor& local, const Plan& p) {
  return p.all ? c10::IValue(local) : c10::IValue(wrap(local, p.out));
}

// The input's local piece with every Partial mesh dim summed (collective on
// those dims; differentiable, backward identity).
at::Tensor resolved_local(const at::Tensor& x) {
  const ShardSpec& s = *spec_of(x);
  if (!s.has_partial()) return local_of(x);
  ShardSpec target = without_partial(s);
  return to_layout(x, target, target);
}

ShardSpec resolved_spec(const at::Tensor& x) { return without_partial(*spec_of(x)); }

// Runs the op unchanged on `local` (in place of the ShardTensor) and pushes its
// results laid out as the plan says.
void run_local(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
               const at::Tensor& local, const Plan& p, Stack* stack) {
  Stack s = std::move(args);
  s[0] = local;
  op.callBoxed(&s);
  for (auto& r : s) stack->push_back(r.isTensor() ? result(r.toTensor(), p) : r);
}

// Sum over mesh dims; differentiable (backward identity) for tensors that need a gradient.
at::Tensor sum_over(const at::Tensor& t, const DeviceMesh& mesh, const std::vector<int64_t>& dims) {
  if (dims.empty()) return t;
  if (needs_grad(t)) return comm::all_reduce(t, mesh, dims);
  return comm::all_reduce_nograd(t.contiguous(), mesh, dims, ReduceOp::Sum);
}

// True when this rank's piece has no element along some reduced dim (so
// at::amax and friends would throw): its partial result is the identity.
bool reduced_empty(const at::Tensor& local, const Plan& p) {
  for (int64_t d : p.dims) {
    if (local.size(d) == 0) return true;
  }
  return false;
}

// Element-wise max (or min) over mesh dims of a detached local partial result,
// propagating NaN as libtorch does (MPI's MAX is unspecified for NaN): NaN is
// replaced by the identity and a NaN flag travels in the same message.
at::Tensor global_extreme(const at::Tensor& v, bool is_max, const DeviceMesh& mesh,
                          const std::vector<int64_t>& dims) {
  if (!at::isFloatingType(v.scalar_type())) {
    return comm::all_reduce_nograd(v.contiguous(), mesh, dims,
                                   is_max ? ReduceOp::Max : ReduceOp::Min);
  }
  at::Tensor nan = v.isnan();
  at::Tensor w = (is_max ? v : -v).masked_fill(nan, -kInf);
  at::Tensor r = comm::all_reduce_nograd(at::stack({w, nan.to(w.scalar_type())}).contiguous(), mesh,
                                         dims, ReduceOp::Max);
  at::Tensor m = is_max ? r[0] : -r[0];
  return m.masked_fill(r[1] > 0, std::numeric_limits<double>::quiet_NaN());
}

// Where x equals its (broadcast) extreme m, NaN matching NaN.
at::Tensor equals_extreme(const at::Tensor& x, const at::Tensor& m) {
  return at::logical_or(x == m, at::logical_and(x.isnan(), m.isnan()));
}

std::optional<std::vector<int64_t>> opt_dims(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toIntVector();
}

c10::optional<at::ScalarType> opt_dtype(const c10::IValue& v) {
  if (v.isNone()) return c10::nullopt;
  return v.toScalarType();
}

void check_nonempty(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                    const ShardSpec& in, const Plan& p, const char* name) {
  if (in.numel() != 0) return;
  for (int64_t d : p.dims) {
    if (in.global_shape()[d] == 0) {
      fail(op, args,
           std::string(name) + "(): Expected reduction dim " + std::to_string(d) +
               " to have non-zero size");
    }
  }
  if (p.all) fail(op, args, std::string(name) + "(): cannot reduce a tensor with no elements");
}

// ---------------------------------------------------------------- sum, mean

// sum(self, *, dtype) / sum.dim_IntList(self, dim?, keepdim, *, dtype)
// nansum(self, dim?, keepdim, *, dtype)
// mean(self, *, dtype) / mean.dim(self, dim?, keepdim, *, dtype)
void sum_like(const c10::OperatorHandle& op, Stack* stack, bool mean, bool nan) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const bool dims_form = args.size() == 4;
  const auto dims = dims_form ? opt_dims(args[1]) : std::nullopt;
  const bool keepdim = dims_form ? args[2].toBool() : false;
  const auto dtype = opt_dtype(args.back());
  if (mean) {
    const at::ScalarType rt = dtype.value_or(x.scalar_type());
    if (!at::isFloatingType(rt) && !at::isComplexType(rt)) {
      fail(op, args,
           std::string("mean(): could not infer output dtype. Input dtype must be either a "
                       "floating point or complex dtype. Got: ") +
               c10::toString(rt));
    }
  }
  // sum and mean are linear: a Partial input gives a Partial result.
  // nansum is not (NaN in one summand), so it sums Partial first.
  const ShardSpec in = nan ? resolved_spec(x) : *spec_of(x);
  Plan p = make_plan(op, args, in, dims, keepdim);
  std::vector<int64_t> sync = p.mesh_dims;
  if (p.all) sync.insert(sync.end(), p.partial_dims.begin(), p.partial_dims.end());
  at::Tensor local = nan ? resolved_local(x) : local_of(x);
  if (sync.empty()) return run_local(op, std::move(args), local, p, stack);
  // Note [reduced precision]: float16/bfloat16 partial sums in float32, rounded
  // once (integer and bool inputs keep libtorch's promotion, to int64).
  const at::ScalarType out_type = dtype.value_or(x.scalar_type());
  const bool widen = is_reduced_float(out_type);
  const auto sum_type = widen ? c10::optional<at::ScalarType>(at::kFloat) : dtype;
  at::Tensor r =
      nan ? at::nansum(local, p.dims, true, sum_type) : at::sum(local, p.dims, true, sum_type);
  r = sum_over(r, in.mesh(), sync);
  if (mean) r = r / static_cast<double>(p.count);
  if (widen) r = r.to(out_type);
  stack->push_back(result(finish(r, p), p));
}

// ---------------------------------------------------------------- max, min

// amax/amin(self, dim=[], keepdim); max/min(self): the extreme over the dims;
// the gradient is shared evenly among the elements equal to it (ties), as in
// libtorch, with the tie count summed over the mesh.
//
// Note [selected gradient]: where a NaN or infinite gradient lands depends on
// how libtorch's backward builds it, and the carriers follow it. amax/amin
// (amax_backward) and max/min on CUDA (evenly_distribute_backward) multiply
// the gradient by the mask, so NaN * 0 = NaN reaches every element of the
// slice: carrier sum(x * w). max/min on CPU fill a zero tensor at the mask,
// and max.dim/min.dim scatter into zeros (value_selecting_reduction_backward),
// so only the selected elements get it: carrier sum(where(mask, x, 0)), whose
// backward is where(mask, grad, 0). Measured with a NaN cotangent on
// [[1, 5, inf], [2, nan, 0]]: max() gives NaN at the NaN only, amax() NaN
// everywhere, max(1).values NaN at (0, 2) and (1, 1) only.
void extreme_rule(const c10::OperatorHandle& op, Stack* stack, bool is_max) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const bool dims_form = args.size() == 3;
  const auto dims = dims_form ? std::optional(args[1].toIntVector()) : std::nullopt;
  const bool keepdim = dims_form ? args[2].toBool() : false;
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, dims, keepdim);
  const char* name = dims_form ? (is_max ? "amax" : "amin") : (is_max ? "max" : "min");
  if (!p.mesh_dims.empty()) check_nonempty(op, args, in, p, name);
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);

  const at::Tensor xd = local.detach();
  at::Tensor v = reduced_empty(xd, p)
                     ? at::full(p.kshape, extreme_identity(xd.scalar_type(), is_max), xd.options())
                     : (is_max ? xd.amax(p.dims, true) : xd.amin(p.dims, true));
  at::Tensor m = global_extreme(v, is_max, in.mesh(), p.mesh_dims);
  at::Tensor out = carry_grad(m, local, [&] {
    // libtorch: max() matches NaN with NaN (evenly_distribute_backward), amax
    // does not (its gradient is then NaN along that slice, here too).
    at::Tensor mask = dims_form ? xd == m : equals_extreme(xd, m);
    at::Tensor count =
        comm::all_reduce_nograd(mask.sum(p.dims, true), in.mesh(), p.mesh_dims, ReduceOp::Sum);
    // Note [selected gradient]: max/min on CPU only reach the mask.
    if (!dims_form && !local.is_cuda()) {
      return at::where(mask, local, at::zeros({}, local.options())).sum(p.dims, true) /
             count.to(xd.scalar_type());
    }
    at::Tensor w = mask.to(xd.scalar_type()) / count.to(xd.scalar_type());
    return (local * w).sum(p.dims, true);
  });
  stack->push_back(result(finish(out, p), p));
}

// The global index of the first extreme along sharded dim `d` (keepdim
// shape): the extreme is reduced first, then the smallest global index among
// the ranks that hold it (local max/min return the first occurrence on CPU).
std::pair<at::Tensor, at::Tensor> global_arg_extreme(const at::Tensor& xd, int64_t d,
                                                     int64_t offset, const Plan& p,
                                                     const DeviceMesh& mesh, bool is_max) {
  at::Tensor v, i;
  if (xd.size(d) > 0) {
    std::tie(v, i) = is_max ? at::max(xd, d, true) : at::min(xd, d, true);
    i = i + offset;
  } else {
    v = at::full(p.kshape, extreme_identity(xd.scalar_type(), is_max), xd.options());
    i = at::full(p.kshape, kNoIndex, xd.options().dtype(at::kLong));
  }
  at::Tensor m = global_extreme(v, is_max, mesh, p.mesh_dims);
  at::Tensor cand = at::where(equals_extreme(v, m), i, at::full({}, kNoIndex, i.options()));
  at::Tensor idx = comm::all_reduce_nograd(cand.contiguous(), mesh, p.mesh_dims, ReduceOp::Min);
  return {m, idx};
}

// max.dim/min.dim(self, dim, keepdim) -> (values, indices): global indices;
// the gradient goes to the selected element only.
void extreme_dim_rule(const c10::OperatorHandle& op, Stack* stack, bool is_max) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, std::vector<int64_t>{args[1].toInt()}, args[2].toBool());
  if (!p.mesh_dims.empty()) check_nonempty(op, args, in, p, is_max ? "max" : "min");
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);

  const int64_t d = p.dims[0];
  const int64_t offset = in.local_offsets()[d];
  const at::Tensor xd = local.detach();
  auto [m, idx] = global_arg_extreme(xd, d, offset, p, in.mesh(), is_max);
  at::Tensor values = carry_grad(m, local, [&] {
    std::vector<int64_t> shape(xd.dim(), 1);
    shape[d] = xd.size(d);
    at::Tensor pos = (at::arange(xd.size(d), idx.options()) + offset).view(shape);
    // Note [selected gradient]: the selected element only (not x * one_hot,
    // whose backward puts NaN * 0 = NaN on the rest of the slice).
    return at::where(pos == idx, local, at::zeros({}, local.options())).sum(d, true);
  });
  stack->push_back(result(finish(values, p), p));
  stack->push_back(result(finish(idx, p), p));
}

// argmax/argmin(self, dim?, keepdim): dim=None indexes the flattened global tensor.
void arg_extreme_rule(const c10::OperatorHandle& op, Stack* stack, bool is_max) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec in = resolved_spec(x);
  const bool flat = args[1].isNone();
  const bool keepdim = args[2].toBool();
  Plan p = make_plan(op, args, in,
                     flat ? std::nullopt : std::optional(std::vector<int64_t>{args[1].toInt()}),
                     keepdim);
  const char* name = is_max ? "argmax" : "argmin";
  if (!p.mesh_dims.empty()) check_nonempty(op, args, in, p, name);
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);

  const at::Tensor xd = local.detach();
  if (!flat) {
    const int64_t d = p.dims[0];
    at::Tensor idx = global_arg_extreme(xd, d, in.local_offsets()[d], p, in.mesh(), is_max).second;
    stack->push_back(result(finish(idx, p), p));
    return;
  }
  // Flattened: the local first extreme, its index converted to the global
  // flat index (row-major order is preserved within a piece, so the smallest
  // global index among the ranks holding the extreme is the first one).
  at::Tensor v, gi;
  if (xd.numel() > 0) {
    at::Tensor li;
    std::tie(v, li) =
        is_max ? at::max(xd.reshape({-1}), 0, true) : at::min(xd.reshape({-1}), 0, true);
    const auto offs = in.local_offsets();
    gi = at::zeros_like(li);
    int64_t gstride = 1;
    for (int64_t e = xd.dim() - 1; e >= 0; --e) {
      gi = gi + (li.remainder(xd.size(e)) + offs[e]) * gstride;
      li = li.div(xd.size(e), "floor");
      gstride *= in.global_shape()[e];
    }
  } else {
    v = at::full({1}, extreme_identity(xd.scalar_type(), is_max), xd.options());
    gi = at::full({1}, kNoIndex, xd.options().dtype(at::kLong));
  }
  at::Tensor m = global_extreme(v, is_max, in.mesh(), p.mesh_dims);
  at::Tensor cand = at::where(equals_extreme(v, m), gi, at::full({}, kNoIndex, gi.options()));
  at::Tensor idx =
      comm::all_reduce_nograd(cand.contiguous(), in.mesh(), p.mesh_dims, ReduceOp::Min);
  std::vector<int64_t> shape(keepdim ? in.ndim() : 0, 1);
  stack->push_back(idx.reshape(shape));
}

// ---------------------------------------------------------------- prod

// prod(self, *, dtype) / prod.dim_int(self, dim, keepdim, *, dtype).
// Note [prod order]: the partial products of the ranks are all-gathered and
// multiplied in mesh-coordinate order, so the value is bitwise identical on
// every rank; the gradient comes from autograd through at::prod (which
// handles zeros) and all_gather (backward: this rank's slice).
void prod_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const bool dim_form = args.size() == 4;
  const auto dtype = opt_dtype(args.back());
  check_dtype_support(op, args, "prod", {dtype.value_or(x.scalar_type())}, needs_grad(x),
                      [](c10::ArrayRef<at::ScalarType> t, bool rg) {
                        return at::prod(probe_ones({2, 3}, t[0], rg), 1);
                      });
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in,
                     dim_form ? std::optional(std::vector<int64_t>{args[1].toInt()}) : std::nullopt,
                     dim_form ? args[2].toBool() : false);
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);

  at::Tensor r =
      dim_form ? at::prod(local, p.dims[0], true, dtype) : at::prod(local, dtype).reshape(p.kshape);
  const DeviceMesh& mesh = in.mesh();
  for (int64_t m : p.mesh_dims) {
    const int64_t d = shard_dim(in.placements()[m]);
    at::Tensor g =
        comm::all_gather(r.contiguous(), mesh, m, d, std::vector<int64_t>(mesh.size(m), 1));
    r = at::prod(g, d, true);
  }
  stack->push_back(result(finish(r, p), p));
}

// ---------------------------------------------------------------- var, std

// var/std/var_mean/std_mean.correction(self, dim?, *, correction?, keepdim).
// Note [variance]: two passes. (1) the global mean from an all-reduced sum;
// (2) the all-reduced sums of the deviations d = x - mean and of d^2, from
// which M2 = sum d^2 - (sum d)^2 / N (the corrected two-pass algorithm: exact
// even when the float mean is rounded; never E[x^2] - E[x]^2). The mean used
// in (2) is detached: d var / d mean = -2 sum(x - mean) / (N - c) = 0, and
// libtorch's var_backward, 2 (x - mean) / (N - c), omits that term too, so no
// use_replicated (backward all-reduce) is needed for it. std attaches its
// gradient as grad / (2 std), zero where std == 0, like libtorch's std_backward.
// The same rule serves unsharded reductions (with no communication): its
// gradient is more accurate than libtorch's own when |mean| >> std (libtorch
// subtracts a rounded float mean), and results must not depend on the layout.
void var_rule(const c10::OperatorHandle& op, Stack* stack, bool is_std, bool with_mean) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const auto dims = opt_dims(args[1]);
  const int64_t correction = args[2].isNone() ? 1 : args[2].toInt();
  const bool keepdim = args[3].toBool();
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, dims, keepdim);
  const bool complex = at::isComplexType(x.scalar_type());
  if (!at::isFloatingType(x.scalar_type()) && !(complex && p.mesh_dims.empty())) {
    fail(op, args,
         complex ? "complex inputs are supported by the var/std rule only when no reduced dim "
                   "is sharded"
                 : "std and var only support floating point and complex dtypes");
  }
  at::Tensor local = resolved_local(x);
  // Note [variance]: unsharded reductions use the same two-pass rule (no
  // communication then), so the result does not depend on the layout.
  if (complex) return run_local(op, std::move(args), local, p, stack);
  // Note [reduced precision]: float16/bfloat16 in float32, rounded once at the end.
  const at::ScalarType out_type = local.scalar_type();
  local = local.to(acc_dtype(out_type));

  const DeviceMesh& mesh = in.mesh();
  const double n = static_cast<double>(p.count);
  at::Tensor mean = sum_over(local.sum(p.dims, true), mesh, p.mesh_dims) / n;
  at::Tensor dev = local - mean.detach();
  at::Tensor sums = sum_over(at::stack({(dev * dev).sum(p.dims, true), dev.sum(p.dims, true)}),
                             mesh, p.mesh_dims);
  // The correction term's gradient, -2 sum(d) / n per element, is ~0 and
  // only mends a rounded mean; where sum(d) is not finite (Inf/NaN inputs) it
  // would put NaN on every element of the slice, where libtorch's
  // var_backward, 2 (x - mean) / (N - c), has +-Inf or a NaN at the
  // non-finite inputs only (Note [variance]). There it passes no gradient.
  const at::Tensor s1 = sums[1];
  const at::Tensor s1g = at::where(at::isfinite(s1.detach()), s1, s1.detach());
  at::Tensor m2 = sums[0] - s1g * s1g / n;
  at::Tensor var = m2 / std::max(n - static_cast<double>(correction), 0.0);
  at::Tensor out = var;
  if (is_std) {
    at::Tensor sd = var.detach().sqrt();
    out = carry_grad(sd, var, [&] { return masked_root(var, 2); });
  }
  stack->push_back(result(finish(out.to(out_type), p), p));
  if (with_mean) stack->push_back(result(finish(mean.to(out_type), p), p));
}

// ---------------------------------------------------------------- norms

// norm.Scalar(self, p=2), norm.ScalarOpt_dim(self, p?, dim, keepdim),
// norm.ScalarOpt_dim_dtype(self, p?, dim, keepdim, *, dtype),
// norm.ScalarOpt_dtype(self, p?, *, dtype),
// linalg_vector_norm(self, ord=2, dim?, keepdim, *, dtype?).
// The value from all-reduced sums of |x|^p (max/min of |x| for +-inf, count
// of non-zeros for 0); the gradient as in libtorch's norm_backward
// (Note [gradient carriers]).
void norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const std::string& ov = op.schema().overload_name();
  const bool linalg = op.schema().name() == "aten::linalg_vector_norm";
  const double ord = args[1].isNone() ? 2.0 : args[1].toScalar().toDouble();
  std::optional<std::vector<int64_t>> dims;
  bool keepdim = false;
  c10::optional<at::ScalarType> dtype;
  if (linalg) {
    dims = opt_dims(args[2]);
    keepdim = args[3].toBool();
    dtype = opt_dtype(args[4]);
  } else if (ov == "ScalarOpt_dim" || ov == "ScalarOpt_dim_dtype") {
    dims = args[2].toIntVector();
    keepdim = args[3].toBool();
    if (ov == "ScalarOpt_dim_dtype") dtype = args[4].toScalarType();
  } else if (ov == "ScalarOpt_dtype") {
    dtype = args[2].toScalarType();
  }
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, dims, keepdim);
  const at::ScalarType ct = dtype.value_or(x.scalar_type());
  if (!at::isFloatingType(x.scalar_type()) || !at::isFloatingType(ct)) {
    fail(op, args,
         at::isComplexType(x.scalar_type()) || at::isComplexType(ct)
             ? "complex inputs are not supported by the sharded norm rule"
             : "norm(): input dtype should be either floating point or complex");
  }
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);

  const DeviceMesh& mesh = in.mesh();
  const at::Tensor xc = local.to(ct);  // differentiable cast (no copy if same dtype)
  // Note [reduced precision]: float16/bfloat16 sums in float32, rounded once at the end.
  const at::ScalarType acc = acc_dtype(ct);
  const at::Tensor xd = xc.detach().to(acc);
  const at::Tensor a = xd.abs();
  at::Tensor nrm;
  // For 0 < ord < inf with a gradient: the global sum of |x|^ord taken
  // differentiably, so that the carrier is exact (Note [gradient carriers]).
  at::Tensor psum;
  if (ord > 0 && !std::isinf(ord) && ord != 1 && needs_grad(local)) {
    const at::Tensor nz = xd != 0;
    const at::Tensor xa = xc.to(acc);  // differentiable; float32 sums for float16/bfloat16
    const at::Tensor ap =
        ord == 2 ? xa * xa
                 : at::where(nz, at::where(nz, xa.abs(), at::ones_like(xa)).pow(ord), xa * 0);
    psum = sum_over(ap.sum(p.dims, true), mesh, p.mesh_dims);
    nrm = ord == 2 ? psum.detach().sqrt() : psum.detach().pow(1.0 / ord);
  } else if (std::isinf(ord)) {
    const bool is_max = ord > 0;
    at::Tensor v = reduced_empty(xd, p) ? at::full(p.kshape, is_max ? 0.0 : kInf, xd.options())
                                        : (is_max ? a.amax(p.dims, true) : a.amin(p.dims, true));
    nrm = global_extreme(v, is_max, mesh, p.mesh_dims);
  } else if (ord == 0) {
    nrm = sum_over((xd != 0).sum(p.dims, true).to(acc), mesh, p.mesh_dims);
  } else if (ord == 1) {
    nrm = sum_over(a.sum(p.dims, true), mesh, p.mesh_dims);
  } else if (ord == 2) {
    nrm = sum_over((xd * xd).sum(p.dims, true), mesh, p.mesh_dims).sqrt();
  } else {
    nrm = sum_over(a.pow(ord).sum(p.dims, true), mesh, p.mesh_dims).pow(1.0 / ord);
  }
  at::Tensor out = carry_grad(
      nrm, local,
      [&] {
        if (psum.defined()) return masked_root(psum, ord);  // 0 < ord < inf, ord != 1
        at::Tensor w;  // ord 0, 1, +-inf or negative: constant weights
        if (ord == 0) {
          w = at::zeros_like(xd);
        } else if (ord == 1) {
          w = xd.sgn();
        } else if (std::isinf(ord)) {
          at::Tensor mask = at::logical_or(a == nrm, a.isnan());
          at::Tensor count =
              comm::all_reduce_nograd(mask.sum(p.dims, true), mesh, p.mesh_dims, ReduceOp::Sum);
          w = xd.sgn() * mask.to(acc) / count.to(acc);
        } else {
          w = (xd.sgn() * a.pow(ord - 1)).masked_fill(xd == 0, 0) * nrm.pow(1 - ord);
        }
        return (xc * w).sum(p.dims, true);
      },
      ord < 0 ? "norm of negative order" : "", /*none=*/ord == 0);
  stack->push_back(result(finish(out.to(ct), p), p));
}

// ---------------------------------------------------------------- logic, counts

// all/any(self), all.dim/any.dim(self, dim, keepdim).
void all_any_rule(const c10::OperatorHandle& op, Stack* stack, bool is_all) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const bool dim_form = args.size() == 3;
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in,
                     dim_form ? std::optional(std::vector<int64_t>{args[1].toInt()}) : std::nullopt,
                     dim_form ? args[2].toBool() : false);
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);
  at::Tensor r = dim_form ? (is_all ? local.all(p.dims[0], true) : local.any(p.dims[0], true))
                          : (is_all ? local.all() : local.any()).reshape(p.kshape);
  r = comm::all_reduce_nograd(r.contiguous(), in.mesh(), p.mesh_dims,
                              is_all ? ReduceOp::Min : ReduceOp::Max);
  stack->push_back(result(finish(r, p), p));
}

// count_nonzero(self, dim?) / count_nonzero.dim_IntList(self, dim).
void count_nonzero_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  std::optional<std::vector<int64_t>> dims;
  if (args[1].isInt()) {
    dims = std::vector<int64_t>{args[1].toInt()};
  } else if (!args[1].isNone()) {
    dims = args[1].toIntVector();
  }
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, dims, false);
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);
  at::Tensor r = (local != 0).sum(p.dims, true, at::kLong);
  r = comm::all_reduce_nograd(r.contiguous(), in.mesh(), p.mesh_dims, ReduceOp::Sum);
  stack->push_back(result(finish(r, p), p));
}

// logsumexp(self, dim, keepdim): max first (global; of the real parts for
// complex values), then the all-reduced sum of exp(x - max); autograd gives
// exp(x - result), libtorch's gradient.
void logsumexp_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const auto dims = args[1].toIntVector();
  if (dims.empty()) fail(op, args, "logsumexp(): expected at least one dim to reduce");
  check_dtype_support(op, args, "logsumexp", {x.scalar_type()}, needs_grad(x),
                      [](c10::ArrayRef<at::ScalarType> t, bool rg) {
                        return at::logsumexp(probe_ones({2, 3}, t[0], rg), {1});
                      });
  const ShardSpec in = resolved_spec(x);
  Plan p = make_plan(op, args, in, dims, args[2].toBool());
  at::Tensor local = resolved_local(x);
  if (p.mesh_dims.empty()) return run_local(op, std::move(args), local, p, stack);
  if (at::isIntegralType(local.scalar_type(), /*includeBool=*/true)) {
    local = local.to(c10::typeMetaToScalarType(at::get_default_dtype()));
  }
  // Note [reduced precision]: float16/bfloat16 in float32, rounded once at the end.
  const at::ScalarType out_type = local.scalar_type();
  local = local.to(acc_dtype(out_type));
  // Complex values: the max of the real parts, as libtorch does (amax has no
  // complex kernel: it raised on the ranks holding data only).
  const at::Tensor xd = local.is_complex() ? at::real(local.detach()) : local.detach();
  at::Tensor v =
      reduced_empty(xd, p) ? at::full(p.kshape, -kInf, xd.options()) : xd.amax(p.dims, true);
  at::Tensor m = global_extreme(v, true, in.mesh(), p.mesh_dims);
  m = m.masked_fill(m.abs() == kInf, 0);
  at::Tensor s = comm::all_reduce((local - m).exp().sum(p.dims, true), in.mesh(), p.mesh_dims);
  stack->push_back(result(finish((s.log() + m).to(out_type), p), p));
}

// _local_scalar_dense(self) (what item() reaches): gathered to every rank first.
void local_scalar_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec& s = *spec_of(x);
  if (s.numel() != 1) {
    fail(op, args,
         "a Tensor with " + std::to_string(s.numel()) + " elements cannot be converted to Scalar");
  }
  at::Tensor local = local_of(x).detach();
  if (!s.is_replicated()) {
    ShardSpec rep(s.mesh(), Placements(s.mesh().ndim(), Replicate{}), s.global_shape());
    local = detail::redistribute_local(local, s, rep);
  }
  Stack st{local};
  op.callBoxed(&st);
  stack->push_back(std::move(st[0]));
}

// ---------------------------------------------------------------- registration

// Note [overload routing]: the rule table matches a base name against every
// overload, and several handled overloads are the unnamed default one (there
// is no way to register "sum" alone). So these ops are registered by base
// name and routed here by overload; any other overload behaves as the
// dispatcher would without a rule: a CompositeImplicitAutograd overload
// (max.other, sum.dim_DimnameList...) runs its decomposition, anything else
// (out= variants) fails naming the op.
using Handler = std::function<void(const c10::OperatorHandle&, Stack*)>;

void route(const std::unordered_map<std::string, Handler>& handlers, const c10::OperatorHandle& op,
           Stack* stack) {
  auto it = handlers.find(op.operator_name().overload_name);
  if (it != handlers.end()) return it->second(op, stack);
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
    return;
  }
  auto args = pop_args(op, stack);
  fail(op, args, "no sharding rule for this overload");
}

Rule routed(std::unordered_map<std::string, Handler> handlers) {
  return [h = std::move(handlers)](const c10::OperatorHandle& op, Stack* stack) {
    route(h, op, stack);
  };
}

Handler bind_sum(bool mean, bool nan) {
  return [=](const c10::OperatorHandle& op, Stack* s) { sum_like(op, s, mean, nan); };
}
template <void (*F)(const c10::OperatorHandle&, Stack*, bool)>
Handler bind(bool flag) {
  return [=](const c10::OperatorHandle& op, Stack* s) { F(op, s, flag); };
}
Handler bind_var(bool is_std, bool with_mean) {
  return [=](const c10::OperatorHandle& op, Stack* s) { var_rule(op, s, is_std, with_mean); };
}

const RuleRegistrar r_sum({"sum"}, routed({{"", bind_sum(false, false)},
                                           {"dim_IntList", bind_sum(false, false)}}));
const RuleRegistrar r_nansum({"nansum"}, routed({{"", bind_sum(false, true)}}));
const RuleRegistrar r_mean({"mean"},
                           routed({{"", bind_sum(true, false)}, {"dim", bind_sum(true, false)}}));
const RuleRegistrar r_amax({"amax"}, routed({{"", bind<extreme_rule>(true)}}));
const RuleRegistrar r_amin({"amin"}, routed({{"", bind<extreme_rule>(false)}}));
const RuleRegistrar r_max({"max"}, routed({{"", bind<extreme_rule>(true)},
                                           {"dim", bind<extreme_dim_rule>(true)}}));
const RuleRegistrar r_min({"min"}, routed({{"", bind<extreme_rule>(false)},
                                           {"dim", bind<extreme_dim_rule>(false)}}));
const RuleRegistrar r_argmax({"argmax"}, routed({{"", bind<arg_extreme_rule>(true)}}));
const RuleRegistrar r_argmin({"argmin"}, routed({{"", bind<arg_extreme_rule>(false)}}));
const RuleRegistrar r_prod({"prod"}, routed({{"", prod_rule}, {"dim_int", prod_rule}}));
const RuleRegistrar r_var({"var.correction"}, bind_var(false, false));
const RuleRegistrar r_std({"std.correction"}, bind_var(true, false));
const RuleRegistrar r_var_mean({"var_mean.correction"}, bind_var(false, true));
const RuleRegistrar r_std_mean({"std_mean.correction"}, bind_var(true, true));
const RuleRegistrar r_norm({"norm.Scalar", "norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype",
                            "norm.ScalarOpt_dtype"},
                           norm_rule);
const RuleRegistrar r_vnorm({"linalg_vector_norm"}, routed({{"", norm_rule}}));
const RuleRegistrar r_all({"all"}, routed({{"", bind<all_any_rule>(true)},
                                           {"dim", bind<all_any_rule>(true)}}));
const RuleRegistrar r_any({"any"}, routed({{"", bind<all_any_rule>(false)},
                                           {"dim", bind<all_any_rule>(false)}}));
const RuleRegistrar r_count({"count_nonzero"}, routed({{"", count_nonzero_rule},
                                                       {"dim_IntList", count_nonzero_rule}}));
const RuleRegistrar r_lse({"logsumexp"}, routed({{"", logsumexp_rule}}));
const RuleRegistrar r_item({"_local_scalar_dense"}, routed({{"", local_scalar_rule}}));

}  // namespace
}  // namespace shardtensor::ops
