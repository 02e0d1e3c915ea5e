#pragma once
/// \file The watchdog: bounded waits for the transport's MPI requests (Note
/// [watchdog] in shardtensor/core/runtime.h). Private to comm/.

#include <shardtensor/core/comm.h>

#include <vector>

namespace shardtensor::comm::watchdog {

/// What a wait is for, named in the expiry message.
struct WaitSite {
  const char* primitive =
      "";  // transport function and MPI call, e.g. "all_gatherv (MPI_Iallgatherv)"
  Comm comm = comm_null();
  /// For point-to-point waits: the peer (rank in `comm`) of each request, in
  /// request order; empty for collectives (then every rank of `comm` is awaited).
  const std::vector<int>* peers = nullptr;
  /// Whether the requests belong to the flight recorder's last call (false
  /// for requests an earlier call started: a split-phase exchange's finish,
  /// a pending all-reduce); only then is the wait posted on the wait board as
  /// that call (Note [flight recorder]).
  bool in_last_call = true;
};

#if SHARDTENSOR_WITH_MPI
/// Local. MPI_Waitall with the watchdog: polls the `n` requests (MPI_Testall)
/// until all have completed, yielding the CPU between polls, and returns
/// MPI_Testall's return code. If they have not completed within
/// shardtensor::timeout() seconds (when non-zero), prints the expiry line and
/// calls MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode): it never returns then.
/// `statuses` may be MPI_STATUSES_IGNORE.
int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, const WaitSite& site);

/// Local. wait_all() of one request.
int wait(MPI_Request* request, MPI_Status* status, const WaitSite& site);
#endif

}  // namespace shardtensor::comm::watchdog
