// The MPI transport (see Note [transport seam] in transport.h): the only file
// of the library that moves tensor data through MPI.
#include "comm/transport.h"

#include "comm/transport_c10d.h"
#include "comm/watchdog.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <shardtensor/core/error.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/core/stats.h>
#include <shardtensor/spec/shard_spec.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>

namespace shardtensor::detail {
// MPI_Get_library_version's string; defined in src/core/runtime.cpp (its one home).
std::string mpi_library_version();
}  // namespace shardtensor::detail

namespace shardtensor::comm::transport {

namespace {

/// Adds the wall time of its scope to CommStats::comm_seconds. Wraps every
/// MPI call that moves data or waits for it (always on; two clock reads).
class CommTimer {
 public:
  CommTimer() : start_(std::chrono::steady_clock::now()) {}
  ~CommTimer() {
    detail::record_comm_time(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - start_)
                                 .count());
  }
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  std::chrono::steady_clock::time_point start_;
};

/// Converts a byte or element count to the int that MPI-3 calls take.
int to_count(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0, "shardtensor transport: negative ", what, " (", v, ")");
  TORCH_CHECK(v <= static_cast<int64_t>(INT_MAX), "shardtensor transport: ", what, " of ", v,
              " exceeds the MPI count limit of INT_MAX = ", INT_MAX,
              "; split the tensor into smaller pieces (more ranks or chunks)");
  return static_cast<int>(v);
}

std::vector<int> to_counts(const std::vector<int64_t>& v, const char* what) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = to_count(v[i], what);
  }
  return out;
}

/// Exclusive prefix sum as MPI displacements (checked against INT_MAX).
std::vector<int> prefix_displs(const std::vector<int64_t>& counts, const char* what) {
  std::vector<int> out(counts.size());
  int64_t acc = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = to_count(acc, what);
    acc += counts[i];
  }
  return out;
}

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

// Note [host staging]
// ~~~~~~~~~~~~~~~~~~~
// Both transports move host memory: Gloo's send/recv and an MPI library that
// is not CUDA-aware (Debian's Open MPI) read and write the buffers with the
// CPU. So that no rule above the seam needs to know where its piece lives,
// every function of the seam takes buffers on any device and moves a buffer
// that is not in host memory through a host copy:
//  - a send buffer, or one reduced or overwritten in place, is copied to the
//    host before the call;
//  - a receive buffer is copied back from its host copy when the call has
//    completed: at once for the blocking functions, in finish() for the
//    split-phase ones (which keep the host copies alive until then). A
//    receive buffer that the call does not cover whole is copied to the host
//    first too, so that the bytes it does not write keep their values.
// Host copies of CUDA buffers are pinned (torch's caching host allocator),
// and the copy back is ordered on the current stream. The staging runs
// inside the functions, so the traffic counters (Note [traffic accounting])
// are those of host buffers; the copies themselves are counted in
// CommStats::staged_bytes (one count per copy, each way).
// SHARDTENSOR_STAGE_HOST=1 (read once) stages host buffers too, through fresh
// host copies, so that the CPU test suite runs every staging path
// (test_comm.staged.*, test_tensor.staged.*, ...). The calls a staged call
// makes on its host copies are not staged again (StagedScope).
thread_local int t_staged_depth = 0;

/// Marks the calls made on host copies, which must not be staged again.
struct StagedScope {
  StagedScope() { ++t_staged_depth; }
  ~StagedScope() { --t_staged_depth; }
  StagedScope(const StagedScope&) = delete;
  StagedScope& operator=(const StagedScope&) = delete;
};

bool stage_forced() {
  static const bool forced = [] {
    const char* e = std::getenv("SHARDTENSOR_STAGE_HOST");
    return e != nullptr && *e != '\0' && std::string(e) != "0";
  }();
  return forced;
}

// Note [CUDA-aware MPI]
// ~~~~~~~~~~~~~~~~~~~~~
// An MPI library built with CUDA support reads and writes device memory
// itself, so a CUDA buffer need not move through a host copy. Whether the
// library has it is asked once (mpi_cuda_support()):
//  - SHARDTENSOR_MPI_CUDA_AWARE=1 or 0 decides, for MPIs that cannot be asked
//    (MPICH, Cray MPICH, MVAPICH) or to rule it out;
//  - otherwise Open MPI is asked: MPIX_CUDA_AWARE_SUPPORT in <mpi-ext.h> says
//    whether it was built with CUDA, and MPIX_Query_cuda_support() whether
//    CUDA is enabled at run time. Debian's Open MPI is built without it;
//  - any other MPI counts as not CUDA-aware.
// When it is aware, CUDA buffers of MPI communicators go to MPI directly: the
// current stream of the buffer's device is synchronised first (MPI knows no
// streams, so the kernels that wrote a send buffer, or last used the memory
// of a receive buffer, must have completed), and the transport's own local
// copies go through torch (local_copy()) instead of memcpy. c10d groups are
// Gloo groups (Note [c10d handles]) and always stage CUDA buffers.
// Not run anywhere yet: these machines have neither a GPU nor a CUDA-aware MPI.

/// Whether the MPI of `comm` takes `t` (a CUDA buffer) without a host copy.
bool mpi_takes(const at::Tensor& t, Comm comm) {
  return t.is_cuda() && !c10d::owns(comm) && mpi_cuda_support().aware;
}

/// Whether `t` moves through a host copy on `comm` (Note [host staging]).
bool staged(const at::Tensor& t, Comm comm) {
  if (t_staged_depth != 0 || !t.defined()) return false;
  return t.device().is_cpu() ? stage_forced() : !mpi_takes(t, comm);
}

/// Throws unless `t` is a buffer the transport can hand to `comm` as it is:
/// defined, contiguous, and in host memory, or on a device whose memory the
/// MPI library takes (Note [CUDA-aware MPI]; the device's current stream is
/// then synchronised).
void check_buffer(const at::Tensor& t, const char* what, Comm comm) {
  TORCH_CHECK(t.defined(), "shardtensor transport: ", what, " is undefined");
  if (!t.device().is_cpu()) {
    TORCH_CHECK(mpi_takes(t, comm), "shardtensor transport: ", what,
                " must be a CPU tensor here (a ", t.device(),
                " buffer moves through a host copy unless the MPI library is CUDA-aware: Note "
                "[host staging], Note [CUDA-aware MPI])");
    c10::impl::VirtualGuardImpl guard(t.device().type());
    guard.getStream(t.device()).synchronize();
  }
  TORCH_CHECK(t.is_contiguous(), "shardtensor transport: ", what, " must be contiguous");
  TORCH_CHECK(!t.is_conj() && !t.is_neg(), "shardtensor transport: ", what,
              " carries a lazy conjugate/negative bit (Note [no lazy bits in buffers])");
}

at::Tensor host_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
}

/// The seam's contract holds for every buffer, staged or not.
void check_contiguous(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "shardtensor transport: buffers must be contiguous (got a ",
              t.device(), " tensor of strides ", t.strides(), ")");
}

/// A host copy of `t` holding its values, or `t` itself when it is not staged.
at::Tensor stage_in(const at::Tensor& t, Comm comm) {
  if (!staged(t, comm)) return t;
  check_contiguous(t);
  at::Tensor h = host_like(t);
  h.copy_(t);
  detail::record_staged(nbytes(t));
  return h;
}

/// An uninitialised host buffer for receiving into `t`; only the bytes the
/// call writes are copied back (stage_out_bytes()), so the caller may write
/// the others while a split-phase call is in flight, as with host buffers.
at::Tensor stage_recv(const at::Tensor& t, Comm comm) {
  if (!staged(t, comm)) return t;
  check_contiguous(t);
  return host_like(t);
}

/// `t` (contiguous) as a flat byte tensor sharing its memory.
at::Tensor bytes_of(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

/// Copies `n` bytes from byte `src_off` of `src` to byte `dst_off` of `dst`
/// (both contiguous): memcpy in host memory, torch's copy on a device (Note
/// [CUDA-aware MPI]).
void local_copy(const at::Tensor& dst, int64_t dst_off, const at::Tensor& src, int64_t src_off,
                int64_t n) {
  if (n <= 0) return;
  if (dst.is_cpu() && src.is_cpu()) {
    std::memcpy(static_cast<char*>(dst.data_ptr()) + dst_off,
                static_cast<const char*>(src.data_ptr()) + src_off, static_cast<size_t>(n));
    return;
  }
  bytes_of(dst).narrow(0, dst_off, n).copy_(bytes_of(src).narrow(0, src_off, n));
}

/// Copies bytes [from, from + count) of the host copy `h` back into `t`
/// (nothing when `h` is `t`).
void stage_out_bytes(const at::Tensor& t, const at::Tensor& h, int64_t from, int64_t count) {
  if (!t.defined() || h.is_same(t) || count <= 0) return;
  bytes_of(t).narrow(0, from, count).copy_(bytes_of(h).narrow(0, from, count), h.is_pinned());
  detail::record_staged(count);
}

/// Copies all of the host copy `h` back into `t`.
void stage_out(const at::Tensor& t, const at::Tensor& h) {
  if (t.defined()) stage_out_bytes(t, h, 0, nbytes(t));
}

/// Runs `call` on a host copy of the in-place buffer `t` and copies the
/// result back (Note [host staging]).
template <typename Call>
void staged_in_place(const at::Tensor& t, Comm comm, Call call) {
  const at::Tensor h = stage_in(t, comm);
  {
    StagedScope scope;
    call(h);
  }
  stage_out(t, h);
}

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

void* ptr(const at::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr(); }

/// Throws unless values of `dtype` (after any upcast) can be reduced with `op`.
void check_reduction(at::ScalarType dtype, ReduceOp op) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kBool:
      return;
    case at::kComplexFloat:
    case at::kComplexDouble:
      // Sum (and product) of complex numbers; there is no order for max/min.
      TORCH_CHECK(op == ReduceOp::Sum || op == ReduceOp::Product,
                  "shardtensor transport: max/min reductions are not defined for dtype ", dtype);
      return;
    default:
      TORCH_CHECK(false, "shardtensor transport: reductions do not support dtype ", dtype);
  }
}

