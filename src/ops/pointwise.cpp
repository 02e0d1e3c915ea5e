// Elementwise ops: unary, binary, ternary, in-place and out= variants,
// activations, comparisons, conversions and *_like factories.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

// Note [pointwise layout]: the result takes the layout of the first ShardTensor
// operand that is sharded and spans every one of its sharded dims at the full
// result extent (the "reference"). Every other operand, plain or sharded, is
// brought to the matching layout (operand_spec), so plain tensors that span a
// sharded dim are sliced, broadcast ones are used whole, and ShardTensors in a
// different layout are redistributed. Partial operands are summed first, except
// for the ops that are linear in them (Note [pending partial sums]).
//
// Note [pending partial sums]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Partial placement on mesh dim m is a pending sum: the value is the sum of
// the pieces of m's coordinates. Summing costs an all-reduce, so it is paid
// once, where a consumer needs the value, not where the Partial is made (as
// DTensor does). Producers: the sharded contraction of the matmul family and
// einsum (ops/linear.cpp, ops/einsum.cpp), sum/mean over some dims
// (ops/reductions.cpp), the multi-index of ops/index_ops.cpp. A map that is
// linear in its Partial operand keeps the result Partial on the same mesh
// dims, with no communication, when applied to each summand:
//  - matmul family and einsum: Partial @ (Replicate or plain) is Partial; a
//    bias is added on coordinate 0 of the Partial mesh dims only
//    (pending_operand_spec, comm::replicate_to_partial), so it counts once;
//  - here: add/sub (add_, sub_, any alpha) of two operands Partial on the same
//    mesh dims; add_/sub_ into a Partial self of operands that are plain or
//    Replicate on its Partial mesh dims, added on coordinate 0 of those mesh
//    dims only, as a bias is (libtorch's linear decomposes into matmul and
//    add_ of the bias); copy_ into a Partial self likewise (from a Partial of
//    the same mesh dims and dtype summand by summand, from a whole operand on
//    coordinate 0);
//    neg/neg_, clone of a Partial operand (contiguous: ops/shape.cpp); mul/mul_ and
//    div/div_ (no rounding_mode) of one Partial operand (for div the
//    numerator) by operands that are plain or Replicate on the Partial mesh
//    dims (scalars included). In-place forms must write into the Partial operand.
// An in-place op into a Partial self that is not linear (x.relu_() after a
// sharded contraction) cannot change self's layout: self is summed, the op
// runs on the sum, and the result is written back as a pending sum
// (coordinate 0 of the Partial mesh dims holds it, the others zeros), so
// self's layout and identity are kept (write_back_partial_target).
// Everything else sums first: an out-of-place Partial + Replicate (the
// replicated addend would be counted P times), products of two Partials (the product of sums is not
// the sum of products), non-linear maps (exp, relu, ...), casts, comparisons,
// out= forms, and every op without a rule (the generic fallback resolves
// Partial, as full_tensor and redistribute do). The decision reads only the op
// and the specs, so every rank decides alike.
//
// Gradients: the gradient of a Partial value is the full gradient on every
// rank (Note [replicated gradients]; comm::all_reduce's backward is the
// identity), so each summand's local backward is exact with no
// communication; a replicated operand of every summand (the `w` of P @ w, the
// `r` of P * r) is marked by to_layout so that its gradient, one
// contribution per summand, is summed over the Partial mesh dims.

// Note [partial IEEE]
// ~~~~~~~~~~~~~~~~~~
// Applying a map to each summand equals applying it to the sum only in exact
// arithmetic. With IEEE values, mul/div of the summands by the whole operand
// r differs where r is non-finite (s_i * inf over summands of opposite sign
// gives +inf and -inf, whose sum is NaN; 0 * inf is NaN though the sum may be
// non-zero) and, for div, where r has zeros (s_i / 0 is +-inf or NaN per
// summand). Those calls sum first (Note [pending partial sums]). The test
// reads r's values: a plain or Replicate r is the same on every rank; an r
// sharded on other mesh dims has its flag reduced (max) over them, so every
// rank decides alike (every rank reaches this point, since what comes before
// reads only the op and the specs). A non-finite alpha of add/sub sums first
// likewise. add/sub of two Partials, the addend on coordinate 0, neg and clone
// keep IEEE results: a sum is NaN exactly when some term is NaN or the terms
// hold both +inf and -inf, and +-inf when one infinity occurs, in any order
// or grouping. Not covered: overflow of a summand scaled by a large finite r
// where the scaled sum would not overflow (r's values alone cannot tell).

