#pragma once
/// \file The transport: the one seam between shardtensor and MPI.
///
/// Non-differentiable data movement on **contiguous tensors** over a Comm.
/// Buffers on another device than the CPU are moved through host copies
/// inside each function (Note [host staging] in transport_mpi.cpp). Everything above comm/ reaches
/// the network only through the differentiable primitives (shardtensor/comm/primitives.h), and
/// those reach it only through the functions declared here.
///
/// Note [transport seam]
/// ~~~~~~~~~~~~~~~~~~~~~
/// The interface is deliberately small and speaks in tensors and byte counts,
/// not in raw pointers or MPI datatypes, so that another backend can slot in
/// underneath without touching the primitives:
///  - CUDA-aware MPI: the same calls on device pointers once the CPU check is
///    relaxed (and a stream synchronisation before each call);
///  - NCCL: all_reduce_/all_gatherv/reduce_scatter/broadcast_ map one to one,
///    all_to_allv and the split-phase exchange become ncclGroupStart/End of
///    ncclSend/ncclRecv (the PendingExchange then holds a CUDA event);
///  - device tensors with a host-only transport: staged through pinned host
///    buffers inside these functions (done: Note [host staging]).
/// Comm is the only MPI type in the interface: it names the group and is
/// what a backend would key its own communicator cache on. Data always moves
/// as MPI_BYTE; only the reductions need the element type.
///
/// Note [traffic accounting]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~
/// Every function records this rank's traffic with detail::record_comm() so
/// that tests can assert on bytes, not seconds. The numbers model what must
/// leave and arrive at this rank under a bandwidth-optimal direct (pairwise)
/// algorithm, independently of what the MPI library does internally, so they
/// are deterministic and identical for any MPI:
///  - Bytes are payload bytes in the caller's dtype (half/bfloat16 count 2
///    bytes per element even though reductions upcast them to float).
///  - Nothing sent to or received from this rank itself is counted, so a
///    communicator of size 1 counts nothing.
///  - `messages` counts non-empty sends only (receives are the other side's
///    messages).
///  - point-to-point (start_exchange): exact payload bytes of every non-empty
///    send/receive to/from another rank; one message per non-empty send.
///  - all_gatherv: sends its own piece (b_me bytes) to P-1 peers:
///    sent = (P-1)*b_me, received = sum_{c != me} b_c, messages = P-1 if b_me > 0.
///  - reduce_scatter: sends every peer its piece of this rank's summand and
///    receives P-1 contributions to its own piece: sent = sum_{c != me} b_c,
///    received = (P-1)*b_me, messages = #{c != me : b_c > 0}.
///  - all_reduce_: reduce-scatter followed by all-gather over element chunks
///    split balanced-block (balanced_sizes(numel, P)); with N total bytes and
///    b_me this rank's chunk: sent = received = N + (P-2)*b_me (about
///    2N(P-1)/P, the ring all-reduce volume); messages = #{c != me : b_c > 0}
///    + (P-1 if b_me > 0).
///  - all_to_allv: sum of send / receive counts to / from other ranks;
///    messages = #{peers != me with a non-empty send}.
///  - broadcast_: the root sends N bytes to each of P-1 peers (messages = P-1
///    if N > 0); every other rank receives N bytes.
///  - scatterv: the root sends each other rank its piece; each other rank
///    receives its piece.
///  - Diagnostics (diagnostic_max_) are not counted, so the counters are the
///    same with and without SHARDTENSOR_DEBUG.
///  - Time: every data-moving MPI call (and posting plus waiting for an
///    exchange) adds its wall time to CommStats::comm_seconds. Unlike the
///    byte counts this is a measurement, includes waiting for slower ranks,
///    and is meant for benchmarks (bench/), never for test assertions.

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>
#include "comm/mpi_types.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace shardtensor::comm::c10d {
class Exchange;
}