#if SHARDTENSOR_WITH_MPI
/// Element type and operation for a reduction on `dtype` (after any upcast).
std::pair<MPI_Datatype, MPI_Op> reduction_type(at::ScalarType dtype, ReduceOp op) {
  check_reduction(dtype, op);
  MPI_Op mpi_op = MPI_SUM;
  switch (op) {
    case ReduceOp::Sum:
      mpi_op = MPI_SUM;
      break;
    case ReduceOp::Max:
      mpi_op = MPI_MAX;
      break;
    case ReduceOp::Min:
      mpi_op = MPI_MIN;
      break;
    case ReduceOp::Product:
      mpi_op = MPI_PROD;
      break;
  }
  switch (dtype) {
    case at::kFloat:
      return {MPI_FLOAT, mpi_op};
    case at::kDouble:
      return {MPI_DOUBLE, mpi_op};
    case at::kInt:
      return {MPI_INT32_T, mpi_op};
    case at::kLong:
      return {MPI_INT64_T, mpi_op};
    case at::kByte:
      return {MPI_UINT8_T, mpi_op};
    case at::kChar:
      return {MPI_INT8_T, mpi_op};
    case at::kShort:
      return {MPI_INT16_T, mpi_op};
    case at::kComplexFloat:
    case at::kComplexDouble:
      return {dtype == at::kComplexFloat ? MPI_C_FLOAT_COMPLEX : MPI_C_DOUBLE_COMPLEX, mpi_op};
    case at::kBool:
      // Stored as one byte holding 0 or 1: or = max, and = min.
      return {MPI_UINT8_T, (op == ReduceOp::Sum || op == ReduceOp::Max) ? MPI_MAX : MPI_MIN};
    default:
      break;
  }
  return {MPI_BYTE, mpi_op};  // unreachable: check_reduction() threw
}

/// Waits for a non-blocking collective under the watchdog (Note [watchdog]).
void wait_collective(MPI_Request* request, const char* primitive, Comm comm) {
  watchdog::WaitSite site;
  site.primitive = primitive;
  site.comm = comm;
  SHARDTENSOR_MPI_CHECK(watchdog::wait(request, MPI_STATUS_IGNORE, site));
}
#else
/// A c10d-only build (Note [c10d-only build]) has no MPI communicators, so
/// the MPI halves of the seam's functions cannot be reached.
[[noreturn]] void no_mpi(const char* fn) {
  TORCH_INTERNAL_ASSERT(false, "shardtensor transport: ", fn,
                        ": an MPI communicator in a c10d-only build");
}
#endif  // SHARDTENSOR_WITH_MPI

// Note [large counts]
// ~~~~~~~~~~~~~~~~~~~
// MPI-3 counts and displacements are ints, and this OpenMPI (4.1) has no MPI-4
// `_c` calls. No transport call refuses a size: every call whose count could
// exceed the limit (INT_MAX, or a smaller one set for tests) is split so that
// each MPI call stays within it, and the choice of path depends only on
// values every rank of the communicator holds (or on nothing), so ranks never
// disagree on which MPI calls to make:
//  - all_reduce_, start_all_reduce_, broadcast_: consecutive element / byte
//    chunks of at most the limit, one collective per chunk (same numel
//    everywhere);
//  - all_gatherv: MPI_Iallgatherv when every count and the total fit (the
//    counts are the same on every rank), else point-to-point;
//  - all_to_allv and scatterv: always point-to-point (Irecv/Isend, what
//    OpenMPI's linear algorithms do), since a rank does not know the other
//    ranks' counts; each message is split into pieces of at most the limit,
//    posted in order on both sides (MPI keeps them in order per pair and tag);
//  - reduce_scatter: MPI_Ireduce_scatter when every piece fits, else a
//    chunked all-reduce of a copy of the send buffer, keeping this rank's piece;
//  - start_exchange: each message split into pieces of at most the limit.

std::atomic<int64_t> g_max_count{INT_MAX};

int64_t max_count() { return g_max_count.load(std::memory_order_relaxed); }

// Tags of the point-to-point forms of collectives (distinct from the exchange
// and ring tags, so an exchange in flight on the same communicator never
// matches them).
constexpr int kAllGathervTag = 7301;
constexpr int kAllToAllvTag = 7302;
constexpr int kScattervTag = 7303;
constexpr int kReduceScatterTag = 7304;

// Note [ordered sums]
// ~~~~~~~~~~~~~~~~~~~
// A floating-point sum depends on its order, and MPI_Allreduce /
// MPI_Reduce_scatter choose theirs by algorithm (message size, rank count,
// Open MPI version: 4.1 on Debian 12 and 5.0 on Debian 13 differ), and
// MPI_MAX / MPI_MIN drop a NaN that torch's maximum keeps. So reductions of
// floating and complex values never use them: the reduce-scatter sends each
// owner its chunk of every rank's summand (point-to-point) and the owner
// combines the contributions in rank order 0..P-1 with torch's ops, the same
// function the c10d transport uses (c10d::finish_reduce_scatter, Note [c10d
// data movement]); an all-reduce is that reduce-scatter over balanced chunks
// followed by an all-gather. Both transports therefore give bit-identical
// results at the same layout, independent of the MPI library. The traffic is
// the direct volume of Note [traffic accounting], as before. Integer and bool
// reductions are order-free and keep MPI's own.
bool ordered_sum(at::ScalarType t) { return at::isFloatingType(t) || at::isComplexType(t); }

#if SHARDTENSOR_WITH_MPI
/// Point-to-point requests of one transport call, with their peers for the
/// watchdog's message.
struct PeerRequests {
  std::vector<MPI_Request> requests;
  std::vector<int> peers;

  void recv(void* data, int64_t n, int peer, int tag, Comm comm) {
    auto* p = static_cast<char*>(data);
    for (int64_t done = 0; done < n; done += max_count()) {
      const int k = static_cast<int>(std::min<int64_t>(max_count(), n - done));
      requests.push_back(null_request());
      peers.push_back(peer);
      SHARDTENSOR_MPI_CHECK(MPI_Irecv(p + done, k, MPI_BYTE, peer, tag, comm, &requests.back()));
    }
  }
  void send(const void* data, int64_t n, int peer, int tag, Comm comm) {
    const auto* p = static_cast<const char*>(data);
    for (int64_t done = 0; done < n; done += max_count()) {
      const int k = static_cast<int>(std::min<int64_t>(max_count(), n - done));
      requests.push_back(null_request());
      peers.push_back(peer);
      SHARDTENSOR_MPI_CHECK(MPI_Isend(p + done, k, MPI_BYTE, peer, tag, comm, &requests.back()));
    }
  }
  void wait(const char* primitive, Comm comm) {
    watchdog::WaitSite site;
    site.primitive = primitive;
    site.comm = comm;
    site.peers = &peers;
    SHARDTENSOR_MPI_CHECK(watchdog::wait_all(static_cast<int>(requests.size()), requests.data(),
                                             MPI_STATUSES_IGNORE, site));
    requests.clear();
    peers.clear();
  }
};
#endif

bool needs_upcast(at::ScalarType dtype) { return dtype == at::kHalf || dtype == at::kBFloat16; }

void record_all_reduce(int64_t numel, int64_t elem, int size, int rank) {
  if (size <= 1 || numel == 0) {
    return;
  }
  const int64_t total = numel * elem;
  const int64_t base = numel / size, extra = numel % size;
  auto chunk = [&](int64_t c) { return (base + (c < extra ? 1 : 0)) * elem; };
  const int64_t mine = chunk(rank);
  int64_t messages = 0;
  for (int c = 0; c < size; ++c) {
    messages += (c != rank && chunk(c) > 0) ? 1 : 0;
  }
  messages += mine > 0 ? size - 1 : 0;
  const int64_t bytes = total + static_cast<int64_t>(size - 2) * mine;
  detail::record_comm(bytes, bytes, messages);
}

}  // namespace

int comm_size(Comm comm) {
  if (c10d::owns(comm)) return detail::pg::size(comm);
#if SHARDTENSOR_WITH_MPI
  int size = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_size(comm, &size));
  return size;
#else
  no_mpi("comm_size");
#endif
}

int comm_rank(Comm comm) {
  if (c10d::owns(comm)) return detail::pg::rank(comm);
#if SHARDTENSOR_WITH_MPI
  int rank = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  return rank;
#else
  no_mpi("comm_rank");
#endif
}

void all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm) {
  if (staged(t, comm)) {  // Note [host staging]
    staged_in_place(t, comm, [&](const at::Tensor& h) { all_reduce_(h, op, comm); });
    return;
  }
  check_buffer(t, "all_reduce_ buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    check_reduction(needs_upcast(t.scalar_type()) ? at::kFloat : t.scalar_type(), op);
    if (size > 1 && t.numel() > 0) {
      CommTimer timer;
      c10d::all_reduce_(t, op, comm);
    }
    record_all_reduce(t.numel(), t.element_size(), size, rank);
    return;
  }
  if (ordered_sum(t.scalar_type())) {  // Note [ordered sums]
    check_reduction(needs_upcast(t.scalar_type()) ? at::kFloat : t.scalar_type(), op);
    if (size > 1 && t.numel() > 0) {
      // Counted by the two calls: the same bytes and messages as
      // record_all_reduce() counts.
      const std::vector<int64_t> chunks = balanced_sizes(t.numel(), size);
      std::vector<int64_t> chunk_bytes(chunks.size());
      for (size_t c = 0; c < chunks.size(); ++c) chunk_bytes[c] = chunks[c] * t.element_size();
      at::Tensor mine = at::empty({chunks[static_cast<size_t>(rank)]}, t.options());
      start_reduce_scatter(t, mine, chunks, op, comm).finish();
      all_gatherv(mine, t, chunk_bytes, comm);
    }
    return;
  }
#if SHARDTENSOR_WITH_MPI
  auto [type, mpi_op] = reduction_type(t.scalar_type(), op);
  if (size > 1 && t.numel() > 0) {
    // Counts are elements: chunk so that no single call exceeds the limit
    // (Note [large counts]).
    auto* data = static_cast<char*>(ptr(t));
    const int64_t elem = t.element_size();
    CommTimer timer;
    for (int64_t done = 0; done < t.numel(); done += max_count()) {
      const int n = static_cast<int>(std::min<int64_t>(max_count(), t.numel() - done));
      MPI_Request request = null_request();
      SHARDTENSOR_MPI_CHECK(
          MPI_Iallreduce(MPI_IN_PLACE, data + done * elem, n, type, mpi_op, comm, &request));
      wait_collective(&request, "all_reduce_ (MPI_Iallreduce)", comm);
    }
  }
  record_all_reduce(t.numel(), t.element_size(), size, rank);
#else
  no_mpi("all_reduce_");
#endif
}

