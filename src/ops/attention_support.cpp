// Rules that attention written with ordinary libtorch ops needs on sharded
// tokens (torch::nn::MultiheadAttention, hand-written matmul/softmax/matmul,
// transformer blocks):
//  - equal: MultiheadAttention's forward asks torch::equal(query, key).
// Softmax and layer norm (also over sharded dims) are ops/softmax.cpp and ops/norm.cpp.
#include <ATen/ATen.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

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

}  // namespace
}  // namespace shardtensor::ops