bool scalar_is_finite(const at::Scalar& v) {
  if (v.isComplex()) {
    const auto c = v.toComplexDouble();
    return std::isfinite(c.real()) && std::isfinite(c.imag());
  }
  if (v.isFloatingPoint()) return std::isfinite(v.toDouble());
  return true;
}

// Note [partial IEEE]: whether keeping mul/div (is_div) of the Partial operand
// operand_idx[k] by the other operands (and Scalar `other`) Partial could
// change IEEE results. Collective (max) over the mesh dims on which another
// operand is Shard, if any; local otherwise.
bool changes_ieee_result(bool is_div, const std::vector<c10::IValue>& args,
                         const std::vector<size_t>& operand_idx, size_t k) {
  for (size_t i = 1; i < args.size(); ++i) {
    if (!args[i].isScalar()) continue;
    const at::Scalar v = args[i].toScalar();
    if (!scalar_is_finite(v)) return true;
    if (is_div &&
        (v.isComplex() ? v.toComplexDouble() == c10::complex<double>(0, 0) : v.toDouble() == 0.0)) {
      return true;
    }
  }
  at::NoGradGuard no_grad;
  bool bad = false;
  std::vector<int64_t> reduce_dims;
  const ShardSpec* sharded = nullptr;
  for (size_t j = 0; j < operand_idx.size(); ++j) {
    if (j == k) continue;
    const at::Tensor t = args[operand_idx[j]].toTensor();
    at::Tensor r = local_of(t).detach();
    if (const ShardSpec* s = spec_of(t)) {
      for (int64_t m : sharded_mesh_dims(*s)) {
        if (std::find(reduce_dims.begin(), reduce_dims.end(), m) == reduce_dims.end()) {
          reduce_dims.push_back(m);
        }
      }
      if (!reduce_dims.empty()) sharded = s;
    }
    if (r.numel() == 0 || r.scalar_type() == at::kBool) {
      if (is_div && r.scalar_type() == at::kBool && r.numel() > 0) {
        bad = bad || !r.all().item<bool>();
      }
      continue;
    }
    if (!(r.is_floating_point() || r.is_complex())) {
      if (is_div) bad = bad || (r == 0).any().item<bool>();
      continue;
    }
    bad = bad || !r.isfinite().all().item<bool>();
    if (is_div) bad = bad || (r == 0).any().item<bool>();
  }
  if (sharded) {
    std::sort(reduce_dims.begin(), reduce_dims.end());
    at::Tensor flag = at::full({1}, bad ? 1.0 : 0.0, at::kDouble);
    flag = comm::all_reduce_nograd(flag, sharded->mesh(), reduce_dims, ReduceOp::Max);
    bad = flag.item<double>() > 0;
  }
  return bad;
}

// The mesh dims on which the result of this elementwise call stays Partial
// (Note [pending partial sums]); empty when Partial operands must be summed.
// Metadata only.
std::vector<int64_t> pending_partial_dims(const c10::OperatorHandle& op,
                                          const std::vector<c10::IValue>& args,
                                          const std::vector<size_t>& operand_idx,
                                          const std::vector<size_t>& out_idx) {
  if (!out_idx.empty()) return {};
  const auto& schema = op.schema();
  std::string base = schema.name().substr(schema.name().find("::") + 2);
  const bool inplace = !base.empty() && base.back() == '_';
  if (inplace) base.pop_back();
  // Partial mesh dims of each operand.
  std::vector<std::vector<int64_t>> pd;
  size_t n_partial = 0;
  for (size_t i : operand_idx) {
    std::vector<int64_t> dims;
    if (const ShardSpec* s = spec_of(args[i].toTensor())) {
      for (int64_t m = 0; m < s->mesh().ndim(); ++m) {
        if (is_partial(s->placements()[m])) dims.push_back(m);
      }
    }
    if (!dims.empty()) ++n_partial;
    pd.push_back(std::move(dims));
  }
  if (n_partial == 0) return {};
  for (size_t i = 0; i < args.size(); ++i) {
    if (schema.arguments()[i].name() == "rounding_mode" && !args[i].isNone()) return {};
  }
  // Whether every operand but k is plain or Replicate on k's Partial mesh dims.
  auto others_whole = [&](size_t k) {
    for (size_t j = 0; j < operand_idx.size(); ++j) {
      if (j == k) continue;
      const ShardSpec* s = spec_of(args[operand_idx[j]].toTensor());
      if (!s) continue;
      for (int64_t m : pd[k]) {
        if (!is_replicate(s->placements()[m])) return false;
      }
    }
    return true;
  };
  if (base == "add" || base == "sub" || (base == "copy" && inplace)) {
    if (operand_idx.size() != 2) return {};
    // Note [partial IEEE]: a non-finite alpha scales each summand (0 * inf).
    for (size_t i = 0; i < args.size(); ++i) {
      if (schema.arguments()[i].name() == "alpha" && args[i].isScalar() &&
          !scalar_is_finite(args[i].toScalar())) {
        return {};
      }
    }
    // copy_ between dtypes may round each summand: only within one dtype.
    const bool same_dtype = args[operand_idx[0]].toTensor().scalar_type() ==
                            args[operand_idx[1]].toTensor().scalar_type();
    if (n_partial == 2 && pd[0] == pd[1] && (base != "copy" || same_dtype)) return pd[0];
    // In place into a Partial self: the other operand joins on coordinate 0.
    if (inplace && n_partial == 1 && !pd[0].empty() && others_whole(0)) return pd[0];
    return {};
  }
  if (base == "neg" || base == "clone") {
    return operand_idx.size() == 1 ? pd[0] : std::vector<int64_t>{};
  }
  if (base != "mul" && base != "div") return {};
  if (n_partial != 1) return {};
  size_t k = 0;  // the Partial operand
  while (pd[k].empty()) ++k;
  // div: only the numerator; in place: the written operand (self) must be the Partial one.
  if ((base == "div" || inplace) && operand_idx[k] != 0) return {};
  if (!others_whole(k)) return {};
  if (changes_ieee_result(base == "div", args, operand_idx, k)) return {};
  return pd[k];
}