PendingCollective start_all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                                    const std::vector<int64_t>& recv_bytes, Comm comm) {
  if (staged(send, comm) || staged(recv, comm)) {  // Note [host staging]
    const at::Tensor hs = stage_in(send, comm);
    const at::Tensor hr = stage_recv(recv, comm);
    PendingCollective p;
    {
      StagedScope scope;
      p = start_all_gatherv(hs, hr, recv_bytes, comm);
    }
    const int64_t total = sum_of(recv_bytes);  // what the call writes
    p.then_ = [then = std::move(p.then_), recv, hr, total] {
      if (then) then();
      stage_out_bytes(recv, hr, 0, total);
    };
    return p;
  }
  PendingCollective pending;
  check_buffer(send, "all_gatherv send buffer", comm);
  check_buffer(recv, "all_gatherv receive buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(static_cast<int>(recv_bytes.size()) == size,
              "shardtensor transport: all_gatherv got ", recv_bytes.size(),
              " byte counts for a communicator of size ", size);
  const int64_t mine = nbytes(send);
  TORCH_CHECK(mine == recv_bytes[rank], "shardtensor transport: all_gatherv: rank ", rank,
              " sends ", mine, " bytes but recv_bytes says ", recv_bytes[rank]);
  const int64_t total = std::accumulate(recv_bytes.begin(), recv_bytes.end(), int64_t{0});
  TORCH_CHECK(nbytes(recv) >= total, "shardtensor transport: all_gatherv receive buffer holds ",
              nbytes(recv), " bytes, needs ", total);
  for (int c = 0; c < size; ++c) {
    TORCH_CHECK(recv_bytes[c] >= 0, "shardtensor transport: all_gatherv: negative byte count ",
                recv_bytes[c], " for rank ", c);
  }
  if (size == 1) {
    local_copy(recv, 0, send, 0, mine);
    return pending;
  }
  const bool fits = total <= max_count();  // then every count and displacement fits too
  if (c10d::owns(comm)) {                  // Note [c10d data movement]
    CommTimer timer;
    pending.c10d_ =
        std::make_shared<c10d::Exchange>(c10d::start_all_gatherv(send, recv, recv_bytes, comm));
    pending.what_ = "all_gatherv (c10d send/recv)";
  }
#if !SHARDTENSOR_WITH_MPI
  else {
    (void)fits;
    no_mpi("start_all_gatherv");
  }
#else
  else if (!fits) {
    // Note [large counts]: point-to-point, decided from recv_bytes (the same everywhere).
    CommTimer timer;
    PeerRequests p2p;
    auto* base = static_cast<char*>(recv.data_ptr());
    int64_t offset = 0;
    for (int c = 0; c < size; ++c) {
      if (c != rank && recv_bytes[c] > 0) {
        p2p.recv(base + offset, recv_bytes[c], c, kAllGathervTag, comm);
      }
      offset += recv_bytes[c];
    }
    for (int c = 0; c < size; ++c) {
      if (c != rank && mine > 0) {
        p2p.send(send.data_ptr(), mine, c, kAllGathervTag, comm);
      }
    }
    const int64_t my_offset =
        std::accumulate(recv_bytes.begin(), recv_bytes.begin() + rank, int64_t{0});
    local_copy(recv, my_offset, send, 0, mine);
    p2p.wait("all_gatherv (point-to-point MPI_Irecv/MPI_Isend)", comm);
  } else {
    std::vector<int> counts = to_counts(recv_bytes, "all_gatherv piece");
    std::vector<int> displs = prefix_displs(recv_bytes, "all_gatherv displacement");
    CommTimer timer;
    MPI_Request request = null_request();
    SHARDTENSOR_MPI_CHECK(MPI_Iallgatherv(ptr(send), counts[rank], MPI_BYTE, ptr(recv),
                                          counts.data(), displs.data(), MPI_BYTE, comm, &request));
    pending.requests_ = {request};
    pending.what_ = "all_gatherv (MPI_Iallgatherv)";
  }
#endif
  pending.comm_ = comm;
  pending.keep_ = {send, recv};
  detail::record_comm(static_cast<int64_t>(size - 1) * mine, total - mine, mine > 0 ? size - 1 : 0);
  return pending;
}

void all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, Comm comm) {
  start_all_gatherv(send, recv, recv_bytes, comm).finish();
}

// Note [strided gather]: gathering a tensor sharded along dim d > 0 means
// placing rank c's rows at rows [off_c, off_c + n_c) of every one of the
// `outer` slices (the product of the extents before d) of the result. A
// contiguous all-gatherv followed by movedim + contiguous costs one extra
// full-size copy; instead, one "row" is described as an MPI vector of
// `outer` blocks of row_bytes bytes, R * row_bytes apart, resized to an
// extent of row_bytes, so that n_c consecutive rows at displacement off_c
// land exactly in place. The send side is this rank's piece with d moved to
// the front (piece-sized). When the total or a stride exceeds the int count
// limit (Note [large counts]) the contiguous path plus a copy runs instead.
void all_gatherv_rows(const at::Tensor& send, const at::Tensor& recv,
                      const std::vector<int64_t>& rows, int64_t outer, int64_t row_bytes,
                      Comm comm) {
  if (staged(send, comm) || staged(recv, comm)) {  // Note [host staging]
    const at::Tensor hs = stage_in(send, comm);
    const at::Tensor hr = stage_recv(recv, comm);
    {
      StagedScope scope;
      all_gatherv_rows(hs, hr, rows, outer, row_bytes, comm);
    }
    stage_out_bytes(recv, hr, 0, sum_of(rows) * outer * row_bytes);
    return;
  }
  check_buffer(send, "all_gatherv_rows send buffer", comm);
  check_buffer(recv, "all_gatherv_rows receive buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(static_cast<int>(rows.size()) == size, "shardtensor transport: all_gatherv_rows got ",
              rows.size(), " row counts for a communicator of size ", size);
  TORCH_CHECK(outer >= 0 && row_bytes >= 0, "shardtensor transport: all_gatherv_rows: outer ",
              outer, " and row_bytes ", row_bytes, " must be non-negative");
  int64_t total_rows = 0;
  for (int c = 0; c < size; ++c) {
    TORCH_CHECK(rows[c] >= 0, "shardtensor transport: all_gatherv_rows: negative row count ",
                rows[c], " for rank ", c);
    total_rows += rows[c];
  }
  const int64_t slice = outer * row_bytes;  // bytes of one row across every outer slice
  TORCH_CHECK(nbytes(send) == rows[rank] * slice, "shardtensor transport: all_gatherv_rows: rank ",
              rank, " sends ", nbytes(send), " bytes, expected ", rows[rank] * slice);
  TORCH_CHECK(nbytes(recv) >= total_rows * slice,
              "shardtensor transport: all_gatherv_rows receive buffer holds ", nbytes(recv),
              " bytes, needs ", total_rows * slice);
  const int64_t total = total_rows * slice;
  const bool fits = total <= max_count() && total_rows * row_bytes <= max_count();
  if (size == 1 || !fits || slice == 0 || total == 0 || c10d::owns(comm)) {
    // One rank, nothing to move, too large for one datatype, or a c10d group (Note [c10d data
    // movement]): contiguous gather, then place the rows (Note [large counts]). for one datatype:
    // contiguous gather, then place the rows (Note [large counts]).
    std::vector<int64_t> bytes(rows.size());
    for (size_t c = 0; c < rows.size(); ++c) bytes[c] = rows[c] * slice;
    at::Tensor tmp = size == 1 ? send : at::empty({total}, send.options().dtype(at::kByte));
    if (size > 1) all_gatherv(send, tmp, bytes, comm);
    if (total > 0) {
      at::Tensor dst = at::from_blob(recv.data_ptr(), {outer, total_rows, row_bytes},
                                     recv.options().dtype(at::kByte));
      at::Tensor src = at::from_blob(tmp.data_ptr(), {total_rows, outer, row_bytes},
                                     tmp.options().dtype(at::kByte));
      dst.copy_(src.transpose(0, 1));
    }
    return;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("all_gatherv_rows");
#else
  MPI_Datatype vec = MPI_DATATYPE_NULL, row = MPI_DATATYPE_NULL;
  SHARDTENSOR_MPI_CHECK(MPI_Type_vector(
      to_count(outer, "all_gatherv_rows outer"), to_count(row_bytes, "all_gatherv_rows row"),
      to_count(total_rows * row_bytes, "all_gatherv_rows stride"), MPI_BYTE, &vec));
  SHARDTENSOR_MPI_CHECK(MPI_Type_create_resized(vec, 0, row_bytes, &row));
  SHARDTENSOR_MPI_CHECK(MPI_Type_commit(&row));
  std::vector<int> counts = to_counts(rows, "all_gatherv_rows piece");
  std::vector<int> displs = prefix_displs(rows, "all_gatherv_rows displacement");
  const int64_t mine = nbytes(send);
  {
    CommTimer timer;
    MPI_Request request = null_request();
    const int rc =
        MPI_Iallgatherv(ptr(send), to_count(mine, "all_gatherv_rows send"), MPI_BYTE,
                        recv.data_ptr(), counts.data(), displs.data(), row, comm, &request);
    MPI_Type_free(&row);
    MPI_Type_free(&vec);
    SHARDTENSOR_MPI_CHECK(rc);
    wait_collective(&request, "all_gatherv_rows (MPI_Iallgatherv)", comm);
  }
  detail::record_comm(static_cast<int64_t>(size - 1) * mine, total - mine, mine > 0 ? size - 1 : 0);
#endif
}

void all_to_allv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
                 const std::vector<int64_t>& send_displs, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs,
                 Comm comm) {
  if (staged(send, comm) || staged(recv, comm)) {  // Note [host staging]
    // The receives may leave gaps between the displacements: copied in whole.
    const at::Tensor hs = stage_in(send, comm);
    const at::Tensor hr = stage_in(recv, comm);
    {
      StagedScope scope;
      all_to_allv(hs, send_bytes, send_displs, hr, recv_bytes, recv_displs, comm);
    }
    stage_out(recv, hr);
    return;
  }
  check_buffer(send, "all_to_allv send buffer", comm);
  check_buffer(recv, "all_to_allv receive buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(
      static_cast<int>(send_bytes.size()) == size && static_cast<int>(send_displs.size()) == size &&
          static_cast<int>(recv_bytes.size()) == size &&
          static_cast<int>(recv_displs.size()) == size,
      "shardtensor transport: all_to_allv needs ", size, " counts and displacements on each side");
  int64_t sent = 0, received = 0, messages = 0;
  for (int c = 0; c < size; ++c) {
    TORCH_CHECK(send_bytes[c] >= 0 && recv_bytes[c] >= 0,
                "shardtensor transport: all_to_allv: negative byte count for rank ", c);
    TORCH_CHECK(send_displs[c] >= 0 && send_displs[c] + send_bytes[c] <= nbytes(send),
                "shardtensor transport: all_to_allv send range for rank ", c,
                " lies outside the send buffer");
    TORCH_CHECK(recv_displs[c] >= 0 && recv_displs[c] + recv_bytes[c] <= nbytes(recv),
                "shardtensor transport: all_to_allv receive range for rank ", c,
                " lies outside the receive buffer");
    if (c != rank) {
      sent += send_bytes[c];
      received += recv_bytes[c];
      messages += send_bytes[c] > 0 ? 1 : 0;
    }
  }
  TORCH_CHECK(send_bytes[rank] == recv_bytes[rank],
              "shardtensor transport: all_to_allv sends itself ", send_bytes[rank],
              " bytes but expects ", recv_bytes[rank]);
  auto* rbase = static_cast<char*>(recv.numel() == 0 ? nullptr : recv.data_ptr());
  const auto* sbase = static_cast<const char*>(send.numel() == 0 ? nullptr : send.data_ptr());
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    CommTimer timer;
    c10d::all_to_allv(send, send_bytes, send_displs, recv, recv_bytes, recv_displs, comm);
  } else {
#if !SHARDTENSOR_WITH_MPI
    no_mpi("all_to_allv");
#else
    // Note [large counts]: point-to-point, so that no rank needs the others' counts.
    CommTimer timer;
    PeerRequests p2p;
    for (int c = 0; c < size; ++c) {
      if (c != rank && recv_bytes[c] > 0) {
        p2p.recv(rbase + recv_displs[c], recv_bytes[c], c, kAllToAllvTag, comm);
      }
    }
    for (int k = 1; k < size; ++k) {
      const int c = (rank + k) % size;  // staggered, so rank 0 is not everyone's first target
      if (send_bytes[c] > 0) {
        p2p.send(sbase + send_displs[c], send_bytes[c], c, kAllToAllvTag, comm);
      }
    }
    local_copy(recv, recv_displs[rank], send, send_displs[rank], send_bytes[rank]);
    if (size > 1) {
      p2p.wait("all_to_allv (point-to-point MPI_Irecv/MPI_Isend)", comm);
    }
#endif
  }
  if (size == 1) {
    return;
  }
  detail::record_comm(sent, received, messages);
}

