#pragma once
/// \file The flight recorder: each rank's last primitive calls and its current
/// wait, for the line that names a dead or missing rank (private to comm/).
///
/// Note [flight recorder]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// Like PyTorch's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE), every rank
/// keeps its last kRingSize primitive calls: the primitive's name, the call's
/// sequence number on its communicator (the numbering of Note [carried
/// errors], identical on every rank) and the communicator's world ranks. It
/// costs a few stores per call and no message. While a transport wait is in
/// progress the rank also keeps what it waits for: the transport step and,
/// for point-to-point waits (every c10d wait, and MPI exchanges), the world
/// ranks whose messages have not arrived.
///
/// When a job cannot go on, every surviving rank prints what it knows exactly,
/// in one line that starts with "shardtensor: world rank R lost ..." or
/// "shardtensor watchdog: ..." followed by the flight recorder's line
/// ("shardtensor flight recorder: world rank R, last calls: ..."):
///  - a peer's connection closed (c10d: the process died or ended): the
///    survivor names the call, its sequence number, the communicator and the
///    peer whose connection closed. Before it ends itself (exit code
///    kRankLostExitCode) it posts "world rank R left because it lost world
///    rank D" in the rendezvous store, so that a rank that then sees R's
///    connection close names D, the rank that really died, and says that R
///    left because of it (an exact chain, not a guess);
///  - the watchdog expires (Note [watchdog]): the same fields, the missing
///    ranks being those whose messages did not arrive (point-to-point); for an
///    MPI collective a rank cannot see which ranks have not joined, and the
///    line says so instead of guessing;
///  - the launcher ends the rank with SIGTERM (mpirun and torchrun do, to the
///    survivors, when a rank died): a handler (installed only where SIGTERM
///    had its default action) writes the same fields with async-signal-safe
///    calls, then lets SIGTERM end the process.
/// Under the MPI transport a dead process is seen by the launcher, not by the
/// survivors (Open MPI's mpirun ends the job at once); docs/reliability.md says
/// what each launcher does.

#include <shardtensor/core/comm.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardtensor::comm::flight {

/// Exit code of a rank that ended itself because a peer's connection closed
/// (a process of the job died or ended without finalizing).
constexpr int kRankLostExitCode = 87;

/// Calls kept per rank.
constexpr int kRingSize = 16;

/// Local, a few stores. Records the entry of primitive `name` (a string that
/// lives for the whole run), the call's sequence number `seq` on its
/// communicator and the communicator's world ranks. Never throws.
void record(const char* name, uint64_t seq, const std::vector<int>& world_ranks) noexcept;

/// Local. Marks a transport wait in progress on this thread (one at a time):
/// `step` names the transport step (a string that lives for the whole run),
/// `peers` are the world ranks whose messages it waits for (empty: a
/// collective over `world_ranks`). Never throws.
void begin_wait(const char* step, const std::vector<int>& world_ranks,
                const std::vector<int>& peers) noexcept;
/// Local. The first `done` peers of the current wait have arrived.
void wait_progress(int done) noexcept;
/// Local. Ends the current wait.
void end_wait() noexcept;

/// Local. "all_reduce call #37 on world ranks [0, 1, 2]": the last recorded
/// call (or "no primitive call yet").
std::string last_call();

/// Local. The flight recorder's line: this rank's last calls, oldest first.
std::string history_line();

/// Local. Prints `line`, then history_line(), to stderr and ends the process
/// with `code` (shardtensor::abort). Never returns.
[[noreturn]] void fail_job(const std::string& line, int code);

/// Local, best effort, bounded: posts in the rendezvous store (c10d only)
/// that this rank leaves because world rank `lost` died.
void post_lost(int lost) noexcept;

/// Local, best effort, bounded: if world rank `peer` posted that it left
/// because it lost another rank, that rank; else -1 (c10d only).
int lost_by(int peer) noexcept;

/// Local, best effort, bounded: follows lost_by() from `peer` (at most
/// kRingSize hops, never through this rank) to the rank at the end of the
/// chain; `peer` itself when it posted nothing (c10d only).
int root_of(int peer) noexcept;

/// Formats a list of ints "[a, b, c]".
std::string rank_list(const std::vector<int>& ranks);

}  // namespace shardtensor::comm::flight
