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
///    ranks being those whose messages did not arrive (point-to-point). An MPI
///    collective does not tell a rank which ranks have not joined it; the
///    wait board (below) does;
///  - the launcher ends the rank with SIGTERM (mpirun and torchrun do, to the
///    survivors, when a rank died): a handler (installed only where SIGTERM
///    had its default action) writes the same fields with async-signal-safe
///    calls, then lets SIGTERM end the process.
/// Under the MPI transport a dead process is seen by the launcher, not by the
/// survivors (Open MPI's mpirun ends the job at once); docs/reliability.md says
/// what each launcher does.
///
/// The wait board (MPI transport; core/wait_board.h). init() starts a c10d
/// TCPStore served by world rank 0 beside MPI. The fast path never touches
/// it: a wait posts on it only once it has lasted post_after = min(1 s, 5% of
/// SHARDTENSOR_TIMEOUT) (0.15 s at the tests' 3 s), under "wait/<world rank>":
/// its last call (primitive, sequence number, communicator key and world
/// ranks) and the step, or the step alone for requests an earlier call
/// started; it withdraws the post when the wait ends. While posted it looks
/// every max(0.1 s, min(1 s, 1% of the timeout)) for an expiry mark on its
/// call (one key check).
/// When the watchdog expires, the rank marks its call as expiring on the board
/// (compareSet: the first rank is named as such in the others' lines); a rank
/// posted in the same call that sees the mark expires too. A collective then
/// reads every member's post (one multiGet every 50 ms) for a grace of
/// post_after + 0.5 s, while still polling its requests (a collective that
/// completes meanwhile names nobody), and names as missing every member that
/// posted neither this call nor a later call of the same communicator, with
/// what it posted instead ("waits in all_reduce call #36 on world ranks
/// [...]", or "reported no wait: it is computing, in a wait shorter than the
/// post threshold, or dead"); a point-to-point wait names its missing peers
/// from its requests at once. Each rank prints its line, counts itself as
/// printed, and calls MPI_Abort once every rank posted in the call has
/// printed (or after grace + 2 looks + 0.5 s), so that the first MPI_Abort
/// does not silence the others.
/// What is exact and what is not: a member posted in this call has joined
/// it; a member that joined by the expiry and still waited post_after later
/// has posted (the grace covers it, unless its host stalls it longer).
/// A member named missing had not posted this call by the end of the grace:
/// for a collective whose result needs every input (all-reduce, all-gather,
/// reduce-scatter, all-to-all, barrier) it has not joined (nobody can leave
/// such a call early); for a rooted one (broadcast) the root may have left
/// the call early without posting. A post outlives a process killed while
/// waiting (under mpirun the launcher then ends the job first). Ranks that
/// wait in another call (a chain: rank 1 waits in call A for rank 0, which
/// waits in call B) are not held back from the first MPI_Abort; their SIGTERM
/// handler prints their wait without the board. When the
/// board cannot start (no network, SHARDTENSOR_WAIT_BOARD=0) or a store
/// operation fails (2 s bound each), the line keeps the old wording ("one or
/// more of world ranks [...]"); the SIGTERM handler cannot reach the board.

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
/// communicator, the communicator's key `comm_key` (CallId::comm_key, the same
/// on every member) and the communicator's world ranks. Never throws.
void record(const char* name, uint64_t seq, uint64_t comm_key,
            const std::vector<int>& world_ranks) noexcept;

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

/// Local, best effort, bounded (one store round trip; MPI wait board only,
/// core/wait_board.h). Posts this rank's long wait in `step` on the board:
/// the last recorded call when `in_last_call`, else the step alone (a wait on
/// requests that an earlier call started). Returns whether it posted.
bool post_wait(const char* step, bool in_last_call) noexcept;
/// Local, best effort, bounded. Withdraws this rank's post (the wait ended).
void withdraw_wait() noexcept;

/// What the wait board says about the last recorded call.
struct BoardView {
  bool ok = false;           // the board was read (else the fields below are empty)
  std::vector<int> missing;  // world ranks not in this call nor past it, sorted
  std::string detail;        // "world rank 2 reported no wait ...; world rank 3 waits in ..."
  int in_call = 0;           // ranks posted in this call, this rank included
};
/// Local, bounded (one store round trip). Reads the posts of `world_ranks`
/// (the communicator of the last recorded call; this rank's own is skipped)
/// and returns those that are neither in that call nor in a later call of the
/// same communicator, with what each posted instead.
BoardView read_board(const std::vector<int>& world_ranks) noexcept;

/// Local, bounded. Marks the last recorded call as expiring (the watchdog of
/// some rank in it expired; the first rank to mark it is its author) and
/// returns the author's world rank (-1 when the board cannot be reached).
int mark_expiring() noexcept;
/// Local, bounded. The author of the last recorded call's expiry mark, or -1.
int expiring_by() noexcept;
/// Local, best effort, bounded. Removes the mark (the call completed after
/// all, within the grace), so that no later wait mistakes it for its own.
void clear_expiring() noexcept;
/// Local, bounded. Counts this rank as having printed its line for the last
/// recorded call, then waits (at most `seconds`) until `n` ranks have.
void printed_and_wait(int n, double seconds) noexcept;

/// Formats a list of ints "[a, b, c]".
std::string rank_list(const std::vector<int>& ranks);

}  // namespace shardtensor::comm::flight
