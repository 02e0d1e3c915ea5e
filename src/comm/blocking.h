#pragma once
/// \file The watchdog for blocking calls that cannot be polled (private to
/// comm/ and io/; Note [watchdog] in shardtensor/core/runtime.h).

#include <shardtensor/core/comm.h>

namespace shardtensor::comm::watchdog {

/// Local. RAII bound on one blocking call that runs inside another library's
/// MPI code and so cannot be polled, e.g. a collective HDF5 call under MPI-IO
/// (H5Fopen, H5Dread, H5Dwrite, H5Fclose). While the scope is open a monitor
/// thread watches the clock; if the scope is still open after
/// shardtensor::timeout() seconds (when non-zero), it prints the watchdog's
/// one line (naming `what`, the op, the communicator and the wait) and ends
/// this process with std::_Exit(kWatchdogExitCode), which makes the launcher
/// end the job (MPI_Abort cannot be called from a second thread under
/// MPI_THREAD_FUNNELED). Scopes nest; the innermost is watched. `what` must
/// outlive the scope (a string literal).
class BlockingScope {
 public:
  BlockingScope(const char* what, Comm comm);
  ~BlockingScope();
  BlockingScope(const BlockingScope&) = delete;
  BlockingScope& operator=(const BlockingScope&) = delete;

 private:
  bool active_ = false;
};

}  // namespace shardtensor::comm::watchdog
