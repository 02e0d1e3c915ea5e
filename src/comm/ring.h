#pragma once
/// \file Split-phase ring shift along one mesh dim (private; used by ring attention).
///
/// Not differentiable: the caller (an autograd Function that circulates its own
/// gradients, e.g. ops/attention.cpp) owns the backward. Built on the
/// transport's split-phase point-to-point exchange (Note [transport seam]), so a
/// step can be started, local compute done, and the step finished.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>

#include "comm/transport.h"

namespace shardtensor::comm {

/// Tags of the two ring streams that may be in flight at once between the same
/// pair of ranks (K/V blocks and dK/dV accumulators); distinct from the halo tag.
constexpr int kRingTagBlocks = 7101;
constexpr int kRingTagAccumulators = 7102;

/// One step of a ring shift in flight: this coordinate c of `mesh_dim` sends a
/// buffer to (c + 1) mod P and receives one from (c - 1) mod P. Move-only.
class RingShift {
 public:
  RingShift() = default;
  RingShift(RingShift&&) noexcept = default;
  RingShift& operator=(RingShift&&) noexcept = default;

  /// Collective over `mesh_dim` (every coordinate calls it, in the same order
  /// per tag): posts the receive of a fresh tensor of shape `recv_shape` (and
  /// `send`'s dtype) from the previous coordinate and the send of `send`
  /// (made contiguous; it must not be modified until finish()) to the next,
  /// and returns at once. The sizes must match what the neighbours send and
  /// expect (empty buffers are skipped on both sides). With one coordinate
  /// the "received" tensor is `send` itself and nothing is communicated.
  static RingShift start(const at::Tensor& send, c10::IntArrayRef recv_shape,
                         const DeviceMesh& mesh, int64_t mesh_dim, int tag);

  /// Local, non-blocking. Lets MPI progress the transfers (call it between
  /// pieces of the overlapped compute); true once both have completed.
  bool progress() { return pending_.test(); }

  /// Local. Waits for both transfers and returns the received tensor. Throws
  /// c10::Error if MPI fails or the received size differs. Call once.
  at::Tensor finish();

 private:
  transport::PendingExchange pending_;
  at::Tensor recv_;
  at::Tensor send_;  // keep-alive
};

}  // namespace shardtensor::comm
