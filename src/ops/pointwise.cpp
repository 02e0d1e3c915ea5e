// Elementwise ops: unary, binary, ternary, in-place and out= variants,
// activations, comparisons, conversions and *_like factories.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

// Note [pointwise layout]: the result takes the layout of the first ShardTensor
// operand that is sharded and spans every one of its sharded dims at the full
// result extent (the "reference"). Every other operand, plain or sharded, is
// brought to the matching layout (operand_spec), so plain tensors that span a
// sharded dim are sliced, broadcast ones are used whole, and ShardTensors in a
// different layout are redistributed. Partial operands are summed first.
void pointwise_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const auto& schema = op.schema();
  const DeviceMesh mesh = common_mesh(op, args);

  // Operands: every tensor argument that is not an out= buffer.
  std::vector<size_t> operand_idx, out_idx;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!args[i].isTensor()) {
      if (args[i].isTensorList() ||
          (args[i].isList() && !args[i].toListRef().empty() && args[i].toListRef()[0].isTensor())) {
        fail(op, args, "tensor-list arguments are not supported by the elementwise rule");
      }
      continue;
    }
    const bool written = is_written(schema.arguments()[i]);
    const bool kwarg_out = written && schema.arguments()[i].kwarg_only();
    (kwarg_out ? out_idx : operand_idx).push_back(i);
  }

  // Result shape: broadcast of the operands' global shapes.
  std::vector<int64_t> shape;
  for (size_t i : operand_idx) {
    shape = at::infer_size(shape, args[i].toTensor().sizes());
  }

  // Reference layout.
  SpecPtr out_spec;
  for (size_t i : operand_idx) {
    const ShardSpec* s = spec_of(args[i].toTensor());
    if (!s || !s->is_sharded()) continue;
    const int64_t lead = static_cast<int64_t>(shape.size()) - s->ndim();
    bool spans = true;
    for (int64_t d = 0; d < s->ndim(); ++d) {
      if (s->mesh_dim_of(d) >= 0 && s->global_shape()[d] != shape[d + lead]) spans = false;
    }
    if (!spans) continue;
    Placements p;
    ShardSizes sizes;
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      const auto& pl = s->placements()[m];
      if (is_shard(pl)) {
        p.push_back(Shard{shard_dim(pl) + lead});
        sizes.push_back(s->shard_sizes(m));
      } else {
        p.push_back(Replicate{});
        sizes.push_back({});
      }
    }
    out_spec = make_spec(mesh, p, shape, sizes);
    break;
  }
  if (!out_spec) {
    out_spec = make_spec(mesh, Placements(mesh.ndim(), Replicate{}), shape);
  }

  // In-place targets must already have the result layout.
  std::vector<c10::IValue> local_args = args;
  for (size_t i : operand_idx) {
    const at::Tensor& t = args[i].toTensor();
    if (is_written(schema.arguments()[i])) {
      const ShardSpec* s = spec_of(t);
      if (!s) fail(op, args, "an in-place op on a plain tensor cannot take a ShardTensor operand");
      if (*s != *out_spec) {
        fail(op, args,
             "the in-place target's layout " + s->to_string() + " differs from the result's " +
                 out_spec->to_string());
      }
      local_args[i] = local_of(t);
    } else {
      local_args[i] = to_layout(t, operand_spec(*out_spec, t.sizes()), *out_spec);
    }
  }
  for (size_t i : out_idx) {
    const at::Tensor& t = args[i].toTensor();
    const ShardSpec* s = spec_of(t);
    if (!s) fail(op, args, "the out= tensor must be a ShardTensor when an input is one");
    if (s->global_shape() != shape || *s != *out_spec) {
      fail(op, args,
           "the out= tensor's layout " + s->to_string() + " differs from the result's " +
               out_spec->to_string());
    }
    local_args[i] = local_of(t);
  }

  Stack results = std::move(local_args);
  op.callBoxed(&results);
  push_results(op, args, &results, out_spec, stack);
  // A view op (alias, detach, real, imag, _conj, ...) whose operand had to be
  // brought to the result's layout (a Partial operand is summed) returns a
  // copy: in-place ops on it must raise, not be lost (Note [view write-back]).
  if (returns_view(schema)) {
    const ShardSpec* s0 = args[0].isTensor() ? spec_of(args[0].toTensor()) : nullptr;
    if (s0 && *s0 != *out_spec) {
      for (size_t j = stack->size() - schema.returns().size(); j < stack->size(); ++j) {
        refuse_in_place((*stack)[j], c10::toString(op.operator_name()) +
                                         " of a ShardTensor laid out as " + s0->to_string() +
                                         " returned a copy laid out as " + out_spec->to_string() +
                                         ", not a view");
      }
    }
  }
}