void broadcast_(const at::Tensor& t, int root, Comm comm) {
  if (staged(t, comm)) {  // Note [host staging]
    staged_in_place(t, comm, [&](const at::Tensor& h) { broadcast_(h, root, comm); });
    return;
  }
  check_buffer(t, "broadcast_ buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(root >= 0 && root < size, "shardtensor transport: broadcast root ", root,
              " is not a rank of a communicator of size ", size);
  const int64_t n = nbytes(t);
  if (size == 1 || n == 0) {
    return;
  }
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    CommTimer timer;
    c10d::broadcast_(t, root, comm);
  } else {
#if !SHARDTENSOR_WITH_MPI
    no_mpi("broadcast_");
#else
    CommTimer timer;
    auto* data = static_cast<char*>(ptr(t));
    for (int64_t done = 0; done < n; done += max_count()) {
      const int k = static_cast<int>(std::min<int64_t>(max_count(), n - done));
      MPI_Request request = null_request();
      SHARDTENSOR_MPI_CHECK(MPI_Ibcast(data + done, k, MPI_BYTE, root, comm, &request));
      wait_collective(&request, "broadcast_ (MPI_Ibcast)", comm);
    }
#endif
  }
  if (rank == root) {
    detail::record_comm(static_cast<int64_t>(size - 1) * n, 0, size - 1);
  } else {
    detail::record_comm(0, n, 0);
  }
}

void scatterv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, Comm comm) {
  if (staged(send, comm) || staged(recv, comm)) {  // Note [host staging]
    const at::Tensor hs =
        stage_in(send, comm);  // read on the root only; may be undefined elsewhere
    const at::Tensor hr = stage_recv(recv, comm);
    {
      StagedScope scope;
      scatterv(hs, send_bytes, hr, root, comm);
    }
    stage_out(recv, hr);
    return;
  }
  check_buffer(recv, "scatterv receive buffer", comm);
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(root >= 0 && root < size, "shardtensor transport: scatterv root ", root,
              " is not a rank of a communicator of size ", size);
  const int64_t mine = nbytes(recv);
  int64_t sent = 0, messages = 0;
  if (rank == root) {
    check_buffer(send, "scatterv send buffer", comm);
    TORCH_CHECK(static_cast<int>(send_bytes.size()) == size, "shardtensor transport: scatterv got ",
                send_bytes.size(), " byte counts for a communicator of size ", size);
    TORCH_CHECK(send_bytes[rank] == mine, "shardtensor transport: scatterv root keeps ",
                send_bytes[rank], " bytes but its receive buffer holds ", mine);
    const int64_t total = std::accumulate(send_bytes.begin(), send_bytes.end(), int64_t{0});
    TORCH_CHECK(nbytes(send) >= total, "shardtensor transport: scatterv send buffer holds ",
                nbytes(send), " bytes, needs ", total);
    for (int c = 0; c < size; ++c) {
      if (c != rank) {
        sent += send_bytes[c];
        messages += send_bytes[c] > 0 ? 1 : 0;
      }
    }
  }
  if (size == 1) {
    local_copy(recv, 0, send, 0, mine);
    return;
  }
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    CommTimer timer;
    c10d::scatterv(send, send_bytes, recv, root, comm);
  } else {
#if !SHARDTENSOR_WITH_MPI
    no_mpi("scatterv");
#else
    // Note [large counts]: point-to-point; a non-root rank knows only its own count.
    CommTimer timer;
    PeerRequests p2p;
    if (rank == root) {
      const auto* base = static_cast<const char*>(ptr(send));
      int64_t offset = 0;
      for (int c = 0; c < size; ++c) {
        if (c != rank && send_bytes[c] > 0) {
          p2p.send(base + offset, send_bytes[c], c, kScattervTag, comm);
        } else if (c == rank && mine > 0) {
          local_copy(recv, 0, send, offset, mine);
        }
        offset += send_bytes[c];
      }
    } else if (mine > 0) {
      p2p.recv(recv.data_ptr(), mine, root, kScattervTag, comm);
    }
    p2p.wait("scatterv (point-to-point MPI_Irecv/MPI_Isend)", comm);
#endif
  }
  if (rank == root) {
    detail::record_comm(sent, 0, messages);
  } else {
    detail::record_comm(0, mine, 0);
  }
}

