#pragma once
/// \file Scaled dot-product attention; ring attention when the sequence is
/// sharded (docs/attention.md).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace shardtensor {

/// softmax(q kᵀ · scale + mask) v, with grouped-query heads.
///
/// Shapes: q is [B, Hq, Sq, D]; k and v are [B, Hkv, Sk, D] (same shape) with
/// Hq % Hkv == 0: query head h attends with key/value head h / (Hq / Hkv)
/// (grouped-query; Hkv == 1 is multi-query). `scale` defaults to 1/sqrt(D).
/// `is_causal` hides key j from query i when j > i (global positions,
/// top-left aligned as libtorch's tril(ones(Sq, Sk))); it may be combined with
/// a mask. A query row that sees no key gives NaN, as libtorch's math does.
///
/// **Plain tensors** (all of q, k, v): ordinary attention on this rank
/// (matmul, softmax, matmul; differentiable by libtorch). Local.
///
/// **ShardTensors** (all of q, k, v, on one mesh): **collective** over the
/// mesh dim that shards the sequence (dim 2), which runs *ring attention*:
/// K/V blocks travel around that mesh dim with non-blocking point-to-point
/// messages overlapped with the local block computation, merged by an online
/// softmax; the backward pass circulates K/V and the dK/dV accumulators the
/// same way and recomputes the scores block by block. No rank ever holds an
/// Sq x Sk or (Sq/P) x Sk score matrix (blocks of at most (Sq/P) x (Sk/P),
/// cut further into key chunks). Accepted layouts, per mesh dim: Shard{2}
/// (on at most one mesh dim: the ring), Shard{0} (batch), or Replicate. q, k
/// and v must have the same placements and the same batch split; k and v must
/// have identical specs; the sequence splits of q and of k/v may be anything
/// (uneven, empty pieces). The result is a ShardTensor laid out like q.
/// Without a sequence-sharding mesh dim the computation is local per piece.
/// Causal self-attention balances the ring's work per causal_balance().
///
/// **Mask** (optional): bool (true = attend, as libtorch) or floating
/// (added to the scores), never differentiated (a mask that requires grad is
/// rejected). Its shape, right-aligned against [B, Hq, Sq, Sk], must have at
/// most 4 dims, each equal to the full extent or 1; so [Sq, Sk], [1, Sk],
/// [B, 1, Sq, Sk], [B, Hq, 1, Sk], [B, 1, 1, Sk] (key padding) ... are all
/// accepted. With ShardTensor q/k/v the mask is either
///  - a plain tensor (taken as replicated; each rank uses its query rows), or
///  - a ShardTensor sharded **with the queries**: Shard on its Sq dim (-2) on
///    the ring mesh dim with q's sequence sizes, Shard{0} on the batch mesh dim
///    when its batch extent is B (with q's batch sizes), Replicate elsewhere;
///    its key dim (-1) is never sharded. A mask whose Sq extent is 1 is
///    Replicate on the ring mesh dim.
/// Any other mask layout (sharded along keys, different sizes, Partial) is
/// rejected.
///
/// Throws c10::Error on every rank, before any communication, for: a mix of
/// plain and ShardTensor inputs, q/k/v on different meshes or with mismatched
/// placements or batch splits, k and v with different specs, a sharded head or
/// feature dim, Partial inputs, non-4-D inputs, mismatched B/D, Hq % Hkv != 0,
/// different or non-floating dtypes, a bad mask shape, dtype or layout, a mask
/// that requires grad, or a non-finite scale.
///
/// libtorch 1.13's aten::_scaled_dot_product_attention on ShardTensors comes
/// here too (dropout_p must be 0 and need_attn_weights false).
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& attn_mask = {},
                                        bool is_causal = false,
                                        std::optional<double> scale = std::nullopt);

/// How sharded causal self-attention (is_causal, Sq == Sk, a ring of P > 1)
/// spreads the work (docs/attention.md, "Causal masking and load imbalance").
enum class CausalBalance {
  /// Compute on the shards as they are, skipping fully-masked blocks: the last
  /// coordinate of the ring computes about P - 1/2 blocks, the first about 1/2.
  Contiguous,
  /// Zig-zag: the sequence is cut into 2P chunks and coordinate c computes the
  /// queries and keys of chunks c and 2P-1-c (moved there and back inside the
  /// call, differentiably), so every coordinate computes about P/2 + 1/2
  /// blocks. Costs one extra exchange of q, k, v and out (and of their
  /// gradients in backward), about half of each block.
  ZigZag,
};

/// Local, process-wide. Sets the strategy (default CausalBalance::ZigZag);
/// returns the previous one. Every rank must use the same setting; with
/// SHARDTENSOR_DEBUG=1 each sharded causal self-attention checks it (one
/// uncounted all-reduce) and, where ranks differ, throws c10::Error on every
/// rank naming set_causal_balance and each rank's value (Note [agreed settings]).
CausalBalance set_causal_balance(CausalBalance balance);
/// Local. The current strategy.
CausalBalance causal_balance();

namespace detail {
/// Local. Upper bound on the elements of one score chunk of ring attention
/// (rows x key columns; the key chunk is at least 16 columns). Default 2^21
/// (8 MiB in float32). For tests and tuning; returns the previous value.
int64_t set_attention_chunk_elements(int64_t elements);
/// Local. Score elements ring attention computed on this rank (forward and
/// backward) since the last call with reset = true; for tests of the causal balance.
int64_t attention_score_elements(bool reset = false);
}  // namespace detail

}  // namespace shardtensor
