#pragma once
/// \file Carried errors: a validation that fails on some ranks only becomes an
/// error on every rank (private to comm/; run_as_op is also the dispatcher's
/// and the backward formulas').
///
/// Note [carried errors]
/// ~~~~~~~~~~~~~~~~~~~~~
/// Most argument checks of a primitive see only values that are the same on
/// every rank and throw alike everywhere. Checks of the *local* tensor (its
/// extent along the sharded dim, its rank, its dtype) can fail on one rank
/// only; before, that rank threw while the others entered the primitive's
/// communication and waited for it until the watchdog ended the job
/// (SHARDTENSOR_DEBUG=1 avoided this with an extra all-reduce per primitive).
/// Without debug mode, and without any extra message on the success path,
/// errors are now carried:
///  - Every primitive call on a communicator C gets a sequence number k
///    (ranks call primitives on C in the same order, Note [collective
///    discipline]), so (C, k) names the call on every rank.
///  - A rank whose checks fail posts the error, tagged (C, k), to every other
///    rank of C on the error channel (the library's duplicate of
///    MPI_COMM_WORLD), then throws it.
///  - Every blocking wait polls the channel (one MPI_Iprobe per poll, in the
///    watchdog's loop), and so does the entry of every primitive. A rank that
///    finds the error at the entry of the same call (C, k) throws it before
///    it communicates and tells the others of C it failed alike. A rank that
///    finds it while waiting (it has already posted its messages or its part
///    of a collective) cancels what it can, throws it, and *poisons* the job:
///    it tells every rank that communication is now inconsistent (its
///    abandoned collective could match a later call), and from then on every
///    primitive on every rank raises at entry.
///  - A rank that failed does not move on blindly: at its next primitive (or
///    at finalize) it waits, watchdog-bounded, until every other rank of C has
///    either failed alike (then nothing is lost and the job continues, as
///    when every rank rejects the same bad argument) or poisoned the job
///    (then it raises too).
///  - A poisoned job cannot finalize MPI safely (collectives were abandoned),
///    so shardtensor::finalize() ends it with MPI_Abort(kCarriedErrorExitCode)
///    after printing one line, instead of hanging in MPI_Finalize.
/// So every rank throws, names the op and the failing rank, and nothing hangs
/// or computes on with half-finished communication. With SHARDTENSOR_TIMEOUT=0
/// waits still poll (they only never expire).
///
/// Under the c10d transport (Note [c10d handles]) there is no probe or
/// cancel; the channel is the rendezvous store (a list of messages under
/// "carried/", every rank reading it in order and keeping what is addressed
/// to it), which also survives a broken Gloo pair. Calls are numbered alike.
/// The entry of a primitive reads the store only while this rank awaits
/// verdicts (a store round trip per call would cost the success path), so a
/// rank learns of another's failure in its waits: a monitor thread reads the
/// store every kStorePollSeconds while a wait lasts and, for an error of a
/// call this rank has entered, poisons and aborts the Gloo waits (StoreWatch).
/// So over c10d a failure on one rank only always poisons the job (every rank
/// raises, the next op raises everywhere, finalize exits with
/// kCarriedErrorExitCode), and a failure on every rank alike is settled as
/// under MPI (the job goes on). At finalize the ranks of a poisoned job end
/// together (a counter in the store, watchdog-bounded): torchrun's agent
/// ends every rank within 0.1 s of the first one's exit, which could be
/// before a slower rank has read the error. A wait that fails because a
/// peer's connection closed reads the store first (poll_store): a peer that
/// raised a carried error and left is reported by its error, not as dead.

#include <shardtensor/core/comm.h>

#include <c10/util/FunctionRef.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace shardtensor::comm::errors {

/// Exit code of a job ended at finalize because an error was carried into
/// communication that other ranks had already started.
constexpr int kCarriedErrorExitCode = 86;

/// Names one primitive call on one communicator, identically on every rank of it.
struct CallId {
  uint64_t comm_key = 0;  // a fingerprint of the communicator's world ranks
  uint64_t seq = 0;       // the how-manieth primitive call on this communicator
  Comm comm = comm_null();
};

/// Local unless an error is pending. The entry of every primitive call on
/// `comm` (after its local checks, before any communication): numbers the
/// call, records it in the flight recorder under `name` (a string that lives
/// for the whole run; Note [flight recorder]), reads the error channel, and
/// throws c10::Error if an error of another rank reached this call or the job
/// is poisoned. May wait for the other ranks' verdict on an earlier failure
/// of this rank (see the Note).
CallId enter(Comm comm, const char* name);

/// Posts `message` to the other ranks of the call's communicator and throws
/// it here as c10::Error. For a call whose checks failed on this rank.
[[noreturn]] void fail(const CallId& call, const std::string& message);