namespace shardtensor::comm::transport {

/// Tag used by start_exchange() unless told otherwise. MPI keeps messages
/// between one pair of ranks with one tag in order, so successive exchanges on
/// one communicator match as long as every rank posts them in the same order.
constexpr int kExchangeTag = 7031;

/// Note [no lazy bits in buffers]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// The transport moves raw bytes, so a buffer must hold its values: not a
/// libtorch lazy conjugate or negative view (is_conj(), is_neg()), whose bytes
/// are the unconjugated / unnegated values. contiguous() keeps those bits;
/// clone() and copy_() resolve them. Pieces are resolved where they are
/// wrapped (Note [no lazy bits in pieces]), but gradients reach the primitives'
/// backward as plain tensors: libtorch's complex backward formulas return conj
/// views (logcumsumexp_backward ends in output.conj()), and sending one
/// conjugated every gradient it carried (fuzz seed 300423 at np3: a complex
/// logcumsumexp on a replicated tensor after a sum over an uneven sharded dim
/// and a gathering fallback). Every send buffer is made with send_buffer(),
/// and the transport raises on a buffer that still carries a lazy bit.
///
/// Local. `t`'s values as a contiguous tensor with no lazy conj/neg bit (`t`
/// itself when it is one already).
inline at::Tensor send_buffer(const at::Tensor& t) {
  return t.resolve_conj().resolve_neg().contiguous();
}

/// Local. Size of and this process's rank in `comm`. Throw c10::Error on MPI failure.
int comm_size(Comm comm);
int comm_rank(Comm comm);

/// Collective over `comm`. In-place element-wise reduction of `t` (contiguous,
/// CPU) over all ranks. Supports float, double, int8/16/32/64, uint8 and bool
/// (Sum/Max are logical or, Min/Product logical and); half and bfloat16 are
/// reduced in float and rounded back; complex64/complex128 support Sum and
/// Product only. Floating and complex values are combined in rank order on
/// the owner of each chunk (Note [ordered sums] in transport_mpi.cpp): the
/// same bits on every rank and under either transport. Throws c10::Error for
/// other dtypes, non-contiguous or non-CPU tensors, and MPI failures.
void all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm);

/// Collective over `comm`. All-gatherv of bytes: rank c contributes `send`
/// (recv_bytes[c] bytes); `recv` (contiguous, at least sum(recv_bytes) bytes)
/// receives the pieces concatenated in rank order, i.e. along dim 0 of a
/// row-major buffer. Throws if send.nbytes() != recv_bytes[me], a count
/// exceeds INT_MAX bytes, or MPI fails.
void all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, Comm comm);

/// Collective over `comm`. All-gatherv of rows into a strided layout, for a
/// gather along a dim that is not the outermost: `recv` (contiguous) is read
/// as [outer, R, row_bytes] bytes with R = sum(rows), and rank c's rows[c]
/// rows land at row offset rows[0] + ... + rows[c-1] of every outer slice.
/// `send` holds this rank's rows as [rows[me], outer, row_bytes] (row-major).
/// Equivalent to all_gatherv of the pieces followed by a transposing copy of
/// the whole result, without that copy: an MPI vector datatype scatters the
/// received bytes into place (Note [strided gather]). Throws like
/// all_gatherv, and if send.nbytes() != rows[me] * outer * row_bytes or
/// recv.nbytes() < R * outer * row_bytes.
void all_gatherv_rows(const at::Tensor& send, const at::Tensor& recv,
                      const std::vector<int64_t>& rows, int64_t outer, int64_t row_bytes,
                      Comm comm);

/// Collective over `comm`. All-to-allv of bytes: send_bytes[c] bytes at byte
/// offset send_displs[c] of `send` go to rank c, which stores them at
/// recv_displs[me] of its `recv`; recv_bytes[c] must equal what c sends here.
/// Throws on inconsistent lengths, buffers too small, counts or displacements
/// above INT_MAX bytes, or MPI failure.
void all_to_allv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
                 const std::vector<int64_t>& send_displs, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs,
                 Comm comm);