PendingCollective start_reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                                       const std::vector<int64_t>& recv_numel, ReduceOp op,
                                       Comm comm) {
  if (staged(send, comm) || staged(recv, comm)) {  // Note [host staging]
    const at::Tensor hs = stage_in(send, comm);
    const at::Tensor hr = stage_recv(recv, comm);
    PendingCollective p;
    {
      StagedScope scope;
      p = start_reduce_scatter(hs, hr, recv_numel, op, comm);
    }
    const auto me = static_cast<size_t>(comm_rank(comm));  // valid: the call checked it
    const int64_t covered = recv_numel[me] * recv.element_size();
    p.then_ = [then = std::move(p.then_), recv, hr, covered] {
      if (then) then();
      stage_out_bytes(recv, hr, 0, covered);
    };
    return p;
  }
  PendingCollective pending;
  check_buffer(send, "reduce_scatter send buffer", comm);
  check_buffer(recv, "reduce_scatter receive buffer", comm);
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(),
              "shardtensor transport: reduce_scatter send and receive dtypes differ (",
              send.scalar_type(), " vs ", recv.scalar_type(), ")");
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  TORCH_CHECK(static_cast<int>(recv_numel.size()) == size,
              "shardtensor transport: reduce_scatter got ", recv_numel.size(),
              " counts for a communicator of size ", size);
  const int64_t total = std::accumulate(recv_numel.begin(), recv_numel.end(), int64_t{0});
  TORCH_CHECK(send.numel() == total, "shardtensor transport: reduce_scatter sends ", send.numel(),
              " elements but the counts sum to ", total);
  TORCH_CHECK(recv.numel() == recv_numel[rank], "shardtensor transport: reduce_scatter rank ", rank,
              " receives into ", recv.numel(), " elements, expected ", recv_numel[rank]);
  const int64_t offset = std::accumulate(recv_numel.begin(), recv_numel.begin() + rank, int64_t{0});
  if (size == 1) {
    check_reduction(needs_upcast(send.scalar_type()) ? at::kFloat : send.scalar_type(), op);
    recv.view(-1).copy_(send.view(-1).narrow(0, offset, recv.numel()));
    return pending;
  }
  bool fits = true;
  for (int c = 0; c < size; ++c) {
    TORCH_CHECK(recv_numel[c] >= 0, "shardtensor transport: reduce_scatter: negative count ",
                recv_numel[c], " for rank ", c);
    fits = fits && recv_numel[c] <= max_count();
  }
  CommTimer timer;
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    check_reduction(needs_upcast(send.scalar_type()) ? at::kFloat : send.scalar_type(), op);
    at::Tensor contributions;
    pending.c10d_ = std::make_shared<c10d::Exchange>(
        c10d::start_reduce_scatter(send, recv_numel, comm, contributions));
    pending.what_ = "reduce_scatter (c10d send/recv)";
    pending.then_ = [contributions, recv, op] {
      c10d::finish_reduce_scatter(contributions, recv, op);
    };
  }
#if !SHARDTENSOR_WITH_MPI
  else {
    (void)fits;
    no_mpi("start_reduce_scatter");
  }
#else
  else if (ordered_sum(send.scalar_type())) {  // Note [ordered sums]
    at::NoGradGuard no_grad;                   // moving data: `send` may require grad
    check_reduction(needs_upcast(send.scalar_type()) ? at::kFloat : send.scalar_type(), op);
    const int64_t elem = send.element_size();
    const int64_t mine = recv_numel[rank];
    at::Tensor contributions = at::empty({size, mine}, send.options());
    std::vector<int64_t> offsets(static_cast<size_t>(size), 0);
    for (int c = 1; c < size; ++c) offsets[c] = offsets[c - 1] + recv_numel[c - 1];
    const auto* base = static_cast<const char*>(send.numel() == 0 ? nullptr : send.data_ptr());
    PeerRequests p2p;
    for (int c = 0; c < size; ++c) {
      if (c != rank && mine > 0) {
        p2p.recv(contributions[c].data_ptr(), mine * elem, c, kReduceScatterTag, comm);
      }
    }
    for (int k = 1; k < size; ++k) {
      const int c = (rank + k) % size;  // staggered, as all_to_allv
      if (recv_numel[c] > 0) {
        p2p.send(base + offsets[c] * elem, recv_numel[c] * elem, c, kReduceScatterTag, comm);
      }
    }
    if (mine > 0) contributions[rank].copy_(send.view(-1).narrow(0, offsets[rank], mine));
    pending.requests_ = std::move(p2p.requests);
    pending.peers_ = std::move(p2p.peers);
    pending.what_ = "reduce_scatter (MPI_Irecv/MPI_Isend, summed in rank order)";
    pending.keep_.push_back(contributions);
    pending.then_ = [contributions, recv, op] {
      c10d::finish_reduce_scatter(contributions, recv, op);
    };
  } else if (!fits) {
    // Note [large counts]: a chunked all-reduce of a copy, keeping this rank's
    // piece (decided from recv_numel, the same on every rank).
    const bool upcast = needs_upcast(send.scalar_type());
    at::Tensor work = upcast ? send.to(at::kFloat).contiguous() : send.clone();
    auto [type, mpi_op] = reduction_type(work.scalar_type(), op);
    auto* data = static_cast<char*>(ptr(work));
    const int64_t welem = work.element_size();
    for (int64_t done = 0; done < work.numel(); done += max_count()) {
      const int n = static_cast<int>(std::min<int64_t>(max_count(), work.numel() - done));
      MPI_Request request = null_request();
      SHARDTENSOR_MPI_CHECK(
          MPI_Iallreduce(MPI_IN_PLACE, data + done * welem, n, type, mpi_op, comm, &request));
      wait_collective(&request, "reduce_scatter (chunked MPI_Iallreduce)", comm);
    }
    recv.view(-1).copy_(work.view(-1).narrow(0, offset, recv.numel()));
  } else {
    auto [type, mpi_op] = reduction_type(send.scalar_type(), op);
    std::vector<int> counts = to_counts(recv_numel, "reduce_scatter piece (elements)");
    MPI_Request request = null_request();
    SHARDTENSOR_MPI_CHECK(
        MPI_Ireduce_scatter(ptr(send), ptr(recv), counts.data(), type, mpi_op, comm, &request));
    pending.requests_ = {request};
    pending.what_ = "reduce_scatter (MPI_Ireduce_scatter)";
  }
#endif
  pending.comm_ = comm;
  pending.keep_.push_back(send);
  pending.keep_.push_back(recv);
  const int64_t elem = send.element_size();
  int64_t sent = 0, messages = 0;
  for (int c = 0; c < size; ++c) {
    if (c != rank) {
      sent += recv_numel[c] * elem;
      messages += recv_numel[c] > 0 ? 1 : 0;
    }
  }
  detail::record_comm(sent, static_cast<int64_t>(size - 1) * recv_numel[rank] * elem, messages);
  return pending;
}

void reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                    const std::vector<int64_t>& recv_numel, ReduceOp op, Comm comm) {
  start_reduce_scatter(send, recv, recv_numel, op, comm).finish();
}

void diagnostic_max_(std::vector<int64_t>& values, Comm comm) {
  if (values.empty() || comm_size(comm) == 1) {
    return;
  }
  if (c10d::owns(comm)) {
    at::Tensor t = at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kLong);
    c10d::all_reduce_(t, ReduceOp::Max, comm);
    return;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("diagnostic_max_");
#else
  MPI_Request request = null_request();
  SHARDTENSOR_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, values.data(),
                                       to_count(static_cast<int64_t>(values.size()), "values"),
                                       MPI_INT64_T, MPI_MAX, comm, &request));
  wait_collective(&request, "diagnostic_max_ (MPI_Iallreduce)", comm);
#endif
}

// ---- split-phase point-to-point ---------------------------------------------

PendingExchange::PendingExchange(PendingExchange&& other) noexcept
    : requests_(std::move(other.requests_)),
      expected_bytes_(std::move(other.expected_bytes_)),
      buffers_(std::move(other.buffers_)),
      statuses_(std::move(other.statuses_)),
      peers_(std::move(other.peers_)),
      comm_(other.comm_),
      completed_(other.completed_),
      collective_(other.collective_),
      c10d_(std::move(other.c10d_)),
      copy_back_(std::move(other.copy_back_)) {
  other.requests_.clear();
  other.peers_.clear();
  other.completed_ = false;
  other.copy_back_.clear();
}

PendingExchange& PendingExchange::operator=(PendingExchange&& other) noexcept {
  if (this != &other) {
    abandon();
    requests_ = std::move(other.requests_);
    expected_bytes_ = std::move(other.expected_bytes_);
    buffers_ = std::move(other.buffers_);
    statuses_ = std::move(other.statuses_);
    peers_ = std::move(other.peers_);
    comm_ = other.comm_;
    completed_ = other.completed_;
    collective_ = other.collective_;
    c10d_ = std::move(other.c10d_);
    copy_back_ = std::move(other.copy_back_);
    other.requests_.clear();
    other.peers_.clear();
    other.completed_ = false;
    other.copy_back_.clear();
  }
  return *this;
}

PendingExchange::~PendingExchange() { abandon(); }

bool PendingExchange::pending() const {
  return !requests_.empty() || (c10d_ != nullptr && c10d_->pending()) || !copy_back_.empty();
}

void PendingExchange::abandon() noexcept {
  copy_back_.clear();
  c10d_.reset();  // waits, watchdog-bounded (Note [c10d data movement])
  if (requests_.empty()) {
    return;
  }
#if SHARDTENSOR_WITH_MPI
  // Note [abandoned exchange]: reached only when finish() was skipped, e.g. by
  // an exception between start and finish. Receives may never be matched, so
  // cancel them; sends are small enough or matched by peers that did not fail.
  for (size_t i = 0; i < expected_bytes_.size(); ++i) {
    if (requests_[i] != null_request()) {
      MPI_Cancel(&requests_[i]);
    }
  }
  watchdog::WaitSite site;
  site.primitive = collective_ ? "abandoned neighbourhood exchange (MPI_Wait)"
                               : "abandoned exchange (MPI_Cancel + MPI_Waitall)";
  site.comm = comm_;
  site.peers = collective_ ? nullptr : &peers_;  // a collective request cannot be cancelled
  site.in_last_call = false;
  watchdog::wait_all(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE,
                     site);
#endif
  requests_.clear();
  peers_.clear();
  expected_bytes_.clear();
  buffers_.clear();
}

void PendingExchange::finish() {
  finish_transfers();
  auto back = std::move(copy_back_);  // Note [host staging]
  copy_back_.clear();
  for (const auto& copy : back) copy();
}

