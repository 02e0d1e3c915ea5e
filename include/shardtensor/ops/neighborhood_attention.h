#pragma once
/// \file Neighbourhood attention on 1-, 2- and 3-D token grids (NATTEN's
/// semantics), on plain tensors and on grids sharded along spatial dims
/// (docs/attention.md, "Neighbourhood attention").

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace shardtensor {

/// Note [neighbourhood window]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Along every spatial dim of extent n, with kernel size K (odd) and dilation
/// d (K * d <= n), query i attends to K keys of the same residue class
/// i mod d, spaced d apart:
///  - non-causal (NATTEN's clamped window): with r = i mod d, j = i / d and
///    L = ceil((n - r) / d) positions of that class, the window is
///    r + (s + t) d for t = 0 .. K-1, s = clamp(j - K/2, 0, L - K). Inside the
///    grid it is centred on the query (i - d*(K/2) .. i + d*(K/2)); at a border
///    it is shifted inward (never zero-padded), so every query sees exactly K
///    keys per dim.
///  - causal: the window ends at the query: keys i - t d for t = 0 .. K-1
///    that are >= 0 (fewer than K near the start of the grid). A key is
///    visible iff it is at or before the query along **every** spatial dim.
/// The neighbourhood of a query in a D-dim grid is the product of its per-dim
/// windows (K^D keys, fewer when causal).

/// softmax(q · kᵀ · scale) v over each query's neighbourhood (Note
/// [neighbourhood window]), as NATTEN's na1d/na2d/na3d.
///
/// Shapes: q and k are [B, heads, *spatial, D] with 1 to 3 spatial dims; v is
/// [B, heads, *spatial, Dv] (same extents but the last). The result is
/// [B, heads, *spatial, Dv]. `scale` defaults to 1/sqrt(D). `kernel_size` and
/// `dilation` apply to every spatial dim.
///
/// **Plain tensors** (all of q, k, v): computed on this rank, differentiable
/// by libtorch. Local.
///
/// **ShardTensors** (all of q, k, v, on one mesh, with identical placements
/// and shard sizes): **collective** over the mesh dims that shard spatial dims
/// (each such mesh dim exchanges key/value halos point-to-point between
/// neighbouring coordinates, multi-hop across small or empty pieces). Every
/// mesh dim may be Shard of a spatial dim, Shard(0) (batch) or Replicate;
/// uneven and empty pieces are fine. Per sharded spatial dim every
/// coordinate fetches exactly the key range its queries' windows reach
/// (comm::gather_range, differentiable: the backward sends the halo
/// gradients back to their owners): d*(K/2) on each side inside the grid
/// (causal: d*(K-1) on the left, none on the right), up to d*(K-1) on one side
/// for a piece whose queries' windows are shifted by a border. No rank holds
/// more than its piece plus halos; the working set is about K^D times the
/// local k and v (the gathered neighbourhoods, kept for the backward), so
/// memory per rank is about 1/P of the single-process one. The result is a
/// ShardTensor laid out like q (with extent Dv in the last dim).
///
/// Throws c10::Error on every rank (the checks use only metadata identical
/// everywhere), before any communication, naming the op, the shapes and the
/// placements, for: undefined inputs, a mix of plain and ShardTensor inputs,
/// fewer than 1 or more than 3 spatial dims, mismatched shapes, different or
/// non-floating dtypes, an even or non-positive kernel_size, a non-positive
/// dilation, kernel_size * dilation larger than a spatial extent, a
/// non-finite or non-positive scale, different meshes, placements or shard
/// sizes, or a sharded head or feature dim. A Partial input is summed first
/// (collective over its Partial mesh dims; Note [pending partial sums]).
at::Tensor neighborhood_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t kernel_size, int64_t dilation = 1, bool is_causal = false,
                                  std::optional<double> scale = std::nullopt);

}  // namespace shardtensor