/// Collective over `comm`. Overwrites `t` (contiguous, same nbytes on every
/// rank) with the root's bytes.
void broadcast_(const at::Tensor& t, int root, Comm comm);

/// Collective over `comm`. The root sends send_bytes[c] bytes of `send`
/// (consecutive, in rank order) to rank c, which receives them into `recv`
/// (recv.nbytes() bytes). `send` and `send_bytes` are read on the root only.
void scatterv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, Comm comm);

/// Collective over `comm`. Element-wise reduction of `send` over all ranks,
/// rank c keeping elements [sum(recv_numel[:c]), +recv_numel[c]) in `recv`
/// (a reduce-scatter along dim 0 of a row-major buffer). Same dtypes as
/// all_reduce_(); `send` and `recv` share a dtype.
void reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                    const std::vector<int64_t>& recv_numel, ReduceOp op, Comm comm);

/// Collective over `comm`, uncounted: in-place max of a few int64 values. For
/// diagnostics only (the SHARDTENSOR_DEBUG fingerprint check).
void diagnostic_max_(std::vector<int64_t>& values, Comm comm);

/// One side of a point-to-point transfer: the whole of `buffer` (contiguous,
/// CPU) goes to / comes from rank `peer` of the communicator.
struct PeerBuffer {
  int peer = 0;
  at::Tensor buffer;
};

/// A split-phase point-to-point exchange in flight (like PETSc's
/// DMGlobalToLocalBegin/End or AMReX's FillBoundary_nowait/_finish). Holds
/// references to its buffers until it completes. Move-only.
class PendingExchange {
 public:
  PendingExchange() = default;
  PendingExchange(PendingExchange&& other) noexcept;
  PendingExchange& operator=(PendingExchange&& other) noexcept;
  PendingExchange(const PendingExchange&) = delete;
  PendingExchange& operator=(const PendingExchange&) = delete;
  /// If still pending (finish() was never reached, e.g. during stack
  /// unwinding), cancels the receives and waits for the sends; never throws.
  ~PendingExchange();

  /// Local. Waits for every send and receive. Throws c10::Error if MPI fails
  /// or a receive got a different number of bytes than its buffer holds.
  /// A second call does nothing.
  void finish();
  /// Local. True between start_exchange() and finish().
  bool pending() const;
  /// Local, non-blocking (MPI_Testall). Lets MPI progress the transfers, so
  /// that they advance while the caller computes (many MPI libraries move
  /// large messages only inside MPI calls), and returns true once all have
  /// completed. finish() must still be called; after a true test() it does
  /// not wait. Throws c10::Error if MPI fails.
  bool test();

 private:
  friend PendingExchange start_exchange(const std::vector<PeerBuffer>& sends,
                                        const std::vector<PeerBuffer>& recvs, Comm comm, int tag);
  friend PendingExchange start_neighbor_exchange(const class NeighborExchange& x,
                                                 const at::Tensor& send, const at::Tensor& recv,
                                                 Comm graph);
  void abandon() noexcept;
  void finish_transfers();

  std::vector<MpiRequest> requests_;     // receives first, then sends
  std::vector<int64_t> expected_bytes_;  // per receive
  std::vector<at::Tensor> buffers_;      // keep-alive
  std::vector<MpiStatus> statuses_;      // kept by a test() that saw completion
  std::vector<int> peers_;               // per request, for the watchdog's message
  Comm comm_ = comm_null();
  bool completed_ = false;
  bool collective_ = false;               // one neighbourhood-collective request (not cancellable)
  std::shared_ptr<c10d::Exchange> c10d_;  // the messages, on a c10d group (Note [c10d handles])
  // Copies of staged receive buffers back to their device, run by finish()
  // (Note [host staging]).
  std::vector<std::function<void()>> copy_back_;
};

