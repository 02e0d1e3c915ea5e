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
  Comm comm_;
};

/// A split-phase all-gather or reduce-scatter in flight (test(), finish();
/// see comm/in_flight.h).
using PendingCollective = InFlight<transport::PendingCollective>;

/// Collective over mesh dim `mesh_dim` (every rank of `mesh`, each in its own
/// group along that dim): starts the all-gather of equal 1-D pieces and
/// returns at once. `out` (1-D, contiguous, piece.numel() * D elements, D =
/// mesh.size(mesh_dim)) receives the pieces in coordinate order after
/// finish(). Every rank must start its collectives on that dim in the same
/// order, blocking ones included; neither tensor may be touched until
/// finish(). Counted like an all-gather when started. Throws c10::Error on
/// shapes that do not fit or transport failure. For fully_shard's prefetch
/// (Note [fully_shard prefetch]).
PendingCollective start_all_gather_flat(const at::Tensor& piece, const at::Tensor& out,
                                        const DeviceMesh& mesh, int64_t mesh_dim);

/// Collective over mesh dim `mesh_dim`, like start_all_gather_flat(): starts
/// the reduce-scatter (sum) of `full` (1-D, contiguous, D * out.numel()
/// elements) so that `out` receives the sum of every rank's elements
/// [c n, (c + 1) n) at coordinate c, bit for bit what the blocking
/// comm::reduce_scatter gives.
PendingCollective start_reduce_scatter_flat(const at::Tensor& full, const at::Tensor& out,
                                            const DeviceMesh& mesh, int64_t mesh_dim);

}  // namespace shardtensor::comm
