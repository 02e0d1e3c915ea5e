#pragma once
// The halo-extended piece of the split-phase stencil rules (pooling,
// interpolation, transposed convolution) as 3^D blocks: Note [halo blocks].
#include <shardtensor/comm/primitives.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ops/stencil.h"

namespace shardtensor::ops::stencil {

// Note [halo blocks]
// ~~~~~~~~~~~~~~~~~~
// With D sharded spatial dims, the halo-extended piece is a 3^D arrangement
// of blocks: block b has side (b / 3^(D-1-j)) % 3 along sharded dim j (0 the
// left halo, 1 the piece's own rows, 2 the right halo); its level is the
// number of dims where it is a halo. The piece itself is the one block of
// level 0. A level-l block is gathered (comm::gather_range_start, split
// phase) along its last halo dim from the level-(l-1) block beside it (the
// corners come from halos that already arrived), so the rules post level 1,
// compute what needs only the piece, and finish level by level. A side that
// no coordinate needs (every range empty) is an empty block everywhere;
// decided from global data, so every peer of a mesh dim takes part in the
// same exchanges. blocks() of sides never read still run their adjoint in
// backward; the rules attach them to the output (used() tells which).

/// One sharded spatial dim of a split-phase stencil rule.
struct BlockDim {
  int64_t dim = 0, mesh_dim = 0;   ///< tensor dim, the mesh dim sharding it
  std::vector<int64_t> in_sizes;   ///< the input's sizes along the mesh dim
  std::vector<Range> left, right;  ///< per coordinate: the halo ranges
  int64_t off = 0, n = 0;          ///< this rank's piece [off, off + n)
};

/// Collective over the BlockDims' mesh dims (start_level/finish_level);
/// everything else is local. Differentiable: the blocks are autograd
/// results of the halo gathers.
class HaloBlocks {
 public:
  HaloBlocks(const at::Tensor& piece, const DeviceMesh& mesh, std::vector<BlockDim> dims,
             PadMode mode, double fill)
      : mesh_(mesh), dims_(std::move(dims)), mode_(mode), fill_(fill) {
    const int64_t D = ndims();
    count_ = 1;
    for (int64_t j = 0; j < D; ++j) {
      count_ *= 3;
      own_ = own_ * 3 + 1;
    }
    blocks_.resize(count_);
    pending_.resize(count_);
    exchanged_.assign(count_, 0);
    used_.assign(count_, 0);
    blocks_[own_] = piece;
  }

  int64_t ndims() const { return static_cast<int64_t>(dims_.size()); }
  int64_t count() const { return count_; }
  int64_t own() const { return own_; }
  const BlockDim& dim(int64_t j) const { return dims_[j]; }

  /// Side of block b along sharded dim j: 0 left halo, 1 own rows, 2 right halo.
  int64_t side(int64_t b, int64_t j) const {
    for (int64_t r = j + 1; r < ndims(); ++r) b /= 3;
    return b % 3;
  }
  /// Block b with its side along j replaced by v.
  int64_t with_side(int64_t b, int64_t j, int64_t v) const {
    int64_t pw = 1;
    for (int64_t r = j + 1; r < ndims(); ++r) pw *= 3;
    return b + (v - side(b, j)) * pw;
  }
  /// Number of halo sides of block b.
  int64_t level(int64_t b) const {
    int64_t l = 0;
    for (int64_t j = 0; j < ndims(); ++j) l += side(b, j) != 1 ? 1 : 0;
    return l;
  }
  /// This rank's global range of side v along sharded dim j.
  Range span(int64_t j, int64_t v) const {
    const BlockDim& d = dims_[j];
    const int64_t me = mesh_.coordinate()[d.mesh_dim];
    if (v == 0) return d.left[me];
    if (v == 2) return d.right[me];
    return {d.off, d.off + d.n};
  }