void PendingExchange::finish_transfers() {
  if (c10d_ != nullptr) {
    auto x = std::move(c10d_);
    CommTimer timer;
    x->finish("exchange finish (c10d send/recv)");
    return;
  }
  if (requests_.empty()) {
    return;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("PendingExchange::finish");
#else
  std::vector<MPI_Status> statuses;
  int rc = MPI_SUCCESS;
  if (completed_) {
    statuses = std::move(statuses_);  // test() saw every request complete
  } else {
    statuses.resize(requests_.size());
    CommTimer timer;
    watchdog::WaitSite site;
    site.primitive = collective_ ? "neighbourhood exchange finish (MPI_Ineighbor_alltoallw)"
                                 : "exchange finish (MPI_Waitall of MPI_Irecv/MPI_Isend)";
    site.comm = comm_;
    site.in_last_call = false;
    site.peers = collective_ ? nullptr : &peers_;
    rc = watchdog::wait_all(static_cast<int>(requests_.size()), requests_.data(), statuses.data(),
                            site);
  }
  completed_ = false;
  statuses_.clear();
  std::vector<int64_t> expected = std::move(expected_bytes_);
  requests_.clear();
  peers_.clear();
  expected_bytes_.clear();
  buffers_.clear();
  if (rc == MPI_ERR_IN_STATUS) {
    for (const auto& s : statuses) {
      SHARDTENSOR_MPI_CHECK(s.MPI_ERROR);
    }
  }
  SHARDTENSOR_MPI_CHECK(rc);
  for (size_t i = 0; i < expected.size(); ++i) {
    int got = 0;
    SHARDTENSOR_MPI_CHECK(MPI_Get_count(&statuses[i], MPI_BYTE, &got));
    TORCH_CHECK(got == expected[i], "shardtensor transport: exchange received ", got,
                " bytes from rank ", statuses[i].MPI_SOURCE, " but expected ", expected[i],
                " (ranks disagree on the exchange; SHARDTENSOR_DEBUG=1 checks arguments)");
  }
#endif
}

bool PendingExchange::test() {
  // Gloo moves the messages in its own threads; whether they arrived is known
  // only by waiting, so a c10d exchange reports "not yet" until finish().
  if (c10d_ != nullptr) return c10d_->arrived();
  if (requests_.empty() || completed_) {
    return true;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("PendingExchange::test");
#else
  std::vector<MPI_Status> statuses(requests_.size());
  int flag = 0;
  CommTimer timer;
  const int rc =
      MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses.data());
  if (rc == MPI_ERR_IN_STATUS) {
    for (const auto& st : statuses) {
      SHARDTENSOR_MPI_CHECK(st.MPI_ERROR);
    }
  }
  SHARDTENSOR_MPI_CHECK(rc);
  if (flag) {
    statuses_ = std::move(statuses);
    completed_ = true;
  }
  return flag != 0;
#endif
}

PendingExchange start_exchange(const std::vector<PeerBuffer>& sends,
                               const std::vector<PeerBuffer>& recvs, Comm comm, int tag) {
  {  // Note [host staging]
    bool any = false;
    for (const auto* list : {&sends, &recvs}) {
      for (const auto& pb : *list) any = any || staged(pb.buffer, comm);
    }
    if (any) {
      std::vector<PeerBuffer> hsends, hrecvs;
      std::vector<std::function<void()>> back;
      for (const auto& pb : sends) hsends.push_back({pb.peer, stage_in(pb.buffer, comm)});
      for (const auto& pb : recvs) {
        at::Tensor h = pb.buffer.defined() ? stage_recv(pb.buffer, comm) : pb.buffer;
        if (!h.is_same(pb.buffer)) {
          back.emplace_back([device = pb.buffer, h] { stage_out(device, h); });
        }
        hrecvs.push_back({pb.peer, std::move(h)});
      }
      PendingExchange ex;
      {
        StagedScope scope;
        ex = start_exchange(hsends, hrecvs, comm, tag);
      }
      ex.copy_back_ = std::move(back);
      return ex;
    }
  }
  const int size = comm_size(comm);
  const int rank = comm_rank(comm);
  // Validate everything before posting anything.
  for (const auto* list : {&sends, &recvs}) {
    for (const auto& pb : *list) {
      TORCH_CHECK(pb.peer >= 0 && pb.peer < size, "shardtensor transport: exchange peer ", pb.peer,
                  " is not a rank of a communicator of size ", size);
      check_buffer(pb.buffer, "exchange buffer", comm);
    }
  }
  CommTimer timer;
  PendingExchange ex;
  ex.comm_ = comm;
  int64_t sent = 0, received = 0, messages = 0;
  if (c10d::owns(comm)) {  // Note [c10d data movement]
    std::vector<c10d::Message> c_sends, c_recvs;
    for (const auto& pb : recvs) {
      c_recvs.push_back({pb.peer, pb.buffer});
      received += pb.peer != rank ? nbytes(pb.buffer) : 0;
    }
    for (const auto& pb : sends) {
      c_sends.push_back({pb.peer, pb.buffer});
      if (pb.peer != rank && nbytes(pb.buffer) > 0) {
        sent += nbytes(pb.buffer);
        messages += 1;
      }
    }
    ex.c10d_ = std::make_shared<c10d::Exchange>(c10d::start(c_sends, c_recvs, comm, tag));
    detail::record_comm(sent, received, messages);
    return ex;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("start_exchange");
#else
  ex.requests_.reserve(sends.size() + recvs.size());
  for (const auto& pb : recvs) {
    const int64_t n = nbytes(pb.buffer);
    if (n == 0) {
      continue;
    }
    ex.buffers_.push_back(pb.buffer);
    auto* data = static_cast<char*>(pb.buffer.data_ptr());
    for (int64_t done = 0; done < n; done += max_count()) {  // Note [large counts]
      const int k = static_cast<int>(std::min<int64_t>(max_count(), n - done));
      ex.requests_.push_back(null_request());
      ex.expected_bytes_.push_back(k);
      ex.peers_.push_back(pb.peer);
      SHARDTENSOR_MPI_CHECK(
          MPI_Irecv(data + done, k, MPI_BYTE, pb.peer, tag, comm, &ex.requests_.back()));
    }
    received += pb.peer != rank ? n : 0;
  }
  for (const auto& pb : sends) {
    const int64_t n = nbytes(pb.buffer);
    if (n == 0) {
      continue;
    }
    ex.buffers_.push_back(pb.buffer);
    const auto* data = static_cast<const char*>(pb.buffer.data_ptr());
    for (int64_t done = 0; done < n; done += max_count()) {  // Note [large counts]
      const int k = static_cast<int>(std::min<int64_t>(max_count(), n - done));
      ex.requests_.push_back(null_request());
      ex.peers_.push_back(pb.peer);
      SHARDTENSOR_MPI_CHECK(
          MPI_Isend(data + done, k, MPI_BYTE, pb.peer, tag, comm, &ex.requests_.back()));
    }
    if (pb.peer != rank) {
      sent += n;
      messages += 1;
    }
  }
  detail::record_comm(sent, received, messages);
  return ex;
#endif
}

// ---- non-blocking all-reduce ---------------------------------------------------

#if SHARDTENSOR_WITH_MPI
namespace {
int wait_reduce(MPI_Request* request, Comm comm) {
  watchdog::WaitSite site;
  site.primitive = "pending all-reduce finish (MPI_Iallreduce)";
  site.comm = comm;
  site.in_last_call = false;
  return watchdog::wait(request, MPI_STATUS_IGNORE, site);
}
}  // namespace
#endif

PendingReduce::PendingReduce(PendingReduce&& other) noexcept
    : request_(other.request_),
      comm_(other.comm_),
      buffer_(std::move(other.buffer_)),
      wide_(std::move(other.wide_)),
      phase_(std::move(other.phase_)),
      chunk_(std::move(other.chunk_)),
      chunk_bytes_(std::move(other.chunk_bytes_)),
      gathering_(other.gathering_),
      staged_device_(std::move(other.staged_device_)),
      staged_host_(std::move(other.staged_host_)) {
  other.request_ = null_request();
  other.wide_ = at::Tensor();
  other.phase_.reset();
  other.gathering_ = false;
  other.staged_device_ = at::Tensor();
  other.staged_host_ = at::Tensor();
}

PendingReduce& PendingReduce::operator=(PendingReduce&& other) noexcept {
  if (this != &other) {
#if SHARDTENSOR_WITH_MPI
    if (request_ != null_request()) wait_reduce(&request_, comm_);
#endif
    phase_.reset();  // waits
    request_ = other.request_;
    comm_ = other.comm_;
    buffer_ = std::move(other.buffer_);
    wide_ = std::move(other.wide_);
    phase_ = std::move(other.phase_);
    chunk_ = std::move(other.chunk_);
    chunk_bytes_ = std::move(other.chunk_bytes_);
    gathering_ = other.gathering_;
    staged_device_ = std::move(other.staged_device_);
    staged_host_ = std::move(other.staged_host_);
    other.request_ = null_request();
    other.wide_ = at::Tensor();
    other.phase_.reset();
    other.gathering_ = false;
    other.staged_device_ = at::Tensor();
    other.staged_host_ = at::Tensor();
  }
  return *this;
}

PendingReduce::~PendingReduce() {
#if SHARDTENSOR_WITH_MPI
  if (request_ != null_request()) wait_reduce(&request_, comm_);
#endif
}

void PendingReduce::start_gather_phase() {
  phase_->finish();
  StagedScope scope;  // chunk_ and buffer_ are host memory already (Note [host staging])
  *phase_ = start_all_gatherv(chunk_, buffer_, chunk_bytes_, comm_);
  gathering_ = true;
}

bool PendingReduce::test() {
  if (phase_ != nullptr) {
    // Only the reduce-scatter progresses here. The all-gather is a collective
    // (on MPI) or matched by posting order (on c10d), so it starts in
    // finish(), which every rank calls in the order the reductions started;
    // starting it here, when this rank's reduce-scatter happened to complete,
    // could order two reductions' all-gathers differently on two ranks.
    (void)phase_->test();
    return false;
  }
  if (request_ == null_request()) return true;
#if !SHARDTENSOR_WITH_MPI
  no_mpi("PendingReduce::test");
#else
  int done = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Test(&request_, &done, MPI_STATUS_IGNORE));
  return done != 0;
#endif
}

void PendingReduce::finish() {
  finish_reduction();
  if (staged_device_.defined()) {  // Note [host staging]
    const at::Tensor device = std::move(staged_device_);
    const at::Tensor host = std::move(staged_host_);
    staged_device_ = at::Tensor();
    staged_host_ = at::Tensor();
    stage_out(device, host);
  }
}

void PendingReduce::finish_reduction() {
  if (phase_ != nullptr) {
    if (!gathering_) start_gather_phase();
    phase_->finish();
    phase_.reset();
    chunk_ = at::Tensor();
    gathering_ = false;
    buffer_ = at::Tensor();
    return;
  }
#if SHARDTENSOR_WITH_MPI
  if (request_ != null_request()) {
    SHARDTENSOR_MPI_CHECK(wait_reduce(&request_, comm_));
  }
#endif
  if (wide_.defined()) {
    buffer_.copy_(wide_);
    wide_ = at::Tensor();
  }
  buffer_ = at::Tensor();
}

PendingReduce start_all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm) {
  if (staged(t, comm)) {  // Note [host staging]
    const at::Tensor h = stage_in(t, comm);
    PendingReduce p;
    {
      StagedScope scope;
      p = start_all_reduce_(h, op, comm);
    }
    p.staged_device_ = t;
    p.staged_host_ = h;
    return p;
  }
  check_buffer(t, "start_all_reduce_ buffer", comm);
  PendingReduce pending;
  const int size = comm_size(comm);
  if (size <= 1 || t.numel() == 0) {
    return pending;
  }
  if (c10d::owns(comm) || ordered_sum(t.scalar_type())) {
    // Note [ordered sums] (and every c10d reduction): a reduce-scatter in rank
    // order, then, once it completed (test() or finish()), an all-gather of
    // the chunks back into `t`: the same arithmetic as all_reduce_().
    check_reduction(needs_upcast(t.scalar_type()) ? at::kFloat : t.scalar_type(), op);
    const std::vector<int64_t> chunks = balanced_sizes(t.numel(), size);
    pending.chunk_bytes_.resize(chunks.size());
    for (size_t c = 0; c < chunks.size(); ++c) {
      pending.chunk_bytes_[c] = chunks[c] * t.element_size();
    }
    pending.chunk_ = at::empty({chunks[static_cast<size_t>(comm_rank(comm))]}, t.options());
    pending.buffer_ = t;
    pending.comm_ = comm;
    pending.phase_ = std::make_shared<PendingCollective>(
        start_reduce_scatter(t, pending.chunk_, chunks, op, comm));
    return pending;
  }
  if (t.numel() > max_count()) {  // Note [large counts]
    all_reduce_(t, op, comm);
    return pending;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("start_all_reduce_");
#else
  // Integer and bool values (order-free): MPI's own non-blocking all-reduce.
  const int rank = comm_rank(comm);
  const at::Tensor& data = t;
  auto [type, mpi_op] = reduction_type(data.scalar_type(), op);
  pending.buffer_ = t;
  pending.comm_ = comm;
  SHARDTENSOR_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, ptr(data), static_cast<int>(data.numel()),
                                       type, mpi_op, comm, &pending.request_));
  record_all_reduce(t.numel(), t.element_size(), size, rank);
  return pending;
