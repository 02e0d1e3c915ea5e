#pragma once
/// \file The c10d transport: libtorch's own process groups (Gloo on CPU) under
/// the transport seam (Note [transport seam] in comm/transport.h). Private to
/// the library; only comm/ and the runtime use it.
///
/// Note [c10d handles]
/// ~~~~~~~~~~~~~~~~~~~
/// The transport seam names a group of ranks with an `Comm`. Under the
/// c10d transport there is no MPI: MPI is never initialized, and a group is a
/// c10d::ProcessGroup owned by this file. So that the code above the seam
/// (meshes, plans, caches keyed on the handle's bits) needs no change, a c10d
/// group is named by an `Comm`-typed handle that is the address of its
/// record here. Such a handle is never given to MPI: every MPI call on a
/// mesh's communicators sits behind the seam, and each function of the seam
/// asks owns() first and takes the c10d path. `MPI_COMM_WORLD` passed to
/// DeviceMesh::create() means the c10d world under this transport. This is a
/// transitional naming: the plan in docs/transport_c10d.md replaces
/// `Comm` in the seam with an opaque communicator type (its step 1), which
/// `SHARDTENSOR_WITH_MPI=OFF` needs.
///
/// Note [c10d data movement]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~
/// Every operation is built from point-to-point Gloo send/recv of byte
/// tensors (no Gloo collective), for three reasons:
///  - one code path, whose semantics we control, for every primitive;
///  - empty pieces need no special case (an empty message is not sent, as on
///    the MPI path), where c10d collectives take equal or non-empty buffers;
///  - reductions are ours: a reduce-scatter sends each owner its chunk of
///    every rank's summand and the owner adds the contributions in rank order
///    0..P-1; an all-reduce is that reduce-scatter over balanced chunks
///    followed by an all-gather. Every rank therefore holds bit-identical
///    results, independent of Gloo's algorithms, and the order is defined by
///    this file, not by a library.
/// Traffic is the direct (pairwise) volume that Note [traffic accounting]
/// counts, so comm_stats are the same as under MPI by construction (the
/// counting stays in transport_mpi.cpp's functions, around either path).
/// Messages between one pair with one tag arrive in posting order (Gloo's
/// pairs keep order per slot); collectives use their own tag, separate from
/// split-phase exchanges, so that an exchange in flight never matches one.
///
/// Waits are bounded like MPI's (Note [watchdog]): Gloo progresses messages in
/// its own threads, so a wait is one Work::wait with the time left until the
/// deadline. When the deadline passes the rank prints the watchdog line and
/// ends the job (kWatchdogExitCode): a Gloo timeout closes the pair, so the
/// group cannot be used again anyway. A peer that died shows up as a closed
/// connection (at a wait or when posting): the rank names the call and the
/// dead rank and ends itself (Note [flight recorder]). Carried errors (Note
/// [carried errors]) travel through the rendezvous store: while a wait lasts,
/// a monitor thread reads the store every kStorePollSeconds and, when it finds
/// an error of a call this rank has entered, aborts the Gloo waits
/// (Work::abort) so that the wait raises it; the abandoned exchange's buffers
/// are kept alive, since its messages may still land.

#include "core/process_groups.h"

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/core/comm.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtensor::comm::c10d {

using detail::pg::owns;

/// One message: the whole of `buffer` (contiguous, CPU) to / from group rank `peer`.
struct Message {
  int peer = 0;
  at::Tensor buffer;
};

/// Point-to-point messages in flight (Gloo send/recv works). Move-only.
class Exchange {
 public:
  Exchange();
  ~Exchange();  // waits for what is still in flight (watchdog-bounded); never throws
  Exchange(Exchange&&) noexcept;
  Exchange& operator=(Exchange&&) noexcept;
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  /// Local. Waits for every message (watchdog-bounded, Note [c10d data
  /// movement]). `what` names the primitive in messages. Throws c10::Error
  /// when a peer closed its connection or Gloo fails. A second call does nothing.
  void finish(const char* what);
  /// Local. True from start() until finish().
  bool pending() const;
  /// Local. True when nothing is in flight (every message was local or empty).
  bool arrived() const;

 private:
  struct Impl;
  friend Exchange start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                        Comm comm, int tag);
  std::unique_ptr<Impl> impl_;
};

/// Point-to-point over a c10d group: posts every receive, then every send,
/// and returns. Empty buffers are skipped; messages to this rank itself are
/// copied locally, matched in order with the receives from itself. Throws
/// c10::Error on a bad peer or buffer.
Exchange start(const std::vector<Message>& sends, const std::vector<Message>& recvs, Comm comm,
               int tag);

/// Collective, blocking. The operations of comm/transport.h on c10d groups,
/// built on start()/finish() (Note [c10d data movement]). Arguments are
/// validated by the transport before it calls these; they only move data.
void all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, Comm comm);
/// The two halves of all_gatherv() and reduce_scatter(), for the
/// transport's split-phase collectives (PendingCollective): start posts the
/// messages; finish the returned exchange, then (reduce-scatter)
/// finish_reduce_scatter() sums `contributions` in rank order into `recv`.
Exchange start_all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                           const std::vector<int64_t>& recv_bytes, Comm comm);
Exchange start_reduce_scatter(const at::Tensor& send, const std::vector<int64_t>& recv_numel,
                              Comm comm, at::Tensor& contributions);
void finish_reduce_scatter(const at::Tensor& contributions, const at::Tensor& recv, ReduceOp op);
void all_to_allv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
                 const std::vector<int64_t>& send_displs, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs,
                 Comm comm);
void broadcast_(const at::Tensor& t, int root, Comm comm);
void scatterv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, Comm comm);
/// `send` and `recv` are contiguous CPU tensors of one dtype; rank c keeps
/// elements [sum(recv_numel[:c]), +recv_numel[c]) reduced in rank order.
void reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                    const std::vector<int64_t>& recv_numel, ReduceOp op, Comm comm);
/// In place, over balanced chunks (reduce_scatter then all_gatherv).
void all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm);
void barrier(Comm comm);

}  // namespace shardtensor::comm::c10d