  /// Posts the gathers of every level-l block (collective over the mesh dims).
  void start_level(int64_t l) {
    for (int64_t b = 0; b < count_; ++b) {
      if (level(b) != l) continue;
      int64_t j = ndims() - 1;
      while (side(b, j) == 1) --j;  // the last dim with a halo side
      const BlockDim& d = dims_[j];
      const at::Tensor& parent = blocks_[with_side(b, j, 1)];
      const auto& ranges = side(b, j) == 0 ? d.left : d.right;
      bool any = false;
      for (const auto& r : ranges) any = any || r.first < r.second;
      // Decided alike by the mesh dim's peers (global ranges; the parent's
      // shape off this dim is shared by them).
      if (!any || parent.numel() == 0) {
        std::vector<int64_t> shape = parent.sizes().vec();
        const Range sp = span(j, side(b, j));
        shape[d.dim] = sp.second - sp.first;
        blocks_[b] = at::zeros(shape, parent.options());
        continue;
      }
      exchanged_[b] = 1;
      pending_[b].emplace(comm::gather_range_start(parent, mesh_, d.mesh_dim, d.dim, d.in_sizes,
                                                   ranges, mode_, fill_));
    }
  }
  /// Waits for the level-l gathers.
  void finish_level(int64_t l) {
    for (int64_t b = 0; b < count_; ++b) {
      if (level(b) == l && pending_[b]) {
        blocks_[b] = pending_[b]->finish();
        pending_[b].reset();
      }
    }
  }

  /// Local. Drives the posted gathers (MPI progress while computing).
  void test() {
    for (auto& p : pending_) {
      if (p) p->test();
    }
  }

  /// Local. The global input box `want` (one range per sharded dim, inside
  /// the halo-extended piece) as one tensor: the blocks it overlaps,
  /// narrowed (marked as read) and concatenated dim by dim.
  at::Tensor region(const std::vector<Range>& want) {
    std::vector<std::pair<int64_t, Range>> part(ndims());
    return region_from(0, want, part);
  }

  /// Block b, marked as read.
  const at::Tensor& use(int64_t b) {
    used_[b] = 1;
    return blocks_[b];
  }
  const at::Tensor& block(int64_t b) const { return blocks_[b]; }
  bool exchanged(int64_t b) const { return exchanged_[b] != 0; }
  bool used(int64_t b) const { return used_[b] != 0; }

 private:
  at::Tensor region_from(int64_t j, const std::vector<Range>& want,
                         std::vector<std::pair<int64_t, Range>>& part) {
    const int64_t D = ndims();
    if (j == D) {
      int64_t b = 0;
      for (int64_t r = 0; r < D; ++r) b = b * 3 + part[r].first;
      at::Tensor t = use(b);
      for (int64_t r = 0; r < D; ++r) {
        const int64_t s0 = span(r, part[r].first).first;
        t = t.narrow(dims_[r].dim, part[r].second.first - s0,
                     part[r].second.second - part[r].second.first);
      }
      return t;
    }
    std::vector<at::Tensor> pieces;
    for (int64_t v = 0; v < 3; ++v) {
      const Range sp = span(j, v);
      const int64_t a = std::max(want[j].first, sp.first);
      const int64_t e = std::min(want[j].second, sp.second);
      if (a >= e) continue;
      part[j] = {v, {a, e}};
      pieces.push_back(region_from(j + 1, want, part));
    }
    TORCH_INTERNAL_ASSERT(!pieces.empty());
    return pieces.size() == 1 ? pieces[0] : at::cat(pieces, dims_[j].dim);
  }

  DeviceMesh mesh_;
  std::vector<BlockDim> dims_;
  PadMode mode_;
  double fill_;
  int64_t count_ = 1, own_ = 0;
  std::vector<at::Tensor> blocks_;
  std::vector<std::optional<comm::HaloExchangeInFlight>> pending_;
  std::vector<char> exchanged_, used_;
};

}  // namespace shardtensor::ops::stencil