/// Point-to-point over `comm`: posts MPI_Irecv for every entry of `recvs`, then
/// MPI_Isend for every entry of `sends`, and returns without waiting. Every
/// peer named must post the matching operation (same byte count; with several
/// messages between one pair, in the same order). Empty buffers are skipped
/// on both sides. The buffers must not be touched until finish(). Throws
/// c10::Error on invalid peers, non-contiguous or non-CPU buffers, messages
/// above INT_MAX bytes, or MPI failure.
PendingExchange start_exchange(const std::vector<PeerBuffer>& sends,
                               const std::vector<PeerBuffer>& recvs, Comm comm,
                               int tag = kExchangeTag);

/// A non-blocking in-place all-reduce in flight (MPI_Iallreduce). Holds a
/// reference to its buffer until it completes. Move-only.
class PendingReduce {
 public:
  PendingReduce() = default;
  PendingReduce(PendingReduce&& other) noexcept;
  PendingReduce& operator=(PendingReduce&& other) noexcept;
  PendingReduce(const PendingReduce&) = delete;
  PendingReduce& operator=(const PendingReduce&) = delete;
  /// If still pending, waits for it (never throws).
  ~PendingReduce();
  /// Local. Waits until the reduction is complete and `t` holds the sum.
  /// Throws c10::Error if MPI fails. A second call does nothing.
  void finish();
  /// Local. Drives MPI progress; true once the reduction is complete. An
  /// ordered sum (Note [ordered sums]) only progresses its reduce-scatter
  /// here and stays false until finish(), which starts its all-gather.
  bool test();
  bool pending() const {
    return request_ != null_request() || wide_.defined() || phase_ != nullptr ||
           staged_device_.defined();
  }

 private:
  friend PendingReduce start_all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm);
  /// Ordered sums (Note [ordered sums]): the reduce-scatter finished, start
  /// the all-gather of the chunks back into buffer_.
  void start_gather_phase();
  void finish_reduction();

  MpiRequest request_ = null_request();
  Comm comm_ = comm_null();  // for the watchdog's message
  at::Tensor buffer_;        // keep-alive (the caller's tensor)
  at::Tensor wide_;          // float staging buffer for half/bfloat16, copied back by finish()
  // Ordered sums: a reduce-scatter into chunk_, then an all-gather of the chunks.
  std::shared_ptr<class PendingCollective> phase_;
  at::Tensor chunk_;
  std::vector<int64_t> chunk_bytes_;
  bool gathering_ = false;
  // A buffer on a device and the host copy reduced in its place, copied back
  // by finish() (Note [host staging]).
  at::Tensor staged_device_, staged_host_;
};

/// Collective over `comm`: starts all_reduce_() of `t` without waiting, in
/// place, with all_reduce_()'s arithmetic: floating and complex values (and
/// every dtype on a c10d group) as a reduce-scatter whose all-gather
/// finish() starts (Note [ordered sums]); integer and
/// bool values by MPI_Iallreduce. Every rank must start its non-blocking
/// reductions on `comm` in the same order. `t` must not be touched until
/// finish(). Counted like all_reduce_() when started. Same dtypes and errors
/// as all_reduce_(); integer tensors above INT_MAX elements are reduced
/// blocking.
PendingReduce start_all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm);

/// A non-blocking all-gatherv or reduce-scatter in flight (started by
/// start_all_gatherv() / start_reduce_scatter()): what fully_shard's prefetch
/// and its overlapped gradient reduction need (Note [fully_shard prefetch] in
/// nn/fully_shard.cpp). Holds references to its buffers until it completes.
/// finish() gives exactly what the blocking call gives: the blocking calls
/// are start + finish. Move-only.
class PendingCollective {
 public:
  PendingCollective();
  PendingCollective(PendingCollective&& other) noexcept;
  PendingCollective& operator=(PendingCollective&& other) noexcept;
  PendingCollective(const PendingCollective&) = delete;
  PendingCollective& operator=(const PendingCollective&) = delete;
  /// If still pending, waits for it (watchdog-bounded; never throws).
  ~PendingCollective();
  /// Local. Waits until the operation is complete and its receive buffer
  /// holds the result. Throws c10::Error if the transport fails. A second
  /// call does nothing.
  void finish();
  /// Local. Drives MPI progress; true once the transfers completed (a c10d
  /// operation reports "not yet" until finish(), as PendingExchange does).
  bool test();
  bool pending() const;

