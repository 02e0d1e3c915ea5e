#pragma once
/// \file Halo plans (private to comm/): who sends which rows to whom so that
/// every coordinate along one mesh dim gets its wanted global index range
/// (the general halo: asymmetric, trimmed, multi-hop, padded per PadMode at
/// the global edges). A HaloPlan is built once from metadata (no
/// communication) and run many times in split phase, like PETSc's
/// VecScatterBegin/End: start() posts the exchange and does the local work,
/// the caller computes, finish() waits and unpacks. The adjoint (halo
/// accumulate) runs the same plan backwards. comm::gather_range and
/// comm::halo_exchange (halo.cpp) are built on it; caching plans by spec and
/// arguments (issue 13) stores these objects.

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "comm/primitive_support.h"

namespace shardtensor::comm {

namespace transport {
class PendingExchange;
class NeighborExchange;
}  // namespace transport

/// A run of the wanted range: `len` positions from `dst` (relative to the range
/// start) come from coordinate `owner` at its local index `src`, going up
/// (dir = +1), down (dir = -1, reflect), or repeating one element (dir = 0,
/// replicate: one row travels, it is expanded on arrival). owner = -1 is a
/// constant fill.
struct Run {
  int64_t dst = 0;
  int64_t owner = -1;
  int64_t src = 0;
  int64_t len = 0;
  int dir = 1;
};

class HaloPlan;

/// A halo exchange (or its adjoint) in flight. Move-only. Destroying one that
/// was not finished cancels the receives and waits for the sends.
class PendingHalo {
 public:
  PendingHalo();
  ~PendingHalo();
  PendingHalo(PendingHalo&&) noexcept;
  PendingHalo& operator=(PendingHalo&&) noexcept;
  /// Local, non-blocking: drives MPI progress; true once the messages arrived.
  bool test();
  /// Local. Waits for the messages and returns the result (forward: this
  /// rank's range; adjoint: the gradient of the local tensor). Call once.
  at::Tensor finish();

 private:
  friend class HaloPlan;
  const HaloPlan* plan_ = nullptr;
  bool adjoint_ = false;
  bool neighbor_ = false;  // received in place by a neighbourhood collective
                           // (Note [neighbourhood collectives] in halo.cpp)
  std::unique_ptr<transport::PendingExchange> pending_;
  std::vector<at::Tensor> recv_;  // per plan.recv (forward) or plan.send (adjoint)
  at::Tensor out_, out_rows_;
};

/// Who sends what to whom for one gather_range call, from this rank's view.
class HaloPlan {
 public:
  /// Local (metadata only: every rank computes its part of the same plan).
  /// The arguments must have been validated (comm::gather_range does).
  static std::shared_ptr<const HaloPlan> build(
      const internal::Axis& a, std::vector<int64_t> local_shape, int64_t dim,
      const std::vector<int64_t>& sizes, const std::vector<std::pair<int64_t, int64_t>>& ranges,
      PadMode mode);

  /// Collective over the plan's mesh dim (point-to-point with the peers that
  /// this rank exchanges with; every coordinate must start the same plan).
  /// Posts the exchange, fills the constant and own parts of the result, and
  /// returns. `local` has the plan's local shape. Not differentiable. The plan
  /// must outlive the returned object.
  PendingHalo start(const at::Tensor& local, double value) const;
  /// start() then finish().
  at::Tensor run(const at::Tensor& local, double value) const;

  /// Local. The neighbourhood-collective layout of start() for elements of
  /// `element_size` bytes (MPI datatypes: built once per size, then cached
  /// in the plan; Note [neighbourhood collectives] in halo.cpp).
  std::shared_ptr<const transport::NeighborExchange> neighbor_exchange(int64_t element_size) const;

  /// Collective like start(): the adjoint (halo accumulate). Every gradient
  /// element of this rank's range goes back to its owner, where it is summed.
  PendingHalo start_adjoint(const at::Tensor& grad_out) const;
  at::Tensor run_adjoint(const at::Tensor& grad_out) const;

  int64_t dim = 0;
  std::vector<int64_t> in_shape;   // this rank's local shape
  std::vector<int64_t> out_shape;  // this rank's result shape
  std::vector<Run> fills;          // constant fills of my range
  std::vector<Run> local;          // runs of my range that I own
  // Runs of my range owned by `peer`, and runs of `peer`'s range owned by me.
  std::vector<std::pair<int, std::vector<Run>>> recv, send;
  Comm comm = comm_null();  // the mesh dim's communicator
  // (mode, sizes, ranges): what every coordinate's peers follow from; the same
  // on every rank for one call (the key of the neighbourhood graph).
  std::vector<int64_t> layout_key;
  int64_t max_range_rows = 0;  // the longest range of any coordinate (global)

 private:
  PendingHalo start_neighbor(const at::Tensor& piece, double value, Comm graph) const;
  mutable std::mutex mu_;  // guards exchanges_
  mutable std::vector<std::pair<int64_t, std::shared_ptr<const transport::NeighborExchange>>>
      exchanges_;  // per element size
};

/// Local. Number of halo plans cached (Note [halo plan cache]); bounded, and
/// constant in steady state (the long-run test asserts it).
size_t halo_plan_cache_size();

}  // namespace shardtensor::comm
