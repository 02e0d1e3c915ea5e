// attention: shardtensor::scaled_dot_product_attention on q, k, v of shape
// [B, H, S, D] sharded along the sequence (dim 2). Built only once the
// attention rule's header exists. The plain-tensor baseline is the textbook
// softmax(q k^T * scale) v (libtorch 1.13 has no scaled_dot_product_attention).
#if __has_include(<shardtensor/ops/attention.h>) && SHARDTENSOR_BENCH_ATTENTION
#include <shardtensor/ops/attention.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <cmath>
#include <limits>

#include "bench.h"

namespace bench {
namespace {

at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    const int64_t n = q.size(-2), m = k.size(-2);
    at::Tensor keep = at::ones({n, m}, q.options().dtype(at::kBool)).tril();
    s = s.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(s, -1), v);
}

Instance make_attention(const Problem& p) {
  TORCH_CHECK(p.shape.size() == 1, "attention: --shape takes the sequence length S");
  const std::vector<int64_t> shape = {p.batch, p.heads, p.shape[0], p.head_dim};
  Instance in;
  in.inputs = {Input{shape, {2}, true}, Input{shape, {2}, true}, Input{shape, {2}, true}};
  in.spatial_dims = 1;
  const bool causal = p.causal;
  in.forward = [causal](const std::vector<at::Tensor>& x) {
    if (shardtensor::ShardTensor::is_shard_tensor(x[0])) {
      return shardtensor::scaled_dot_product_attention(x[0], x[1], x[2], {}, causal);
    }
    return plain_attention(x[0], x[1], x[2], causal);
  };
  return in;
}

const Registrar reg(Workload{"attention",
                             "shardtensor::scaled_dot_product_attention, q/k/v sharded on S",
                             {4096},
                             [](const Problem&) { return int64_t{1}; },
                             make_attention});

}  // namespace
}  // namespace bench
#endif