 private:
  friend PendingCollective start_all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                                             const std::vector<int64_t>& recv_bytes, Comm comm);
  friend PendingCollective start_reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                                                const std::vector<int64_t>& recv_numel, ReduceOp op,
                                                Comm comm);
  void wait() noexcept;
  int wait_requests();  // watchdog-bounded; MPI's return code; throws carried errors

  std::vector<MpiRequest> requests_;      // one collective, or point-to-point messages
  std::vector<int> peers_;                // per point-to-point request, for the watchdog
  Comm comm_ = comm_null();               // for the watchdog's message
  const char* what_ = "";                 // the primitive and MPI call, for messages
  std::vector<at::Tensor> keep_;          // keep-alive of the buffers
  std::shared_ptr<c10d::Exchange> c10d_;  // the messages, on a c10d group
  std::function<void()> then_;            // run by finish() after the transfers (a copy, a sum)
};

/// Collective over `comm`: all_gatherv() split in two. Starts it and returns
/// at once; finish() completes it. Every rank must start its collectives on
/// `comm` in the same order (blocking ones included); neither buffer may be
/// touched until finish(). Counted when started. Same arguments and errors
/// as all_gatherv(). The paths that move large counts point-to-point
/// (Note [large counts]) complete before it returns.
PendingCollective start_all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                                    const std::vector<int64_t>& recv_bytes, Comm comm);

/// Collective over `comm`: reduce_scatter() split in two, like
/// start_all_gatherv(). Same arguments, errors and result (bit for bit) as
/// reduce_scatter().
PendingCollective start_reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                                       const std::vector<int64_t>& recv_numel, ReduceOp op,
                                       Comm comm);

/// Local, for tests only. Sets the largest count (elements for reductions,
/// bytes otherwise) that one MPI call may carry (Note [large counts] in
/// transport_mpi.cpp; default and maximum INT_MAX) and returns the previous
/// value, so that the chunked and point-to-point paths can be exercised with
/// small tensors. Set the same value on every rank. Throws c10::Error outside
/// [1, INT_MAX].
int64_t set_max_count_for_testing(int64_t max_count);

// ---- communicator management (appended; issue 10) ---------------------------

/// Collective over `comm`. A duplicate of `comm` (MPI_Comm_dup) for a stream
/// of operations that must not match anyone else's (e.g. the gradient buckets'
/// non-blocking reductions). Free it with free_duplicate(). Throws c10::Error
/// on MPI failure.
Comm duplicate(Comm comm);

/// Local (MPI_Comm_free is collective in name only). Frees a communicator
/// made by duplicate() and sets it to comm_null(); does nothing for
/// comm_null() or once MPI is finalized. Never throws.
void free_duplicate(Comm& comm) noexcept;

/// Local. Communicators made by duplicate() and not yet freed.
int64_t live_duplicates();

// ---- neighbourhood collectives (issue 13; Note [neighbourhood collectives] in halo.cpp) ----

/// Collective over `comm` when not cached: the distributed-graph communicator
/// (MPI_Dist_graph_create_adjacent, no reordering) in which this rank receives
/// from `sources` and sends to `destinations` (ranks of `comm`, each at most
/// once; the order is the order of the neighbour buffers). Graphs are cached
/// on `comm` itself (an MPI attribute, freed with it) under `key`, which must
/// be identical on every rank of `comm` for the same call and determine every
/// rank's neighbours: a communicator's cache then holds the same keys on every
/// rank, so a miss (the collective creation) happens on all of them together.
/// At most kMaxNeighborGraphs graphs per communicator: beyond that, returns
/// comm_null() (on every rank alike) and the caller falls back to
/// start_exchange(). The handle stays valid while `comm` lives. Throws
/// c10::Error on MPI failure.
Comm neighbor_graph(Comm comm, const std::vector<int64_t>& key, const std::vector<int>& sources,
                    const std::vector<int>& destinations);

