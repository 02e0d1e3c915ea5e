// The c10d transport (Note [c10d data movement] in transport_c10d.h): the only
// file that moves tensor data over c10d process groups.
#include "comm/transport_c10d.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/spec/shard_spec.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/error_channel.h"
#include "comm/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <numeric>
#include <sstream>
#include <thread>

namespace shardtensor::comm::c10d {

namespace {

using Clock = std::chrono::steady_clock;

// Tag of the collectives built here; split-phase exchanges use their callers' tags.
constexpr int kCollectiveTag = 7100;

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

// The bytes [offset, offset + n) of a contiguous tensor as a flat uint8 tensor (a view).
at::Tensor bytes_of(const at::Tensor& t, int64_t offset, int64_t n) {
  if (n == 0) return at::empty({0}, at::kByte);
  auto flat = at::from_blob(static_cast<char*>(t.data_ptr()) + offset, {n},
                            at::TensorOptions().dtype(at::kByte));
  return flat;
}

[[noreturn]] void expire(const char* what, Comm comm, const std::vector<int>& peers, double waited,
                         double limit) {
  std::ostringstream os;
  const char* op = OpLabel::current();
  const auto& world = detail::pg::world_ranks(comm);
  std::vector<int> missing;
  for (int p : peers) missing.push_back(world[p]);
  os << "shardtensor watchdog: world rank " << shardtensor::world_rank() << " waited " << waited
     << " s (SHARDTENSOR_TIMEOUT = " << limit << " s) in " << what << " during op '"
     << (*op != '\0' ? op : "<none>") << "' on c10d group '" << detail::pg::name(comm)
     << "' of size " << detail::pg::size(comm) << " (this process is its rank "
     << detail::pg::rank(comm) << ") for peers [";
  for (size_t i = 0; i < peers.size(); ++i) os << (i ? ", " : "") << peers[i];
  os << "] (point-to-point); its last primitive call: " << flight::last_call()
     << "; missing: world ranks " << flight::rank_list(missing)
     << " (their messages did not arrive; Note [flight recorder])";
  // Say whom this rank waited for, so that a rank that then sees this one's
  // connection close, or whose wait for this one expires too, names that
  // rank; and name whom the missing rank itself waits for, if it said so.
  if (!missing.empty()) {
    flight::post_lost(missing.front());
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    const int root = flight::root_of(missing.front());
    if (root != missing.front()) {
      os << "; world rank " << missing.front() << " itself waits for world rank " << root;
    }
  }
  os << "; aborting the job with exit code " << kWatchdogExitCode;
  flight::fail_job(os.str(), kWatchdogExitCode);
}

/// Whether a Gloo error says that the connection to the peer is gone (the
/// peer process died or ended), rather than a failure of this operation.
bool connection_lost(const std::string& error) {
  for (const char* needle : {"Connection closed by peer", "Connection reset by peer", "Broken pipe",
                             "Connection refused", "closed by peer"}) {
    if (error.find(needle) != std::string::npos) return true;
  }
  return false;
}

/// A peer's connection closed (Note [flight recorder]): names the call and the
/// missing rank, tells the other survivors through the store why this rank
/// leaves, and ends this process with kRankLostExitCode.
[[noreturn]] void lost(const char* what, Comm comm, int peer, const std::string& error) {
  const int me = shardtensor::world_rank();
  const auto& world = detail::pg::world_ranks(comm);
  const int peer_world = world[peer];
  // Did the peer end itself because it lost another rank? Then that rank is
  // the missing one (the peer said so in the store before it left).
  const int chain = flight::root_of(peer_world);
  const int missing = chain != me ? chain : peer_world;
  const char* op = OpLabel::current();
  std::ostringstream os;
  os << "shardtensor: world rank " << me << " lost world rank " << missing << " in " << what
     << " during op '" << (*op != '\0' ? op : "<none>")
     << "' (its last primitive call: " << flight::last_call() << ", c10d group '"
     << detail::pg::name(comm) << "'): ";
  if (missing != peer_world) {
    os << "world rank " << peer_world << ", whose messages this rank waited for, left (it "
       << "waited for world rank " << missing << ", directly or through ranks that left), and "
       << "its connection closed";
  } else {
    os << "the connection to world rank " << peer_world
       << ", whose messages this rank waited for, closed (the process died or ended)";
  }
  std::string first_line = error.substr(0, error.find('\n'));
  os << "; missing: world rank " << missing << "; ending this process with exit code "
     << flight::kRankLostExitCode << " (Note [flight recorder]) [Gloo: " << first_line << "]";
  flight::post_lost(missing);
  flight::fail_job(os.str(), flight::kRankLostExitCode);
}

}  // namespace

struct Exchange::Impl {
  Comm comm = comm_null();
  std::vector<c10::intrusive_ptr<::c10d::Work>> works;  // receives first, then sends
  std::vector<int> peers;                               // per work
  std::vector<at::Tensor> keep;                         // keep-alive of the buffers
};

Exchange::Exchange() = default;
Exchange::~Exchange() {
  if (pending()) {
    try {
      finish("abandoned exchange (c10d send/recv)");
    } catch (...) {
    }
  }
}
Exchange::Exchange(Exchange&&) noexcept = default;
Exchange& Exchange::operator=(Exchange&& other) noexcept {
  if (this != &other) {
    if (pending()) {
      try {
        finish("abandoned exchange (c10d send/recv)");
      } catch (...) {
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

bool Exchange::pending() const { return impl_ != nullptr; }

bool Exchange::arrived() const { return impl_ == nullptr || impl_->works.empty(); }

void Exchange::finish(const char* what) {
  if (impl_ == nullptr) return;
  std::unique_ptr<Impl> impl = std::move(impl_);
  if (impl->works.empty()) return;
  const double limit = shardtensor::timeout();
  const auto start = Clock::now();
  {
    const auto& world = detail::pg::world_ranks(impl->comm);
    std::vector<int> peers;
    peers.reserve(impl->peers.size());
    for (int p : impl->peers) peers.push_back(world[p]);
    flight::begin_wait(what, world, peers);
  }
  struct EndWait {
    ~EndWait() { flight::end_wait(); }
  } end_wait;
  // Carried errors reach this wait through the store (Note [carried errors]):
  // a monitor thread aborts the Gloo waits when it finds one.
  Impl* live = impl.get();
  errors::StoreWatch watch([live] {
    for (auto& w : live->works) w->abort();
  });
  bool abandoned = false;
  // Note [c10d waits cut short]: Gloo's abort() does not make wait() throw;
  // an aborted send/recv wait returns false instead. A wait that returned
  // true completed before any abort, so an exchange whose every wait returned
  // true completed on this rank even when the monitor interrupted it
  // afterwards: it returns normally, and the job, poisoned, raises at this
  // rank's next primitive (as a completed MPI wait does, Note [carried
  // errors]). Otherwise a rank leaving an earlier call (a warm-up barrier)
  // would raise outside the code that made the failing call. A wait aborted
  // after its message arrived also returns false: that exchange is treated as
  // cut short, which is only conservative.
  bool cut_short = false;
  for (size_t i = 0; i < impl->works.size(); ++i) {
    flight::wait_progress(static_cast<int>(i));
    auto& work = impl->works[i];
    std::chrono::milliseconds left{0};  // 0: no timeout (c10d::kNoTimeout)
    if (limit > 0) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      // Rounded up, plus 1 ms: Gloo's own timeout must not fire before the
      // watchdog's limit, or the check below (waited >= limit) misses it and
      // the expiry is reported as a plain failure instead of the watchdog's
      // message and exit code (truncating gave a wait 1 ms short: CTest
      // watchdog.skip_exchange.torchrun.np2 failed once in a CI run).
      left = std::chrono::milliseconds(
          std::max<int64_t>(1, static_cast<int64_t>(std::ceil((limit - waited) * 1000.0)) + 1));
    }
    try {
      if (!work->wait(left)) cut_short = true;
    } catch (const std::exception& e) {
      if (watch.interrupted()) {
        cut_short = true;
        break;
      }
      // A peer that raised a carried error may have left before this rank's
      // monitor read the store: report its error, not its death.
      if (errors::poll_store()) {
        abandoned = true;
        break;
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (limit > 0 && waited >= limit) {
        // Exactly the peer of the message that timed out (the later works
        // were never waited for, so nothing is known of them).
        expire(what, impl->comm, {impl->peers[i]}, waited, limit);
      }
      const int peer = impl->peers[i];
      if (connection_lost(e.what())) lost(what, impl->comm, peer, e.what());
      const auto& world = detail::pg::world_ranks(impl->comm);
      TORCH_CHECK(false, "shardtensor transport: ", what, " on c10d group '",
                  detail::pg::name(impl->comm), "' failed waiting for rank ", peer, " (world rank ",
                  world[peer], "): ", e.what());
    }
    if (cut_short) break;
  }
  if (abandoned || cut_short) {
    // The messages still posted may land later: their buffers must outlive
    // them, so the abandoned exchange is kept (the job is poisoned and ends
    // at finalize).
    static auto* kept = new std::vector<std::unique_ptr<Impl>>();
    kept->push_back(std::move(impl));
    // Only the monitor aborts these works, after it has marked the watch.
    TORCH_CHECK(abandoned || watch.interrupted(), "shardtensor transport: ", what,
                ": a Gloo wait returned without completing and without an abort");
    watch.raise(what);
  }
}

namespace {

// Posts one Gloo send or receive; a connection already gone ends the job like
// a wait on it would (Note [flight recorder]).
c10::intrusive_ptr<::c10d::Work> post(::c10d::ProcessGroup& pg, bool send,
                                      std::vector<at::Tensor>& bufs, int peer, int tag, Comm comm) {
  try {
    return send ? pg.send(bufs, peer, tag) : pg.recv(bufs, peer, tag);
  } catch (const std::exception& e) {
    if (connection_lost(e.what())) {
      const char* what = send ? "posting a c10d send" : "posting a c10d receive";
      if (errors::poll_store()) errors::raise_poisoned(what);
      lost(what, comm, peer, e.what());
    }
    throw;
  }
}

}  // namespace

Exchange start(const std::vector<Message>& sends, const std::vector<Message>& recvs, Comm comm,
               int tag) {
  auto& pg = detail::pg::process_group(comm);
  const int me = detail::pg::rank(comm);
  const int size = detail::pg::size(comm);
  for (const auto* list : {&sends, &recvs}) {
    for (const auto& m : *list) {
      TORCH_CHECK(m.peer >= 0 && m.peer < size, "shardtensor transport: exchange peer ", m.peer,
                  " is not a rank of a c10d group of size ", size);
      TORCH_CHECK(m.buffer.is_contiguous() && m.buffer.device().is_cpu(),
                  "shardtensor transport: exchange buffers must be contiguous CPU tensors");
    }
  }
  Exchange ex;
  ex.impl_ = std::make_unique<Exchange::Impl>();
  ex.impl_->comm = comm;
  // Messages to this rank itself: copied in order (receive i from me gets send i to me).
  std::deque<const at::Tensor*> self_recvs;
  for (const auto& m : recvs) {
    const int64_t n = nbytes(m.buffer);
    if (n == 0) continue;
    if (m.peer == me) {
      self_recvs.push_back(&m.buffer);
      continue;
    }
    std::vector<at::Tensor> bufs{bytes_of(m.buffer, 0, n)};
    ex.impl_->works.push_back(post(pg, /*send=*/false, bufs, m.peer, tag, comm));
    ex.impl_->peers.push_back(m.peer);
    ex.impl_->keep.push_back(m.buffer);
  }
  for (const auto& m : sends) {
    const int64_t n = nbytes(m.buffer);
    if (n == 0) continue;
    if (m.peer == me) {
      TORCH_CHECK(!self_recvs.empty(), "shardtensor transport: exchange sends ", n,
                  " bytes to this rank itself without a matching receive");
      const at::Tensor& dst = *self_recvs.front();
      self_recvs.pop_front();
      TORCH_CHECK(nbytes(dst) == n, "shardtensor transport: exchange received ", n,
                  " bytes from this rank itself but expected ", nbytes(dst));
      bytes_of(dst, 0, n).copy_(bytes_of(m.buffer, 0, n));
      continue;
    }
    std::vector<at::Tensor> bufs{bytes_of(m.buffer, 0, n)};
    ex.impl_->works.push_back(post(pg, /*send=*/true, bufs, m.peer, tag, comm));
    ex.impl_->peers.push_back(m.peer);
    ex.impl_->keep.push_back(m.buffer);
  }
  TORCH_CHECK(self_recvs.empty(), "shardtensor transport: exchange expects ", self_recvs.size(),
              " message(s) from this rank itself that it does not send");
  return ex;
}

void all_to_allv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
                 const std::vector<int64_t>& send_displs, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs,
                 Comm comm) {
  const int size = detail::pg::size(comm);
  std::vector<Message> sends, recvs;
  for (int c = 0; c < size; ++c) {
    if (send_bytes[c] > 0) sends.push_back({c, bytes_of(send, send_displs[c], send_bytes[c])});
    if (recv_bytes[c] > 0) recvs.push_back({c, bytes_of(recv, recv_displs[c], recv_bytes[c])});
  }
  start(sends, recvs, comm, kCollectiveTag).finish("all_to_allv (c10d send/recv)");
}

Exchange start_all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                           const std::vector<int64_t>& recv_bytes, Comm comm) {
  const int size = detail::pg::size(comm);
  const int me = detail::pg::rank(comm);
  std::vector<Message> sends, recvs;
  int64_t offset = 0;
  for (int c = 0; c < size; ++c) {
    if (c == me) {
      if (recv_bytes[c] > 0) {
        bytes_of(recv, offset, recv_bytes[c]).copy_(bytes_of(send, 0, recv_bytes[c]));
      }
    } else {
      if (recv_bytes[c] > 0) recvs.push_back({c, bytes_of(recv, offset, recv_bytes[c])});
      if (recv_bytes[me] > 0) sends.push_back({c, bytes_of(send, 0, recv_bytes[me])});
    }
    offset += recv_bytes[c];
  }
  return start(sends, recvs, comm, kCollectiveTag);
}

void all_gatherv(const at::Tensor& send, const at::Tensor& recv,
                 const std::vector<int64_t>& recv_bytes, Comm comm) {
  start_all_gatherv(send, recv, recv_bytes, comm).finish("all_gatherv (c10d send/recv)");
}

void broadcast_(const at::Tensor& t, int root, Comm comm) {
  const int size = detail::pg::size(comm);
  const int me = detail::pg::rank(comm);
  const int64_t n = nbytes(t);
  if (size == 1 || n == 0) return;
  std::vector<Message> sends, recvs;
  if (me == root) {
    for (int c = 0; c < size; ++c) {
      if (c != root) sends.push_back({c, bytes_of(t, 0, n)});
    }
  } else {
    recvs.push_back({root, bytes_of(t, 0, n)});
  }
  start(sends, recvs, comm, kCollectiveTag).finish("broadcast_ (c10d send/recv)");
}

void scatterv(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, Comm comm) {
  const int size = detail::pg::size(comm);
  const int me = detail::pg::rank(comm);
  std::vector<Message> sends, recvs;
  if (me == root) {
    int64_t offset = 0;
    for (int c = 0; c < size; ++c) {
      if (send_bytes[c] > 0) {
        if (c == me) {
          bytes_of(recv, 0, send_bytes[c]).copy_(bytes_of(send, offset, send_bytes[c]));
        } else {
          sends.push_back({c, bytes_of(send, offset, send_bytes[c])});
        }
      }
      offset += send_bytes[c];
    }
  } else if (nbytes(recv) > 0) {
    recvs.push_back({root, bytes_of(recv, 0, nbytes(recv))});
  }
  start(sends, recvs, comm, kCollectiveTag).finish("scatterv (c10d send/recv)");
}

namespace {

// acc = acc (op) x, element-wise, in acc's dtype (MPI's semantics per dtype:
// bool Sum/Max are or, Min/Product and; complex has Sum and Product only).
//
// Note [complex sums]: libtorch's complex add computes a + alpha * b with
// alpha = 1 + 0i multiplied in full, so an infinite b turns into NaN:
// (-1-1i) + (inf+inf i) and even 0 + (inf+inf i) give nan+nan i, while
// (inf+inf i) + (-1-1i) and at::sum over both give inf+inf i (libtorch
// 2.13 CPU, float and double). A sum over ranks stands for one libtorch
// reduction (at::sum, or a matmul's accumulation), which adds the real and
// imaginary parts separately; so the contributions are added through the
// real view: the same finite values, and Inf/NaN where the summands' parts
// have them, whatever the rank order (an empty piece's zero included).

void combine_(at::Tensor& acc, const at::Tensor& x, ReduceOp op) {
  if (acc.scalar_type() == at::kBool) {
    if (op == ReduceOp::Sum || op == ReduceOp::Max) {
      acc.logical_or_(x);
    } else {
      acc.logical_and_(x);
    }
    return;
  }
  TORCH_CHECK(!acc.is_complex() || op == ReduceOp::Sum || op == ReduceOp::Product,
              "shardtensor transport: ", op == ReduceOp::Max ? "Max" : "Min", " of complex values");
  switch (op) {
    case ReduceOp::Sum:
      if (acc.is_complex()) {
        // Note [complex sums]: componentwise, as libtorch's sum kernel.
        at::view_as_real(acc).add_(at::view_as_real(x.resolve_conj()));
      } else {
        acc.add_(x);
      }
      return;
    case ReduceOp::Product:
      acc.mul_(x);
      return;
    case ReduceOp::Max:
      at::maximum_out(acc, acc, x);
      return;
    case ReduceOp::Min:
      at::minimum_out(acc, acc, x);
      return;
  }
}

}  // namespace

Exchange start_reduce_scatter(const at::Tensor& send, const std::vector<int64_t>& recv_numel,
                              Comm comm, at::Tensor& contributions) {
  at::NoGradGuard no_grad;
  const int size = detail::pg::size(comm);
  const int me = detail::pg::rank(comm);
  const int64_t elem = send.element_size();
  const int64_t mine = recv_numel[me];
  // Every rank's contribution to my chunk, in rank order; summed in that order
  // by finish_reduce_scatter().
  contributions = at::empty({size, mine}, send.options());
  std::vector<Message> sends, recvs;
  int64_t offset = 0;
  for (int c = 0; c < size; ++c) {
    const int64_t n = recv_numel[c];
    if (c == me) {
      if (n > 0) contributions[c].copy_(send.reshape({-1}).narrow(0, offset, n));
    } else {
      if (n > 0) sends.push_back({c, bytes_of(send, offset * elem, n * elem)});
      if (mine > 0) recvs.push_back({c, contributions[c]});
    }
    offset += n;
  }
  return start(sends, recvs, comm, kCollectiveTag);
}

// Also the MPI transport's reduce-scatter of floating values (Note [ordered
// sums] in transport_mpi.cpp): one home for the order of every float sum.
void finish_reduce_scatter(const at::Tensor& contributions, const at::Tensor& recv, ReduceOp op) {
  at::NoGradGuard no_grad;  // moving data: the buffers may be tensors that require grad
  const int64_t size = contributions.size(0);
  const int64_t mine = contributions.size(1);
  if (mine == 0) return;
  const bool wide =
      contributions.scalar_type() == at::kHalf || contributions.scalar_type() == at::kBFloat16;
  at::Tensor acc = wide ? contributions[0].to(at::kFloat) : contributions[0].clone();
  for (int64_t c = 1; c < size; ++c) {
    combine_(acc, wide ? contributions[c].to(at::kFloat) : contributions[c], op);
  }
  recv.reshape({-1}).narrow(0, 0, mine).copy_(acc);
}

void reduce_scatter(const at::Tensor& send, const at::Tensor& recv,
                    const std::vector<int64_t>& recv_numel, ReduceOp op, Comm comm) {
  at::Tensor contributions;
  start_reduce_scatter(send, recv_numel, comm, contributions)
      .finish("reduce_scatter (c10d send/recv)");
  finish_reduce_scatter(contributions, recv, op);
}

void all_reduce_(const at::Tensor& t, ReduceOp op, Comm comm) {
  const int size = detail::pg::size(comm);
  const int me = detail::pg::rank(comm);
  const int64_t numel = t.numel();
  if (size == 1 || numel == 0) return;
  // The chunks of the MPI path's ordered all-reduce (Note [ordered sums]).
  const std::vector<int64_t> chunks = balanced_sizes(numel, size);
  std::vector<int64_t> chunk_bytes(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) chunk_bytes[c] = chunks[c] * t.element_size();
  at::Tensor mine = at::empty({chunks[me]}, t.options());
  reduce_scatter(t, mine, chunks, op, comm);
  all_gatherv(mine, t, chunk_bytes, comm);
}

void barrier(Comm comm) {
  const int size = detail::pg::size(comm);
  if (size == 1) return;
  at::Tensor one = at::zeros({1}, at::kByte);
  all_reduce_(one, ReduceOp::Max, comm);
}

}  // namespace shardtensor::comm::c10d
