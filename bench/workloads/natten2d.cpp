// natten2d: shardtensor::neighborhood_attention on q, k, v of shape
// [B, heads, H, W, D] with a 7x7 window (dilation 1), sharded along H (and W
// on a 2-D mesh). The baseline is the same function on plain tensors (the
// single-process path of the op, libtorch ops only): the comparison shows
// what the halos and the split cost, and the memory ratio per rank.
#include <shardtensor/ops/neighborhood_attention.h>

#include "bench.h"

namespace bench {
namespace {

Instance make_natten2d(const Problem& p) {
  TORCH_CHECK(p.shape.size() == 2, "natten2d: --shape takes H,W");
  const std::vector<int64_t> shape = {p.batch, p.heads, p.shape[0], p.shape[1], p.head_dim};
  Instance in;
  in.inputs = {Input{shape, {2, 3}, true}, Input{shape, {2, 3}, true}, Input{shape, {2, 3}, true}};
  in.spatial_dims = 2;
  const bool causal = p.causal;
  in.forward = [causal](const std::vector<at::Tensor>& x) {
    return shardtensor::neighborhood_attention(x[0], x[1], x[2], /*kernel_size=*/7,
                                               /*dilation=*/1, causal);
  };
  return in;
}

const Registrar reg(Workload{"natten2d",
                             "shardtensor::neighborhood_attention, 7x7 window, q/k/v "
                             "[B, heads, H, W, D] sharded on H (and W)",
                             {128, 128},
                             [](const Problem&) { return int64_t{1}; },
                             make_natten2d});

}  // namespace
}  // namespace bench
