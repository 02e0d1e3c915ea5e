// softmax and log_softmax over a sharded or an unsharded dim.
//
// torch::softmax / F::softmax reach the dispatcher as aten::softmax.int
// (CompositeImplicitAutograd, caught whole), and code below autograd may call
// aten::_softmax / aten::_log_softmax directly; all four are handled here.
//
// Note [sharded softmax]: over an unsharded dim the op runs unchanged on the
// local piece (libtorch's numerics). Over a sharded dim, SoftmaxFn computes
//   m = global max along the dim (all-reduce MAX, detached),
//   s = global sum of exp(x - m) (all-reduce SUM),
//   softmax = exp(x - m) / s,   log_softmax = x - m - log(s),
// which never overflows (every exponent is <= 0). It saves only its output,
// as libtorch's kernels do, and its backward all-reduces one statistic:
//   softmax:     dx = y * (dy - sum(dy * y)),
//   log_softmax: dx = dy - exp(y) * sum(dy),
// with the sums taken over the whole (global) dim. Under create_graph
// (double backward) the same closed form is evaluated with the differentiable
// sum use_replicated(all_reduce(.)) instead of all_reduce_nograd: it is the
// exact vector-Jacobian product as a function of (y, dy), and y's own
// gradient flows back through this Function's backward, so gradients of any
// order are exact (Note [differentiable adjoints]).
#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>

#include "comm/function_output.h"
#include "ops/common.h"
#include "ops/saved_mesh.h"

namespace shardtensor::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor sum_dim(const at::Tensor& t, int64_t dim, const DeviceMesh& mesh, int64_t mesh_dim) {
  return comm::all_reduce_nograd(t.sum(dim, true).contiguous(), mesh, {mesh_dim}, ReduceOp::Sum);
}

// The global sum along `dim`, differentiable: the sum is replicated and then
// used by every rank's own rows (Note [replicated gradients]).
at::Tensor sum_dim_differentiable(const at::Tensor& t, int64_t dim, const DeviceMesh& mesh,
                                  int64_t mesh_dim) {
  at::Tensor s = comm::all_reduce(t.sum(dim, true).contiguous(), mesh, {mesh_dim});
  return comm::use_replicated(s, mesh, {mesh_dim});
}