void pointwise_rule(const c10::OperatorHandle& op, Stack* stack);

// Note [pending partial sums]: an in-place op that is not linear into the
// Partial target args[i]: the target is summed (collective over its Partial
// mesh dims), the op runs on the sum (this rule, with a whole target), and the
// new value is written back into the target's piece as a pending sum
// (comm::replicate_to_partial: coordinate 0 keeps it, others zeros).
// Differentiable: copy_ into the piece records the write.
void write_back_partial_target(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                               size_t i, Stack* stack) {
  const at::Tensor target = args[i].toTensor();
  const ShardSpec& s = *spec_of(target);
  auto whole = std::make_shared<const ShardSpec>(without_partial(s));
  at::Tensor resolved = wrap(to_layout(target, *whole, *whole), whole);
  args[i] = resolved;
  Stack inner(args.begin(), args.end());
  pointwise_rule(op, &inner);
  local_of(target).copy_(detail::redistribute_local(local_of(resolved), *whole, s));
  stack->push_back(target);
}

// Note [plain in-place target]: an in-place op that writes a plain tensor
// from a ShardTensor operand (the FNO idiom `out_ft = torch.zeros(...);
// out_ft[..., :m1, :m2] = einsum(...)`) cannot keep the data sharded: the
// plain tensor is whole on every rank. The ShardTensor operands are gathered
// (Partial summed) and the op runs on plain tensors, so the target holds the
// full values on every rank, differentiably (the gather's adjoint hands each
// rank the gradient of its piece, Note [replicated gradients]). A visible
// gather (Note [visible gathers]): counted, warned once per op, refused in
// strict mode with a hint to build the target from the ShardTensor
// (`x_ft.new_zeros(...)`), which keeps it sharded. Collective over the mesh
// dims on which an operand is not Replicate.
void gather_into_plain_target(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                              const std::vector<size_t>& operand_idx, const DeviceMesh& mesh,
                              Stack* stack) {
  int64_t bytes = 0;
  for (size_t i : operand_idx) {
    const at::Tensor& t = args[i].toTensor();
    if (const ShardSpec* s = spec_of(t)) {
      const ShardSpec whole(s->mesh(), Placements(s->mesh().ndim(), Replicate{}), t.sizes().vec());
      bytes += gathered_bytes(*s, whole, static_cast<int64_t>(t.element_size()));
    }
  }
  note_gather(op, args, mesh, bytes,
              "an in-place op on a plain tensor gathers its ShardTensor operand (create the "
              "target from the ShardTensor, e.g. x_ft.new_zeros(...), to keep it sharded)");
  std::vector<c10::IValue> local_args = args;
  for (size_t i : operand_idx) {
    const at::Tensor& t = args[i].toTensor();
    if (const ShardSpec* s = spec_of(t)) {
      const ShardSpec whole(s->mesh(), Placements(s->mesh().ndim(), Replicate{}), t.sizes().vec());
      local_args[i] = to_layout(t, whole, whole);
    }
  }
  Stack results = std::move(local_args);
  op.callBoxed(&results);
  for (auto& r : results) stack->push_back(std::move(r));
}

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

  for (size_t i : operand_idx) {
    if (is_written(schema.arguments()[i]) && !spec_of(args[i].toTensor())) {
      return gather_into_plain_target(op, args, operand_idx, mesh, stack);
    }
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
  const std::vector<int64_t> pending = pending_partial_dims(op, args, operand_idx, out_idx);
  const std::string& name = schema.name();
  if (pending.empty() && out_idx.empty() && schema.returns().size() == 1) {
    for (size_t i : operand_idx) {
      const ShardSpec* s = spec_of(args[i].toTensor());
      if (is_written(schema.arguments()[i]) && s && s->has_partial()) {
        return write_back_partial_target(op, std::move(args), i, stack);
      }
    }
  }
  const bool addend = name == "aten::add_" || name == "aten::sub_" || name == "aten::copy_";
  if (!pending.empty()) {
    Placements p = out_spec->placements();
    for (int64_t m : pending) p[m] = Partial{};
    out_spec = make_spec(mesh, p, shape, out_spec->all_shard_sizes());
  }

  // In-place targets must already have the result layout.
  std::vector<c10::IValue> local_args = args;
  for (size_t i : operand_idx) {
    const at::Tensor& t = args[i].toTensor();
    if (is_written(schema.arguments()[i])) {
      const ShardSpec* s = spec_of(t);
      TORCH_INTERNAL_ASSERT(s, "plain in-place targets are handled above");
      if (*s != *out_spec) {
        fail(op, args,
             "the in-place target's layout " + s->to_string() + " differs from the result's " +
                 out_spec->to_string());
      }
      local_args[i] = local_of(t);
    } else {
      // Note [pending partial sums]: the Partial operands keep their summands;
      // an addend of add_/sub_ joins them on coordinate 0.
      const ShardSpec* s = spec_of(t);
      const bool keeps = !pending.empty() && ((s && s->has_partial()) || addend);
      local_args[i] = to_layout(
          t,
          keeps ? pending_operand_spec(*out_spec, t.sizes()) : operand_spec(*out_spec, t.sizes()),
          *out_spec);
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

// Note [wrapper strides] (ops/shape.cpp): a pointwise result's piece follows
// the memory layout of its operands' pieces (TensorIterator keeps a transposed
// input's order), so where an operand's wrapper is not contiguous the
// result's wrapper gets libtorch's strides (one call on meta tensors), as
// libtorch's result would have them; else it keeps contiguous strides, which
// then are libtorch's too, at no cost. Was: `(x.t() + 1).view(-1)` viewed the
// piece on ranks whose piece allowed it and copied it on the others, so a
// write through the view reached the result on some ranks only.
Rule pointwise_following_strides() {
  static const Rule strided = with_torch_strides(pointwise_rule);
  return [](const c10::OperatorHandle& op, Stack* stack) {
    const size_t n = op.schema().arguments().size();
    for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
      if (it->isTensor() && it->toTensor().defined() && !it->toTensor().is_contiguous()) {
        strided(op, stack);
        return;
      }
    }
    pointwise_rule(op, stack);
  };
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
     "hardswish_", "log_sigmoid", "softshrink", "hardshrink", "threshold", "threshold_", "rrelu",
     // clamping, selection, comparison, logic
     "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "clip", "clip_",
     "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar", "where.self_out",
     "masked_fill", "masked_fill_", "eq", "eq_", "ne", "ne_", "lt", "lt_", "le", "le_", "gt", "gt_",
     "ge", "ge_", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "logical_and",
     "logical_and_", "logical_or", "logical_or_", "logical_not", "logical_not_", "logical_xor",
     "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "signbit", "heaviside",
     // in-place fills (the random ops: ops/random.cpp)
     "fill_", "zero_",
     // conversions
     "_to_copy", "detach_", "copy_", "conj_physical"},
    pointwise_following_strides());

// Views (and clone, which keeps its input's layout): their wrappers get
// libtorch's strides, so that contiguous() of a non-contiguous one copies
// (Note [wrapper strides]).
const RuleRegistrar pointwise_view_ops({"clone", "detach", "alias", "lift_fresh", "resolve_conj",
                                        "resolve_neg", "positive", "_conj", "real", "imag"},
                                       with_torch_strides(pointwise_rule));

const RuleRegistrar like_ops({"empty_like", "zeros_like", "ones_like", "full_like"}, like_rule);

}  // namespace
}  // namespace shardtensor::ops