constexpr int kMaxNeighborGraphs = 64;

/// Local. The largest message one MPI call may carry, in bytes (INT_MAX, or
/// what set_max_count_for_testing() set; Note [large counts]). A neighbourhood
/// exchange sends each peer's message whole, so callers use it only when every
/// message of every rank fits.
int64_t max_message_bytes();

/// Local. Graphs cached on `comm` by neighbor_graph() (tests).
int64_t neighbor_graph_count(Comm comm);

/// Local, callable before MPI_Init. False where the MPI library is known to
/// reject the derived datatypes of start_neighbor_exchange() (Open MPI 5.0:
/// Note [neighbourhood collectives on Open MPI 5.0]); the halo then keeps its
/// point-to-point path. Never throws.
bool neighbor_collectives_usable();

/// Rows of a contiguous tensor read as [outer, rows, row_bytes] bytes: `count`
/// rows from row `first`, going up (step = 1) or down (step = -1).
struct RowRun {
  int64_t first = 0;
  int64_t count = 0;
  int step = 1;
};

/// The layout of a neighbourhood exchange of row runs between a tensor read
/// as [outer, send_rows, row_bytes] and one read as [outer, recv_rows,
/// row_bytes]: per destination of the graph the runs sent, per source the
/// runs received (in both, every run's rows for outer index 0, then 1, ...;
/// a sender's and its receiver's runs for one message must agree in number
/// and counts). Holds one committed MPI derived datatype per neighbour, so
/// data moves without packing. Built once per plan and element size.
class NeighborExchange {
 public:
  /// Local. Throws c10::Error on MPI failure or counts above INT_MAX.
  NeighborExchange(int64_t outer, int64_t send_rows, int64_t recv_rows, int64_t row_bytes,
                   const std::vector<std::vector<RowRun>>& sends,
                   const std::vector<std::vector<RowRun>>& recvs);
  /// Frees the datatypes (unless MPI is finalized). Never throws.
  ~NeighborExchange();
  NeighborExchange(const NeighborExchange&) = delete;
  NeighborExchange& operator=(const NeighborExchange&) = delete;

 private:
  friend PendingExchange start_neighbor_exchange(const NeighborExchange& x, const at::Tensor& send,
                                                 const at::Tensor& recv, Comm graph);
  int64_t send_bytes_ = 0, recv_bytes_ = 0;  // the tensors' sizes
  // The receive layout, for copying staged receives back (Note [host staging]).
  int64_t outer_ = 0, recv_rows_ = 0, row_bytes_ = 0;
  std::vector<std::vector<RowRun>> recv_runs_;
  std::vector<MpiDatatype> send_types_, recv_types_;
  std::vector<int> send_counts_, recv_counts_;      // 1, or 0 for nothing
  std::vector<MpiAint> send_displs_, recv_displs_;  // 0: the types hold the offsets
  std::vector<int64_t> sent_, received_;            // payload bytes per neighbour
};

/// Collective over `graph` (from neighbor_graph(), whose sources and
/// destinations are the order of `x`'s receives and sends): starts
/// MPI_Ineighbor_alltoallw from `send` into `recv` (contiguous CPU tensors of
/// the byte sizes `x` was built for) and returns without waiting; finish()
/// or test() as for start_exchange(). Counted like start_exchange(). A
/// collective request cannot be cancelled: destroying the result unfinished
/// waits for it (under the watchdog, Note [abandoned exchange]). Throws
/// c10::Error on wrong buffers or MPI failure.
PendingExchange start_neighbor_exchange(const NeighborExchange& x, const at::Tensor& send,
                                        const at::Tensor& recv, Comm graph);

}  // namespace shardtensor::comm::transport