// Note [sharded softmax]. Collective over `mesh_dim`, forward and backward.
// Hand-written: the global max (all_reduce_nograd Max) has no useful gradient, and the closed
// form y * (dy - sum(dy * y)) needs one all-reduced sum (a comm/ primitive).
struct SoftmaxFn : torch::autograd::Function<SoftmaxFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, int64_t dim,
                            const DeviceMesh& mesh, int64_t mesh_dim, bool log) {
    // Note [reduced precision]: float16/bfloat16 in float32, rounded once at the end.
    const at::Tensor x = x_in.to(acc_dtype(x_in.scalar_type()));
    at::Tensor m;
    if (x.size(dim) == 0) {
      auto shape = x.sizes().vec();
      shape[dim] = 1;
      m = at::full(shape, -std::numeric_limits<double>::infinity(), x.options());
    } else {
      m = x.amax(dim, true);
    }
    m = comm::all_reduce_nograd(m.contiguous(), mesh, {mesh_dim}, ReduceOp::Max);
    // A row of only -inf: subtract 0 (libtorch's NaN row follows from 0 / 0). A
    // +inf anywhere in the row stays: inf - inf = NaN reaches the all-reduced
    // sum, so the whole row is NaN on every rank, as in libtorch.
    m.masked_fill_(m.isneginf(), 0);
    at::Tensor y = x - m;
    at::Tensor s = sum_dim(y.exp(), dim, mesh, mesh_dim);
    if (log) {
      y.sub_(s.log());
    } else {
      y.exp_().div_(s);
    }
    // Saved as returned (rounded, as libtorch's kernels save their output).
    // The saved tensor is the returned one (Note [function outputs are not views]).
    y = comm::function_output(y.to(x_in.scalar_type()), {x_in});
    ctx->save_for_backward({y});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["mesh_dim"] = mesh_dim;
    ctx->saved_data["log"] = log;
    save_mesh(ctx, mesh);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("SoftmaxFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    const at::Tensor saved = ctx->get_saved_variables()[0];
    const at::ScalarType acc = acc_dtype(saved.scalar_type());
    const at::Tensor y = saved.to(acc);
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    const int64_t mesh_dim = ctx->saved_data.at("mesh_dim").toInt();
    const DeviceMesh& mesh = saved_mesh(ctx);
    at::Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros_like(y);
    dy = dy.to(acc);
    // Under create_graph the sums must be differentiable (Note [sharded softmax]).
    auto sum = at::GradMode::is_enabled() ? sum_dim_differentiable : sum_dim;
    at::Tensor dx;
    if (ctx->saved_data.at("log").toBool()) {
      dx = dy - y.exp() * sum(dy, dim, mesh, mesh_dim);
    } else {
      dx = y * (dy - sum(dy * y, dim, mesh, mesh_dim));
    }
    return {dx.to(saved.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// softmax.int / log_softmax.int (self, dim, dtype?) and
// _softmax / _log_softmax (self, dim, half_to_float).
void softmax_rule(const c10::OperatorHandle& op, Stack* stack, bool log) {
  const std::string& ov = op.operator_name().overload_name;
  if (ov != "" && ov != "int") {
    // Other overloads (Dimname) decompose into these; out= variants have no rule.
    if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
      return;
    }
    auto args = pop_args(op, stack);
    fail(op, args, "no sharding rule for this overload");
  }
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  if (!spec_of(x)) fail(op, args, "the input must be the ShardTensor");
  {
    // Note [reduced precision]: libtorch's verdict on the dtype computed in.
    const at::ScalarType dt =
        ov == "int" && !args[2].isNone() ? args[2].toScalarType() : x.scalar_type();
    check_dtype_support(op, args, log ? "log_softmax" : "softmax", {dt}, will_backward(x),
                        [log](c10::ArrayRef<at::ScalarType> t, bool rg) {
                          at::Tensor p = probe_ones({2, 3}, t[0], rg);
                          return log ? at::log_softmax(p, 1) : at::softmax(p, 1);
                        });
  }
  auto spec = std::make_shared<const ShardSpec>(without_partial(*spec_of(x)));
  at::Tensor local = to_layout(x, *spec, *spec);
  int64_t dim = 0;
  try {
    dim = c10::maybe_wrap_dim(args[1].toInt(), spec->ndim());
  } catch (const c10::Error& e) {
    fail(op, args, e.what_without_backtrace());
  }
  if (ov == "int" && !args[2].isNone()) local = local.to(args[2].toScalarType());
  if (!at::isFloatingType(local.scalar_type())) {
    fail(op, args,
         std::string(log ? "log_softmax" : "softmax") +
             " expects a floating point input (or a floating dtype=), got " +
             c10::toString(local.scalar_type()));
  }
  const int64_t mesh_dim = spec->ndim() == 0 ? -1 : spec->mesh_dim_of(dim);
  at::Tensor y;
  if (mesh_dim < 0) {
    y = log ? at::log_softmax(local, dim) : at::softmax(local, dim);
  } else {
    y = SoftmaxFn::apply(local, dim, spec->mesh(), mesh_dim, log);
  }
  stack->push_back(wrap(y, spec));
}

const RuleRegistrar r_softmax({"softmax", "_softmax"}, [](const c10::OperatorHandle& op, Stack* s) {
  softmax_rule(op, s, false);
});
const RuleRegistrar r_log_softmax({"log_softmax", "_log_softmax"},
                                  [](const c10::OperatorHandle& op, Stack* s) {
                                    softmax_rule(op, s, true);
                                  });

}  // namespace
}  // namespace shardtensor::ops
