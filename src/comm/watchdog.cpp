// The watchdog (Note [watchdog] in shardtensor/core/runtime.h).
#include "comm/watchdog.h"

#include "comm/error_channel.h"

#include <shardtensor/core/runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>

namespace shardtensor::comm::watchdog {

namespace {

using Clock = std::chrono::steady_clock;

std::string comm_description(MPI_Comm comm) {
  std::ostringstream os;
  if (comm == MPI_COMM_NULL) {
    os << "no communicator";
    return os.str();
  }
  int size = 0, rank = 0, len = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  char name[MPI_MAX_OBJECT_NAME] = {0};
  MPI_Comm_get_name(comm, name, &len);
  os << "communicator '" << (len > 0 ? name : "unnamed") << "' of size " << size
     << " (this process is its rank " << rank << ")";
  return os.str();
}

[[noreturn]] void expire(int n, MPI_Request* requests, const WaitSite& site, double waited,
                         double limit) {
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  std::ostringstream os;
  const char* op = OpLabel::current();
  os << "shardtensor watchdog: world rank " << world << " waited " << waited
     << " s (SHARDTENSOR_TIMEOUT = " << limit << " s) in " << site.primitive << " during op '"
     << (*op != '\0' ? op : "<none>") << "' on " << comm_description(site.comm) << " for ";
  if (site.peers != nullptr && static_cast<int>(site.peers->size()) == n) {
    os << "peers [";
    bool first = true;
    for (int i = 0; i < n; ++i) {
      int done = 1;
      if (requests[i] != MPI_REQUEST_NULL) {
        MPI_Request_get_status(requests[i], &done, MPI_STATUS_IGNORE);
      }
      if (!done) {
        os << (first ? "" : ", ") << (*site.peers)[i];
        first = false;
      }
    }
    os << "] (point-to-point)";
  } else {
    os << "every rank of the communicator (a collective that some rank has not entered)";
  }
  os << "; aborting the job with exit code " << kWatchdogExitCode << "\n";
  const std::string line = os.str();
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);  // MPI_Abort does not return; be sure
}

}  // namespace

int wait_all(int n, MPI_Request* requests, MPI_Status* statuses, const WaitSite& site) {
  if (n == 0) {
    return MPI_SUCCESS;
  }
  // Always poll, also with the watchdog off, so that errors carried from other
  // ranks reach this wait (Note [carried errors]).
  const double limit = shardtensor::timeout();
  const auto start = Clock::now();
  for (;;) {
    int flag = 0;
    const int rc = MPI_Testall(n, requests, &flag, statuses);
    if (rc != MPI_SUCCESS || flag) {
      return rc;
    }
    errors::poll(n, requests, site.peers != nullptr, site.primitive);
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (limit > 0 && waited > limit) {
      expire(n, requests, site, waited, limit);
    }
    // Poll hard at first (short waits are the common case and latency matters),
    // then back off so that a rank waiting long leaves the core to the others.
    if (waited < 1e-2) {
      std::this_thread::yield();
    } else if (waited < 1.0) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

int wait(MPI_Request* request, MPI_Status* status, const WaitSite& site) {
  return wait_all(1, request, status == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : status, site);
}

}  // namespace shardtensor::comm::watchdog
