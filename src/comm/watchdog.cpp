// The watchdog (Note [watchdog] in shardtensor/core/runtime.h).
#include "comm/watchdog.h"

#include "comm/blocking.h"
#include "comm/error_channel.h"
#include "comm/flight_recorder.h"

#include <shardtensor/core/runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

// Everything here waits on MPI requests (Note [c10d-only build]: the c10d
// transport bounds its waits in transport_c10d.cpp).
#if SHARDTENSOR_WITH_MPI
namespace shardtensor::comm::watchdog {

namespace {

using Clock = std::chrono::steady_clock;

std::string comm_description(Comm comm) {
  std::ostringstream os;
  if (comm == comm_null()) {
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

/// World ranks of `ranks` (ranks of `comm`; all of them when `ranks` is null).
std::vector<int> to_world(Comm comm, const std::vector<int>* ranks) {
  std::vector<int> out;
  if (comm == comm_null()) return out;
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> in;
  if (ranks != nullptr) {
    in = *ranks;
  } else {
    int n = 0;
    MPI_Group_size(group, &n);
    for (int i = 0; i < n; ++i) in.push_back(i);
  }
  out.assign(in.size(), MPI_UNDEFINED);
  if (!in.empty()) {
    MPI_Group_translate_ranks(group, static_cast<int>(in.size()), in.data(), world, out.data());
  }
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
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
  std::string missing;
  if (site.peers != nullptr && static_cast<int>(site.peers->size()) == n) {
    os << "peers [";
    bool first = true;
    std::vector<int> pending;
    for (int i = 0; i < n; ++i) {
      int done = 1;
      if (requests[i] != MPI_REQUEST_NULL) {
        MPI_Request_get_status(requests[i], &done, MPI_STATUS_IGNORE);
      }
      if (!done) {
        os << (first ? "" : ", ") << (*site.peers)[i];
        first = false;
        pending.push_back((*site.peers)[i]);
      }
    }
    os << "] (point-to-point)";
    std::vector<int> world = to_world(site.comm, &pending);
    std::sort(world.begin(), world.end());
    world.erase(std::unique(world.begin(), world.end()), world.end());
    missing = "world ranks " + flight::rank_list(world) + " (their messages did not arrive)";
  } else {
    os << "every rank of the communicator (a collective that some rank has not entered)";
    missing = "one or more of world ranks " + flight::rank_list(to_world(site.comm, nullptr)) +
              " (an MPI collective does not tell a rank which ranks have not joined)";
  }
  os << "; its last primitive call: " << flight::last_call() << "; missing: " << missing
     << " (Note [flight recorder]); aborting the job with exit code " << kWatchdogExitCode;
  flight::fail_job(os.str(), kWatchdogExitCode);
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
  bool recorded = false;
  struct EndWait {
    bool* recorded;
    ~EndWait() {
      if (*recorded) flight::end_wait();
    }
  } end_wait{&recorded};
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
    if (waited >= 1e-2 && !recorded) {
      // A long wait: tell the flight recorder what it waits for (Note
      // [flight recorder]; not on the fast path, the translation asks MPI).
      recorded = true;
      std::vector<int> pending;
      if (site.peers != nullptr && static_cast<int>(site.peers->size()) == n) {
        for (int i = 0; i < n; ++i) {
          int done = 1;
          if (requests[i] != MPI_REQUEST_NULL) {
            MPI_Request_get_status(requests[i], &done, MPI_STATUS_IGNORE);
          }
          if (!done) pending.push_back((*site.peers)[i]);
        }
      }
      flight::begin_wait(site.primitive, to_world(site.comm, nullptr),
                         pending.empty() ? pending : to_world(site.comm, &pending));
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

// ---- blocking scopes (a monitor thread) ---------------------------------------------

namespace {

struct Scope {
  long long id = -1;
  const char* what = "";
  std::string op;
  std::string comm;
  Clock::time_point start;
  double limit = 0;
};

struct Monitor {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Scope> scopes;  // open scopes, innermost last
  long long next_id = 0;
  bool started = false;
};

Monitor& monitor() {
  static auto* m = new Monitor();  // leaked: the detached thread may outlive statics
  return *m;
}

void monitor_loop() {
  Monitor& m = monitor();
  std::unique_lock<std::mutex> lock(m.mu);
  for (;;) {
    if (m.scopes.empty()) {
      m.cv.wait(lock);
      continue;
    }
    const Scope s = m.scopes.back();
    const auto deadline = s.start + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(s.limit));
    if (m.cv.wait_until(lock, deadline) == std::cv_status::timeout && !m.scopes.empty() &&
        m.scopes.back().id == s.id) {
      const double waited = std::chrono::duration<double>(Clock::now() - s.start).count();
      int world = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &world);  // a local query, allowed from any thread
      std::fprintf(stderr,
                   "shardtensor watchdog: world rank %d waited %g s (SHARDTENSOR_TIMEOUT = %g s) "
                   "in %s during op '%s' on %s for every rank of the communicator (a blocking "
                   "collective inside another library that some rank has not entered); ending "
                   "this process with exit code %d so that the launcher ends the job\n",
                   world, waited, s.limit, s.what, s.op.c_str(), s.comm.c_str(), kWatchdogExitCode);
      std::fflush(stderr);
      std::fflush(stdout);
      std::_Exit(kWatchdogExitCode);
    }
  }
}

}  // namespace

BlockingScope::BlockingScope(const char* what, Comm comm) {
  const double limit = shardtensor::timeout();
  if (limit <= 0) return;
  Scope s;
  s.what = what;
  const char* op = OpLabel::current();
  s.op = *op != '\0' ? op : "<none>";
  s.comm = comm_description(comm);
  s.start = Clock::now();
  s.limit = limit;
  Monitor& m = monitor();
  std::lock_guard<std::mutex> lock(m.mu);
  if (!m.started) {
    std::thread(monitor_loop).detach();
    m.started = true;
  }
  s.id = m.next_id++;
  m.scopes.push_back(std::move(s));
  active_ = true;
  m.cv.notify_all();
}

BlockingScope::~BlockingScope() {
  if (!active_) return;
  Monitor& m = monitor();
  std::lock_guard<std::mutex> lock(m.mu);
  m.scopes.pop_back();
  m.cv.notify_all();
}

int wait(MPI_Request* request, MPI_Status* status, const WaitSite& site) {
  return wait_all(1, request, status == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : status, site);
}

}  // namespace shardtensor::comm::watchdog
#endif  // SHARDTENSOR_WITH_MPI
