// prelu with a scalar or per-channel weight (Note [prelu layout]).
//
// Note [prelu layout]: libtorch's prelu takes a weight of one element or of
// C = input.size(1) elements (one per channel), not a
// right-aligned broadcast, so it has its own rule. The output has the input's
// layout (a Partial input is summed first: prelu is not linear). A per-channel
// weight is brought to Shard(0) with the input's channel split on the mesh dims
// that shard the channel dim, and Replicate elsewhere; to_layout marks it so
// that its gradient is summed over the mesh dims where the input is sharded
// (Note [replicated gradients]). No communication in forward beyond that.
#include <ATen/ATen.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

void prelu_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const DeviceMesh mesh = common_mesh(op, args);
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& w = args[1].toTensor();
  const int64_t nd = x.dim();
  const int64_t cdim = 1;  // libtorch: one weight per entry of dim 1, or one in all
  const int64_t channels = nd >= 2 ? x.size(cdim) : 1;
  if (w.dim() > 1 || (w.numel() != 1 && w.numel() != channels)) {
    fail(op, args,
         "the weight must have 1 element or one per channel (" + std::to_string(channels) +
             ") along dim " + std::to_string(cdim));
  }
  const ShardSpec* xs = spec_of(x);
  SpecPtr compute;
  if (xs) {
    compute = std::make_shared<const ShardSpec>(without_partial(*xs));
  } else {
    compute = make_spec(mesh, Placements(mesh.ndim(), Replicate{}), x.sizes().vec());
  }
  Placements wp(mesh.ndim(), Replicate{});
  ShardSizes wsizes(mesh.ndim());
  if (nd >= 2 && w.dim() == 1 && w.numel() == channels) {
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      const auto& pl = compute->placements()[m];
      if (is_shard(pl) && shard_dim(pl) == cdim) {
        wp[m] = Shard{0};
        wsizes[m] = compute->shard_sizes(m);
      }
    }
  }
  const ShardSpec wspec(mesh, wp, w.sizes().vec(), wsizes);
  // Communication starts here.
  at::Tensor lx = to_layout(x, *compute, *compute);
  at::Tensor lw = to_layout(w, wspec, *compute);
  at::Tensor out = at::prelu(lx, lw);
  stack->push_back(wrap(out, compute));
}

const RuleRegistrar prelu_ops({"prelu"}, prelu_rule);

}  // namespace
}  // namespace shardtensor::ops
