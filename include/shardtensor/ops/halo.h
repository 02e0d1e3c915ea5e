#pragma once
/// \file Halo exchange on a ShardTensor: the building block of custom stencil
/// layers (docs/custom_layers.md).

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>

#include <cstdint>

namespace shardtensor {

/// This rank's local piece of the ShardTensor `t`, extended along tensor dim
/// `dim` by `left` elements before and `right` elements after it, taken from
/// the neighbouring pieces (several of them when a halo is wider than a
/// neighbour: multi-hop). Where the extended range crosses the global edge of
/// the domain it is filled per `mode` (`value` for PadMode::Constant; Circular
/// wraps to the far end of the global domain). Negative `left`/`right` trim.
///
/// **Collective** over the mesh dim that shards `dim` (every rank of that mesh
/// dim must call it with the same arguments); when no mesh dim shards `dim`
/// the call is **local** (a plain pad of the local piece). A Partial `t` is
/// first summed (collective over its Partial mesh dims).
///
/// Returns a plain local tensor (not a ShardTensor), connected to autograd:
/// its backward is the halo accumulate (every halo gradient is sent back to
/// the rank that owns the element and summed there).
///
/// Throws c10::Error, on every rank and before any communication, if `t` is
/// not a ShardTensor, `dim` is out of range, a halo is negative beyond the
/// piece's own extent, or a PadMode::Reflect halo reaches past n - 1 elements
/// (or the extent n < 2).
at::Tensor halo_exchange(const at::Tensor& t, int64_t dim, int64_t left, int64_t right,
                         PadMode mode = PadMode::Constant, double value = 0.0);

/// A halo exchange started by halo_exchange_begin(). Move-only.
class PendingHaloExchange {
 public:
  /// Local, non-blocking: drives MPI progress; true once the halos arrived.
  bool test();

 private:
  friend PendingHaloExchange halo_exchange_begin(const at::Tensor&, int64_t, int64_t, int64_t,
                                                 PadMode, double);
  friend at::Tensor halo_exchange_end(PendingHaloExchange&);
  comm::HaloExchangeInFlight in_flight_;
  at::Tensor ready_;  // an unsharded dim: the padded piece, no messages
  bool sharded_ = false;
  bool ended_ = false;
};

/// Split-phase halo_exchange (Note [split-phase halo]), like PETSc's
/// DMGlobalToLocalBegin/End and AMReX's FillBoundary_nowait/_finish: posts
/// the exchange and returns at once, so the caller can compute on the
/// interior of its piece while the halos travel; halo_exchange_end() waits
/// and returns exactly what halo_exchange() would, with the same gradient.
///
/// ```cpp
/// auto pending = st::halo_exchange_begin(u, 2, 1, 1);
/// auto interior = stencil(st::ShardTensor(u).local());   // overlaps the messages
/// auto ext = st::halo_exchange_end(pending);               // [rows + 2] along dim 2
/// ```
///
/// **Collective** over the mesh dim that shards `dim` (every rank of it must
/// begin, and then end, the same exchange); **local** when no mesh dim shards
/// `dim`. Throws c10::Error as halo_exchange() does, on every rank and before
/// any message.
PendingHaloExchange halo_exchange_begin(const at::Tensor& t, int64_t dim, int64_t left,
                                        int64_t right, PadMode mode = PadMode::Constant,
                                        double value = 0.0);

/// Local: waits for the exchange begun by halo_exchange_begin() and returns
/// this rank's extended piece (a plain local tensor connected to autograd; its
/// backward is the halo accumulate, collective like halo_exchange's). Throws
/// c10::Error if `pending` was already ended.
at::Tensor halo_exchange_end(PendingHaloExchange& pending);

}  // namespace shardtensor
