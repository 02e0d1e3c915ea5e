// shardtensor::halo_exchange (include/shardtensor/ops/halo.h).
#include <shardtensor/ops/halo.h>

#include "ops/common.h"

namespace shardtensor {

namespace {

// Local: the index along a dim of extent n that global position g reads.
int64_t source_index(int64_t g, int64_t n, PadMode mode) {
  switch (mode) {
    case PadMode::Reflect:
      return g < 0 ? -g : (g >= n ? 2 * (n - 1) - g : g);
    case PadMode::Replicate:
      return g < 0 ? 0 : (g >= n ? n - 1 : g);
    case PadMode::Circular:
      return ((g % n) + n) % n;
    case PadMode::Constant:
      break;
  }
  return g;
}

/// The layout and the wrapped dim of halo_exchange's tensor argument; throws,
/// naming `fn`, if `t` is not a ShardTensor or `dim` is out of range.
struct HaloTarget {
  ShardSpec spec;
  int64_t dim;
  int64_t mesh_dim;  // -1: no mesh dim shards `dim`
};

HaloTarget halo_target(const at::Tensor& t, int64_t dim, const char* fn) {
  const ShardSpec* s = ops::spec_of(t);
  TORCH_CHECK(s != nullptr, "shardtensor::", fn, ": expected a ShardTensor, got a plain tensor");
  TORCH_CHECK(dim >= -t.dim() && dim < t.dim(), "shardtensor::", fn, ": dim ", dim,
              " is out of range for a ", t.dim(), "-d tensor");
  if (dim < 0) dim += t.dim();
  ShardSpec spec = ops::without_partial(*s);
  const int64_t m = spec.mesh_dim_of(dim);
  return {std::move(spec), dim, m};
}

}  // namespace

at::Tensor halo_exchange(const at::Tensor& t, int64_t dim, int64_t left, int64_t right,
                         PadMode mode, double value) {
  const HaloTarget target = halo_target(t, dim, "halo_exchange");
  const ShardSpec& spec = target.spec;
  const int64_t m = target.mesh_dim;
  dim = target.dim;
  if (m >= 0) {
    at::Tensor local = ops::to_layout(t, spec, spec);
    return comm::halo_exchange(local, spec.mesh(), m, dim, spec.shard_sizes(m), left, right, mode,
                               value);
  }
  // Unsharded dim: a plain local pad.
  const int64_t n = t.size(dim);
  TORCH_CHECK(n + left + right >= 0, "shardtensor::halo_exchange: left ", left, " and right ",
              right, " trim more than the extent ", n, " of dim ", dim);
  if (mode == PadMode::Reflect) {
    TORCH_CHECK(n >= 2 && left <= n - 1 && right <= n - 1,
                "shardtensor::halo_exchange: Reflect needs an extent of at least 2 and halos of "
                "at most n - 1 = ",
                n - 1, " (dim ", dim, ", left ", left, ", right ", right, ")");
  }
  TORCH_CHECK(mode == PadMode::Constant || n > 0 || (left <= 0 && right <= 0),
              "shardtensor::halo_exchange: cannot fill a halo from an empty dim");
  at::Tensor local = ops::to_layout(t, spec, spec);
  if (mode == PadMode::Constant) {
    std::vector<int64_t> pad(2 * (t.dim() - dim), 0);
    pad[pad.size() - 2] = left;
    pad[pad.size() - 1] = right;
    return ops::constant_pad_piece(local, pad, value);
  }
  std::vector<int64_t> idx;
  for (int64_t g = -left; g < n + right; ++g) idx.push_back(source_index(g, n, mode));
  return local.index_select(dim, at::tensor(idx, at::kLong).to(local.device()));
}

bool PendingHaloExchange::test() {
  TORCH_CHECK(!ended_, "shardtensor::PendingHaloExchange::test: the exchange was already ended");
  return sharded_ ? in_flight_.test() : true;
}

PendingHaloExchange halo_exchange_begin(const at::Tensor& t, int64_t dim, int64_t left,
                                        int64_t right, PadMode mode, double value) {
  const HaloTarget target = halo_target(t, dim, "halo_exchange_begin");
  const ShardSpec& spec = target.spec;
  const int64_t m = target.mesh_dim;
  dim = target.dim;
  PendingHaloExchange p;
  if (m >= 0) {
    at::Tensor local = ops::to_layout(t, spec, spec);
    p.in_flight_ = comm::halo_exchange_start(local, spec.mesh(), m, dim, spec.shard_sizes(m), left,
                                             right, mode, value);
    p.sharded_ = true;
  } else {
    p.ready_ = halo_exchange(t, dim, left, right, mode, value);  // local: nothing to wait for
  }
  return p;
}

at::Tensor halo_exchange_end(PendingHaloExchange& pending) {
  TORCH_CHECK(!pending.ended_, "shardtensor::halo_exchange_end: the exchange was already ended");
  pending.ended_ = true;
  if (!pending.sharded_) return std::move(pending.ready_);
  return pending.in_flight_.finish();
}

}  // namespace shardtensor