#endif
}

// ---- split-phase all-gatherv and reduce-scatter -----------------------------

PendingCollective::PendingCollective() = default;

PendingCollective::PendingCollective(PendingCollective&& other) noexcept
    : requests_(std::move(other.requests_)),
      peers_(std::move(other.peers_)),
      comm_(other.comm_),
      what_(other.what_),
      keep_(std::move(other.keep_)),
      c10d_(std::move(other.c10d_)),
      then_(std::move(other.then_)) {
  other.requests_.clear();
  other.peers_.clear();
  other.then_ = nullptr;
}

PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept {
  if (this != &other) {
    wait();
    requests_ = std::move(other.requests_);
    peers_ = std::move(other.peers_);
    comm_ = other.comm_;
    what_ = other.what_;
    keep_ = std::move(other.keep_);
    c10d_ = std::move(other.c10d_);
    then_ = std::move(other.then_);
    other.requests_.clear();
    other.peers_.clear();
    other.then_ = nullptr;
  }
  return *this;
}

PendingCollective::~PendingCollective() { wait(); }

void PendingCollective::wait() noexcept {
  // Reached when finish() was skipped (an exception between start and
  // finish): a collective cannot be cancelled, so wait for it (bounded by the
  // watchdog); its result is dropped.
  c10d_.reset();
  try {
    wait_requests();
  } catch (...) {  // a carried error or a failure: the result is dropped anyway
  }
  then_ = nullptr;
  keep_.clear();
}

int PendingCollective::wait_requests() {
  if (requests_.empty()) return 0;  // MPI_SUCCESS
#if !SHARDTENSOR_WITH_MPI
  no_mpi("PendingCollective::finish");
#else
  // Taken out first: if the wait raises (a carried error, Note [carried
  // errors]), the requests are abandoned, as a blocking call's would be,
  // and nothing waits on them again.
  std::vector<MPI_Request> requests = std::move(requests_);
  std::vector<int> peers = std::move(peers_);
  requests_.clear();
  peers_.clear();
  watchdog::WaitSite site;
  site.primitive = what_;
  site.comm = comm_;
  site.peers = peers.empty() ? nullptr : &peers;
  return watchdog::wait_all(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE,
                            site);
#endif
}

bool PendingCollective::pending() const {
  return !requests_.empty() || c10d_ != nullptr || then_ != nullptr;
}

bool PendingCollective::test() {
  if (c10d_ != nullptr) return c10d_->arrived();
  if (requests_.empty()) return true;
#if !SHARDTENSOR_WITH_MPI
  no_mpi("PendingCollective::test");
#else
  int done = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                                    MPI_STATUSES_IGNORE));
  return done != 0;
#endif
}

void PendingCollective::finish() {
  {
    CommTimer timer;
    if (c10d_ != nullptr) {
      auto x = std::move(c10d_);
      x->finish(what_);
    }
    SHARDTENSOR_MPI_CHECK(wait_requests());
  }
  if (then_) {
    auto then = std::move(then_);
    then_ = nullptr;
    then();
  }
  keep_.clear();
}

// ---- appended: test hook for Note [large counts] --------------------------------

int64_t set_max_count_for_testing(int64_t max_count) {
  TORCH_CHECK(max_count >= 1 && max_count <= INT_MAX,
              "shardtensor transport: set_max_count_for_testing(", max_count,
              ") must be in [1, INT_MAX]");
  return g_max_count.exchange(max_count);
}

// ---- communicator management (appended; issue 10) ---------------------------

namespace {
std::atomic<int64_t> g_live_duplicates{0};
}  // namespace

Comm duplicate(Comm comm) {
  if (c10d::owns(comm)) {
    std::vector<int> all(static_cast<size_t>(comm_size(comm)));
    std::iota(all.begin(), all.end(), 0);
    Comm dup = detail::pg::split(comm, all, "duplicate of a communicator", /*shared=*/false);
    g_live_duplicates.fetch_add(1);
    return dup;
  }
#if !SHARDTENSOR_WITH_MPI
  no_mpi("duplicate");
#else
  Comm dup = comm_null();
  SHARDTENSOR_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  g_live_duplicates.fetch_add(1);
  return dup;
#endif
}

void free_duplicate(Comm& comm) noexcept {
  if (c10d::owns(comm)) {
    g_live_duplicates.fetch_sub(1);
    detail::pg::free_group(comm);
    return;
  }
#if SHARDTENSOR_WITH_MPI
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm != comm_null()) g_live_duplicates.fetch_sub(1);
  if (!finalized && comm != comm_null()) MPI_Comm_free(&comm);
#endif
  comm = comm_null();
}

int64_t live_duplicates() { return g_live_duplicates.load(); }

}  // namespace shardtensor::comm::transport

// ---- neighbourhood collectives (issue 13) ----------------------------------------

namespace shardtensor::comm::transport {

#if SHARDTENSOR_WITH_MPI
namespace {

/// The graphs cached on one communicator (an MPI attribute; freed with it).
struct GraphCache {
  std::mutex mu;
  std::map<std::vector<int64_t>, Comm> graphs;
};

int free_graph_cache(Comm, int, void* attr, void*) {
  auto* cache = static_cast<GraphCache*>(attr);
  for (auto& [key, graph] : cache->graphs) {
    (void)key;
    MPI_Comm_free(&graph);
  }
  delete cache;
  return MPI_SUCCESS;
}

int graph_keyval() {
  static const int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    SHARDTENSOR_MPI_CHECK(
        MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_graph_cache, &k, nullptr));
    return k;
  }();
  return keyval;
}

std::mutex g_graph_mu;  // guards attaching a GraphCache to a communicator

GraphCache* graph_cache(Comm comm, bool create) {
  std::lock_guard<std::mutex> lock(g_graph_mu);
  void* attr = nullptr;
  int found = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_get_attr(comm, graph_keyval(), &attr, &found));
  if (found) return static_cast<GraphCache*>(attr);
  if (!create) return nullptr;
  auto* cache = new GraphCache();
  SHARDTENSOR_MPI_CHECK(MPI_Comm_set_attr(comm, graph_keyval(), cache));
  return cache;
}