#if SHARDTENSOR_WITH_MPI
/// Local. Called between polls of a blocking wait on `n` requests (for the
/// transport primitive `what`, during op `op`; `p2p`: point-to-point requests
/// that can be cancelled). Throws c10::Error, after cancelling or abandoning
/// the requests (they are set to MPI_REQUEST_NULL), when another rank has
/// carried an error here or poisoned the job.
void poll(int n, MPI_Request* requests, bool p2p, const char* what);
#endif

/// Local. A wait of the c10d transport that carried errors can reach (Note
/// [carried errors]): while one lives (one at a time), a monitor thread reads
/// the store every kStorePollSeconds, starting kStorePollSeconds into the
/// wait. When it finds an error of a call this rank has entered, or a poison,
/// it poisons the job here and calls `interrupt`, which must make the waits
/// return (Gloo's Work::abort()); then interrupted() is true and raise()
/// throws. Short waits cost a registration and no store access.
class StoreWatch {
 public:
  explicit StoreWatch(std::function<void()> interrupt);
  ~StoreWatch();
  StoreWatch(const StoreWatch&) = delete;
  StoreWatch& operator=(const StoreWatch&) = delete;
  bool interrupted() const { return interrupted_.load(); }
  /// Throws c10::Error naming the wait `what`, the op and the culprit.
  [[noreturn]] void raise(const char* what) const;

 private:
  friend struct StoreWatchAccess;
  std::function<void()> interrupt_;
  std::atomic<bool> interrupted_{false};
  long long id_ = -1;
};

constexpr double kStorePollSeconds = 0.1;

/// Local, c10d only: reads the store now (as the monitor does) and returns
/// whether the job is poisoned. For a wait that failed because a peer's
/// connection closed: a peer that raised a carried error may have left
/// already, and its error, not its death, is what to report.
bool poll_store();

/// Throws the c10::Error of a wait abandoned because the job is poisoned
/// (names the wait `what`, the op and the culprit).
[[noreturn]] void raise_poisoned(const char* what);

/// Local. True once the job is poisoned (Note [carried errors]).
bool poisoned();

/// Note [carried rule errors]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Note [carried errors] covers the checks of primitives. Code above them (a
/// rule, a decomposition, the generic fallback, the write-back of a view, a
/// backward formula) can raise on some ranks only as well: a check of a local
/// piece, an error of libtorch on this rank's data, a Python decomposition.
/// The dispatcher runs every outermost op (none running on its thread) through
/// run_as_op, and so do the backward formulas of the library's autograd
/// Functions (ops::carried_backward). A failure is named by the point in
/// communication where it happened: how many calls its rank had entered on
/// each communicator (Note [collective discipline]: every rank of a
/// communicator calls its primitives in the same order). Ops are not counted:
/// a rank may run autograd Functions on its local piece that another rank,
/// whose piece is empty, does not.
///  - A rank whose op raised an error that the channel does not already carry
///    posts it (kind kOpFailed, with its entered calls) to every other world
///    rank, then rethrows the original exception. Like a failed primitive, it
///    waits for the others' verdicts at its next primitive (or at finalize).
///  - Another rank that fails at the same point (the same calls entered on
///    every communicator both belong to) failed alike: nothing was started
///    that the first one left, and the job goes on (every rank raised; this is
///    how every bad argument is refused).
///  - A rank that enters a call on a communicator of the failed rank that the
///    failed rank had not entered (it would wait for it forever), or that
///    fails at another point, or that reaches finalize without failing,
///    poisons the job: it raises the failed rank's error naming it, and so
///    does every rank from then on, as in Note [carried errors]. It reads the
///    channel at the entry of a primitive (MPI), in waits (MPI probe, or the
///    c10d store monitor), and at finalize.
///  - At finalize every rank posts kFinal to every other and waits (bounded
///    by min(timeout, 30 s)) until each has, so an op that failed on one rank
///    while the others passed it and never communicated again still reaches
///    them: the job ends with kCarriedErrorExitCode on every rank.
/// The success path costs a thread-local counter per outermost op and, once
/// per job, P - 1 messages at finalize.

/// Runs `body`. When no op is running on this thread, `body` runs as an
/// outermost op named `name` (Note [carried rule errors]): an error it raises
/// that the channel does not already carry is posted to the other world ranks
/// and rethrown, and an error another rank raised in this op makes this one
/// throw c10::Error too (the job is then poisoned). For the dispatcher's
/// intercepted calls and for backward formulas. Local unless an error is
/// carried.
void run_as_op(const char* name, c10::function_ref<void()> body);

/// Local. Entries the error channel keeps (communicators numbered, failures
/// awaiting verdicts, early failures, op failures of other ranks, finalize
/// notices, sends in flight); constant in steady state (the long-run test
/// asserts it).
size_t tracked_entries();

}  // namespace shardtensor::comm::errors
