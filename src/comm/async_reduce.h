#pragma once
/// \file Non-blocking all-reduce on a private channel (private): what the
/// gradient buckets of distribute_module (nn/, Note [gradient buckets]) need
/// from the network, without the transport or MPI.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include "comm/in_flight.h"

namespace shardtensor::comm {

/// A non-blocking in-place sum in flight (test(), finish(); see comm/in_flight.h).
using PendingSum = InFlight<transport::PendingReduce>;

/// A duplicate of a mesh's communicator (MPI_Comm_dup) on which a stream of
/// non-blocking reductions runs without matching anyone else's operations.
/// Not copyable or movable (it owns the communicator).
class ReduceChannel {
 public:
  /// Collective over every rank of `mesh` (duplicates mesh.comm()). Throws
  /// c10::Error on MPI failure.
  explicit ReduceChannel(const DeviceMesh& mesh);
  /// Local. Frees the duplicate (unless MPI is already finalized).
  ~ReduceChannel();
  ReduceChannel(const ReduceChannel&) = delete;
  ReduceChannel& operator=(const ReduceChannel&) = delete;

  /// Collective over the channel: starts the in-place sum of `t` (contiguous
  /// CPU; float, double, integer, bool, half, bfloat16) over all ranks and
  /// returns at once (MPI_Iallreduce). Every rank must start its sums on one
  /// channel in the same order; `t` must not be touched until finish().
  /// Counted like an all-reduce when started.
  PendingSum start_sum_(const at::Tensor& t);

 private:
  MPI_Comm comm_;
};

}  // namespace shardtensor::comm
