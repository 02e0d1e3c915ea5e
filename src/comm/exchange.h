#pragma once
/// \file Split-phase block exchange with neighbours (private): the
/// point-to-point form of Note [transport seam] for the layers above comm/
/// (the overlapped convolution, Note [conv overlap]), without the transport.
///
/// Like PETSc's VecScatterBegin/End or AMReX's FillBoundary_nowait/_finish:
/// start_block_exchange() posts every receive and send and returns; local
/// compute runs while the blocks travel (test() drives MPI progress); finish()
/// waits. Not differentiable: the caller owns the adjoint (it sends the
/// gradient blocks back with a second exchange).

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <vector>

#include "comm/in_flight.h"

namespace shardtensor::comm {

/// One side of a transfer: the whole of `buffer` (contiguous CPU) goes to /
/// comes from `peer`, a rank of mesh.comm() (DeviceMesh::rank_of).
struct PeerBlock {
  int peer = 0;
  at::Tensor buffer;
};

/// A block exchange in flight (test(), finish(); see comm/in_flight.h).
using BlockExchange = InFlight<transport::PendingExchange>;

/// Point-to-point over mesh.comm(): posts a receive into every entry of
/// `recvs` and a send of every entry of `sends`, and returns at once. Every
/// peer named must post the matching operation with the same `tag` and byte
/// count (several messages between one pair match in posting order). Empty
/// buffers are skipped on both sides; no entries at all is a no-op. The
/// buffers must not be touched until finish(). Counted in CommStats (exact
/// payload bytes). Throws c10::Error on invalid peers, non-contiguous or
/// non-CPU buffers, or MPI failure.
BlockExchange start_block_exchange(const DeviceMesh& mesh, const std::vector<PeerBlock>& sends,
                                   const std::vector<PeerBlock>& recvs, int tag);

}  // namespace shardtensor::comm
