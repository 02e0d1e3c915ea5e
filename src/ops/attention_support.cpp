// Rules that attention written with ordinary libtorch ops needs on sharded
// tokens (torch::nn::MultiheadAttention, hand-written matmul/softmax/matmul,
// transformer blocks):
//  - equal: MultiheadAttention's forward asks torch::equal(query, key).
//  - fallbacks (ops/registry.h: used only while no regular rule exists) for
//    softmax / log_softmax over an UNSHARDED dim and native_layer_norm over
//    UNSHARDED trailing dims, both purely local. The normalization rules
//    (softmax or layer norm over a sharded dim) replace them by registering
//    regular rules; until then a sharded normalized dim is a clear error.
#include <ATen/ATen.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

int64_t wrap_dim(int64_t d, int64_t nd) { return d < 0 ? d + nd : d; }

// aten::equal(self, other) -> bool. Collective over the mesh: true on every rank
// iff the global tensors are equal.
void equal_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& a = args[0].toTensor();
  const at::Tensor& b = args[1].toTensor();
  const DeviceMesh mesh = common_mesh(op, args);
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    stack->push_back(false);
    return;
  }
  const ShardSpec* ref = spec_of(a) ? spec_of(a) : spec_of(b);
  const ShardSpec layout = without_partial(*ref);
  bool same;
  {
    at::NoGradGuard no_grad;
    at::Tensor la = to_layout(a, layout, layout);
    at::Tensor lb = to_layout(b, layout, layout);
    same = at::equal(la, lb);
  }
  std::vector<int64_t> dims(mesh.ndim());
  for (int64_t m = 0; m < mesh.ndim(); ++m) dims[m] = m;
  at::Tensor flag = at::full({1}, same ? 1 : 0, at::kLong);
  flag = comm::all_reduce_nograd(flag, mesh, dims, ReduceOp::Min);
  stack->push_back(flag.item<int64_t>() == 1);
}

const RuleRegistrar equal_ops({"equal"}, equal_rule);

// Fallback: aten::_softmax / _log_softmax(self, dim, half_to_float) over an unsharded dim.
void local_softmax_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  const int64_t dim = wrap_dim(args[1].toInt(), x.dim());
  if (s->mesh_dim_of(dim) >= 0) {
    fail(op, args,
         "softmax over a sharded dim needs the normalization rules (not in this build); "
         "only softmax over an unsharded dim is supported here");
  }
  auto spec = std::make_shared<const ShardSpec>(without_partial(*s));
  std::vector<c10::IValue> local_args = args;
  local_args[0] = to_layout(x, *spec, *spec);
  Stack results = std::move(local_args);
  op.callBoxed(&results);
  push_results(op, args, &results, spec, stack);
}

const FallbackRuleRegistrar softmax_ops({"_softmax", "_log_softmax"}, local_softmax_rule);

// Fallback: aten::native_layer_norm(input, normalized_shape, weight?, bias?, eps)
// -> (out, mean, rstd) when the normalized (trailing) dims are not sharded.
void local_layer_norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  if (!s) fail(op, args, "the input must be the ShardTensor");
  const auto normalized = args[1].toIntVector();
  const int64_t axis = x.dim() - static_cast<int64_t>(normalized.size());
  for (int64_t d = axis; d < x.dim(); ++d) {
    if (s->mesh_dim_of(d) >= 0) {
      fail(op, args,
           "layer norm over a sharded dim needs the normalization rules (not in this build); "
           "only normalization over unsharded trailing dims is supported here");
    }
  }
  auto spec = std::make_shared<const ShardSpec>(without_partial(*s));
  std::vector<c10::IValue> local_args = args;
  local_args[0] = to_layout(x, *spec, *spec);
  for (size_t i : {size_t(2), size_t(3)}) {
    if (args[i].isTensor() && args[i].toTensor().defined()) {
      const at::Tensor& w = args[i].toTensor();
      local_args[i] = to_layout(w, operand_spec(*spec, w.sizes()), *spec);
    }
  }
  Stack results = std::move(local_args);
  op.callBoxed(&results);
  std::vector<int64_t> stat_shape(x.sizes().begin(), x.sizes().begin() + axis);
  stat_shape.resize(x.dim(), 1);
  auto stat_spec = std::make_shared<const ShardSpec>(operand_spec(*spec, stat_shape));
  stack->push_back(wrap(results[0].toTensor(), spec));
  stack->push_back(wrap(results[1].toTensor(), stat_spec));
  stack->push_back(wrap(results[2].toTensor(), stat_spec));
}

const FallbackRuleRegistrar layer_norm_ops({"native_layer_norm"}, local_layer_norm_rule);

}  // namespace
}  // namespace shardtensor::ops