/// One neighbour's runs as a committed datatype over a buffer read as
/// [outer, rows, row_bytes] (byte displacements from the buffer's start);
/// sets `bytes` to its payload. MPI_BYTE with count 0 when there is nothing.
MPI_Datatype runs_type(const std::vector<RowRun>& runs, int64_t outer, int64_t rows,
                       int64_t row_bytes, int64_t& bytes) {
  std::vector<MPI_Datatype> types;
  std::vector<MPI_Aint> displs;
  std::vector<int> lens;
  bytes = 0;
  for (const RowRun& r : runs) {
    TORCH_CHECK(r.step == 1 || r.step == -1, "shardtensor transport: row run step ", r.step);
    if (r.count == 0 || outer == 0 || row_bytes == 0) continue;
    // The run's rows of one outer slice (down for step -1: a negative stride),
    // then the outer slices.
    MPI_Datatype slice = MPI_DATATYPE_NULL, run = MPI_DATATYPE_NULL;
    SHARDTENSOR_MPI_CHECK(MPI_Type_create_hvector(
        to_count(r.count, "rows of a run"), to_count(row_bytes, "row bytes"),
        static_cast<MPI_Aint>(r.step * row_bytes), MPI_BYTE, &slice));
    SHARDTENSOR_MPI_CHECK(MPI_Type_create_hvector(
        to_count(outer, "outer slices"), 1, static_cast<MPI_Aint>(rows * row_bytes), slice, &run));
    MPI_Type_free(&slice);
    types.push_back(run);
    displs.push_back(static_cast<MPI_Aint>(r.first * row_bytes));
    lens.push_back(1);
    bytes += r.count * outer * row_bytes;
  }
  if (types.empty()) return MPI_BYTE;
  MPI_Datatype out = MPI_DATATYPE_NULL;
  SHARDTENSOR_MPI_CHECK(MPI_Type_create_struct(static_cast<int>(types.size()), lens.data(),
                                               displs.data(), types.data(), &out));
  SHARDTENSOR_MPI_CHECK(MPI_Type_commit(&out));
  for (auto& t : types) MPI_Type_free(&t);
  return out;
}

void free_types(std::vector<MPI_Datatype>& types) noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    for (auto& t : types) {
      if (t != MPI_BYTE && t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    }
  }
  types.clear();
}

}  // namespace
#endif  // SHARDTENSOR_WITH_MPI

Comm neighbor_graph(Comm comm, const std::vector<int64_t>& key, const std::vector<int>& sources,
                    const std::vector<int>& destinations) {
  if (c10d::owns(comm)) return comm_null();  // point-to-point halos (Note [c10d handles])
#if !SHARDTENSOR_WITH_MPI
  (void)key, (void)sources, (void)destinations;
  no_mpi("neighbor_graph");
#else
  GraphCache* cache = graph_cache(comm, /*create=*/true);
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    auto it = cache->graphs.find(key);
    if (it != cache->graphs.end()) return it->second;
    if (static_cast<int>(cache->graphs.size()) >= kMaxNeighborGraphs) return comm_null();
  }
  const int size = comm_size(comm);
  for (const auto* list : {&sources, &destinations}) {
    for (int r : *list) {
      TORCH_CHECK(r >= 0 && r < size, "shardtensor transport: neighbour ", r,
                  " is not a rank of a communicator of size ", size);
    }
  }
  Comm graph = comm_null();
  {
    CommTimer timer;
    SHARDTENSOR_MPI_CHECK(MPI_Dist_graph_create_adjacent(
        comm, static_cast<int>(sources.size()), sources.data(), MPI_UNWEIGHTED,
        static_cast<int>(destinations.size()), destinations.data(), MPI_UNWEIGHTED, MPI_INFO_NULL,
        /*reorder=*/0, &graph));
  }
  std::lock_guard<std::mutex> lock(cache->mu);
  cache->graphs.emplace(key, graph);
  return graph;
#endif
}

int64_t max_message_bytes() { return max_count(); }

// Note [neighbourhood collectives on Open MPI 5.0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On Debian 13's Open MPI 5.0.7 (checked in a Debian 13.8 chroot, 2026-11-28)
// MPI_Ineighbor_alltoallw and MPI_Neighbor_alltoallw fail with MPI_ERR_TYPE on
// every rank for the struct-of-hvector types that NeighborExchange builds
// (CommGatherRange.NeighbourhoodCollectivesMatchPointToPoint, 2 ranks, one
// neighbour each), although the same types pass MPI_Isend/MPI_Irecv's
// argument checks on the same communicator, and a stand-alone program with
// struct-of-hvector types (negative strides and empty neighbours included)
// works there. The rejection comes from the collective component, not from
// the argument checks of the MPI_ function (its checks are those of the
// point-to-point calls). Open MPI 4.1 takes the same types and gives results
// bit-identical to the point-to-point path. As the neighbourhood path is
// opt-in (Note [neighbourhood collectives]), Open MPI 5.x ignores the opt-in
// and keeps the point-to-point path, decided from the library version string
// alone, so every rank decides alike.
bool neighbor_collectives_usable() {
  static const bool usable =
      shardtensor::detail::mpi_library_version().rfind("Open MPI v5.", 0) != 0;
  return usable;
}

int64_t neighbor_graph_count(Comm comm) {
  if (c10d::owns(comm)) return 0;
#if !SHARDTENSOR_WITH_MPI
  no_mpi("neighbor_graph_count");
#else
  GraphCache* cache = graph_cache(comm, /*create=*/false);
  if (cache == nullptr) return 0;
  std::lock_guard<std::mutex> lock(cache->mu);
  return static_cast<int64_t>(cache->graphs.size());
#endif
}

NeighborExchange::NeighborExchange(int64_t outer, int64_t send_rows, int64_t recv_rows,
                                   int64_t row_bytes, const std::vector<std::vector<RowRun>>& sends,
                                   const std::vector<std::vector<RowRun>>& recvs)
    : send_bytes_(outer * send_rows * row_bytes),
      recv_bytes_(outer * recv_rows * row_bytes),
      outer_(outer),
      recv_rows_(recv_rows),
      row_bytes_(row_bytes),
      recv_runs_(recvs) {
#if !SHARDTENSOR_WITH_MPI
  // Made only for an MPI graph (neighbor_graph() gives none in a c10d-only build).
  no_mpi("NeighborExchange");
#else
  try {
    for (const auto& runs : sends) {
      sent_.push_back(0);
      send_types_.push_back(runs_type(runs, outer, send_rows, row_bytes, sent_.back()));
      send_counts_.push_back(sent_.back() > 0 ? 1 : 0);
    }
    for (const auto& runs : recvs) {
      received_.push_back(0);
      recv_types_.push_back(runs_type(runs, outer, recv_rows, row_bytes, received_.back()));
      recv_counts_.push_back(received_.back() > 0 ? 1 : 0);
    }
  } catch (...) {
    free_types(send_types_);
    free_types(recv_types_);
    throw;
  }
  send_displs_.assign(send_types_.size(), 0);
  recv_displs_.assign(recv_types_.size(), 0);
#endif
}

NeighborExchange::~NeighborExchange() {
#if SHARDTENSOR_WITH_MPI
  free_types(send_types_);
  free_types(recv_types_);
#endif
}

PendingExchange start_neighbor_exchange(const NeighborExchange& x, const at::Tensor& send,
                                        const at::Tensor& recv, Comm graph) {
  if (staged(send, graph) || staged(recv, graph)) {  // Note [host staging]
    const at::Tensor hs = stage_in(send, graph);
    const at::Tensor hr = stage_recv(recv, graph);
    PendingExchange ex;
    {
      StagedScope scope;
      ex = start_neighbor_exchange(x, hs, hr, graph);
    }
    if (!hr.is_same(recv)) {
      // Only the rows the messages write go back: the caller fills the others
      // while the exchange is in flight (the halo's fills and own rows).
      const std::vector<int64_t> shape{x.outer_, x.recv_rows_, x.row_bytes_};
      ex.copy_back_.emplace_back([shape, runs = x.recv_runs_, recv, hr] {
        at::Tensor d = bytes_of(recv).view(shape), h = bytes_of(hr).view(shape);
        for (const auto& peer_runs : runs) {
          for (const RowRun& r : peer_runs) {
            if (r.count <= 0) continue;
            const int64_t lo = r.step > 0 ? r.first : r.first - r.count + 1;
            d.narrow(1, lo, r.count).copy_(h.narrow(1, lo, r.count), hr.is_pinned());
            detail::record_staged(shape[0] * r.count * shape[2]);
          }
        }
      });
    }
    return ex;
  }
  check_buffer(send, "neighbourhood exchange send buffer", graph);
  check_buffer(recv, "neighbourhood exchange receive buffer", graph);
  TORCH_CHECK(nbytes(send) == x.send_bytes_ && nbytes(recv) == x.recv_bytes_,
              "shardtensor transport: neighbourhood exchange buffers of ", nbytes(send), " and ",
              nbytes(recv), " bytes, but the layout is for ", x.send_bytes_, " and ",
              x.recv_bytes_);
#if !SHARDTENSOR_WITH_MPI
  no_mpi("start_neighbor_exchange");
#else
  int indegree = 0, outdegree = 0, weighted = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Dist_graph_neighbors_count(graph, &indegree, &outdegree, &weighted));
  TORCH_CHECK(indegree == static_cast<int>(x.recv_types_.size()) &&
                  outdegree == static_cast<int>(x.send_types_.size()),
              "shardtensor transport: the graph has ", indegree, " sources and ", outdegree,
              " destinations, the layout ", x.recv_types_.size(), " and ", x.send_types_.size());
  CommTimer timer;
  PendingExchange ex;
  ex.comm_ = graph;
  ex.collective_ = true;
  ex.buffers_ = {send, recv};
  ex.requests_.push_back(null_request());
  // The count, displacement and type arrays live in `x`, which outlives the
  // exchange (MPI reads them until completion).
  SHARDTENSOR_MPI_CHECK(MPI_Ineighbor_alltoallw(
      ptr(send), x.send_counts_.data(), x.send_displs_.data(), x.send_types_.data(), ptr(recv),
      x.recv_counts_.data(), x.recv_displs_.data(), x.recv_types_.data(), graph,
      &ex.requests_.back()));
  int64_t sent = 0, received = 0, messages = 0;
  for (int64_t b : x.sent_) {
    sent += b;
    messages += b > 0 ? 1 : 0;
  }
  for (int64_t b : x.received_) received += b;
  detail::record_comm(sent, received, messages);
  return ex;
#endif
}

}  // namespace shardtensor::comm::transport