// Single-input ops whose result has the input's layout, with Partial resolved:
// *_like factories (a fresh tensor per piece).
void like_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  if (!s) fail(op, args, "the first argument must be the ShardTensor");
  auto spec = std::make_shared<const ShardSpec>(without_partial(*s));
  std::vector<c10::IValue> local_args = args;
  local_args[0] = local_of(x).detach();
  if (s->has_partial()) {
    // the values are not used by *_like, only the shape
    local_args[0] = at::empty(spec->local_shape(), local_of(x).options());
  }
  Stack results = std::move(local_args);
  op.callBoxed(&results);
  push_results(op, args, &results, spec, stack);
}

const RuleRegistrar pointwise_ops(
    {// arithmetic
     "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "rsub", "neg", "neg_", "abs",
     "abs_", "pow", "pow_", "float_power", "sqrt", "sqrt_", "rsqrt", "rsqrt_", "exp", "exp_",
     "exp2", "expm1", "log", "log_", "log2", "log10", "log1p", "reciprocal", "reciprocal_",
     "square", "sign", "sgn", "floor", "floor_", "ceil", "ceil_", "round", "round_", "trunc",
     "trunc_", "frac", "remainder", "remainder_", "fmod", "fmod_", "maximum", "minimum", "fmax",
     "fmin", "atan2", "atan2_", "hypot", "lerp", "lerp_", "addcmul", "addcmul_", "addcdiv",
     "addcdiv_", "xlogy", "copysign", "nan_to_num", "nan_to_num_", "true_divide", "floor_divide",
     "erf", "erfc", "erfinv", "lgamma", "digamma",
     // trigonometric
     "sin", "sin_", "cos", "cos_", "tan", "tan_", "asin", "acos", "atan", "sinh", "cosh", "tanh",
     "tanh_", "asinh", "acosh", "atanh",
     // activations
     "relu", "relu_", "relu6", "gelu", "gelu_", "silu", "silu_", "sigmoid", "sigmoid_",
     "leaky_relu", "leaky_relu_", "elu", "elu_", "selu", "selu_", "celu", "celu_", "softplus",
     "mish", "mish_", "hardtanh", "hardtanh_", "hardsigmoid", "hardsigmoid_", "hardswish",
     "hardswish_", "logsigmoid", "log_sigmoid", "softshrink", "hardshrink", "threshold",
     "threshold_", "rrelu",
     // clamping, selection, comparison, logic
     "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "clip", "clip_",
     "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar", "where.self_out",
     "masked_fill", "masked_fill_", "eq", "eq_", "ne", "ne_", "lt", "lt_", "le", "le_", "gt", "gt_",
     "ge", "ge_", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "logical_and",
     "logical_and_", "logical_or", "logical_or_", "logical_not", "logical_not_", "logical_xor",
     "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "signbit", "heaviside",
     // in-place fills; exponential_ and random_ draw per rank (uniform_, normal_,
     // bernoulli, dropout, rand_like, randn_like: ops/random.cpp)
     "fill_", "zero_", "exponential_", "random_",
     // conversions
     "_to_copy", "clone", "detach", "detach_", "contiguous", "alias", "copy_", "lift_fresh",
     "resolve_conj", "resolve_neg", "positive", "_conj", "conj_physical", "real", "imag"},
    pointwise_rule);

const RuleRegistrar like_ops({"empty_like", "zeros_like", "ones_like", "full_like", "randint_like"},
                             like_rule);

}  // namespace
}  // namespace shardtensor::ops
