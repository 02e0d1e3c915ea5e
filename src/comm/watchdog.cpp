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

// Note [watchdog], continued: under the MPI transport a long wait is posted
// on the wait board (Note [flight recorder]), and an expiry names the ranks
// that never joined a collective from it. Timings: a wait is posted once it
// has lasted post_after(); an expired collective waits grace() for late posts
// before it names anyone; a posted rank looks every look_every() whether
// another rank's watchdog expired in its call, and then prints its own line.
// Every rank posted in the call prints before the first MPI_Abort (bounded).
double post_after(double limit) { return std::min(1.0, 0.05 * limit); }
double grace(double limit) { return post_after(limit) + 0.5; }
double look_every(double limit) { return std::max(0.1, std::min(1.0, 0.01 * limit)); }

bool is_point_to_point(int n, const WaitSite& site) {
  return site.peers != nullptr && static_cast<int>(site.peers->size()) == n;
}

// The line's head, up to and including "for ".
std::string head(const WaitSite& site, double waited, double limit, const std::string& note) {
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  std::ostringstream os;
  const char* op = OpLabel::current();
  os << "shardtensor watchdog: world rank " << world << " waited " << waited
     << " s (SHARDTENSOR_TIMEOUT = " << limit << " s" << note << ") in " << site.primitive
     << " during op '" << (*op != '\0' ? op : "<none>") << "' on " << comm_description(site.comm)
     << " for ";
  return os.str();
}

std::string tail(const std::string& missing) {
  std::ostringstream os;
  os << "; its last primitive call: " << flight::last_call() << "; missing: " << missing
     << " (Note [flight recorder]); aborting the job with exit code " << kWatchdogExitCode;
  return os.str();
}

constexpr const char* kCollective =
    "every rank of the communicator (a collective that some rank has not entered)";

// The whole line (without the flight recorder's): the missing ranks of a
// point-to-point wait from its requests, those of a collective from the wait
// board's `view` when given (Note [flight recorder]).
std::string line_for(int n, MPI_Request* requests, const WaitSite& site, double waited,
                     double limit, const std::string& note, const flight::BoardView* view) {
  std::ostringstream os;
  os << head(site, waited, limit, note);
  std::string missing;
  if (is_point_to_point(n, site)) {
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
  } else if (view != nullptr) {
    os << kCollective;
    std::ostringstream m;
    if (view->missing.empty()) {
      m << "none by the wait board (every rank of the communicator posted this call, yet it has "
           "not completed)";
    } else {
      m << "world ranks " << flight::rank_list(view->missing) << " (not in this call after a "
        << grace(limit) << " s grace, by the wait board: " << view->detail << ")";
    }
    missing = m.str();
  } else {
    os << kCollective;
    missing = "one or more of world ranks " + flight::rank_list(to_world(site.comm, nullptr)) +
              " (an MPI collective does not tell a rank which ranks have not joined)";
  }
  return os.str() + tail(missing);
}

[[noreturn]] void expire(int n, MPI_Request* requests, const WaitSite& site, double waited,
                         double limit) {
  flight::fail_job(line_for(n, requests, site, waited, limit, "", nullptr), kWatchdogExitCode);
}

// Prints the line, waits (bounded) until every rank posted in this call has
// printed its own, then ends the job: the first MPI_Abort ends the others.
[[noreturn]] void expire_by_board(int n, MPI_Request* requests, const WaitSite& site, double waited,
                                  double limit, int author, const flight::BoardView& view) {
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  const std::string note =
      author < 0 || author == world
          ? ""
          : "; world rank " + std::to_string(author) + "'s watchdog expired first in this call";
  const std::string line =
      line_for(n, requests, site, waited, limit, note, &view) + "\n" + flight::history_line();
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  flight::printed_and_wait(view.in_call, grace(limit) + 2 * look_every(limit) + 0.5);
  shardtensor::abort(kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);
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
  bool post_tried = false;
  bool posted = false;        // on the wait board as the last call (Note [flight recorder])
  double next_look = 0;       // when to read the board next
  double expiring_from = -1;  // this call expires (here or on another rank) since then
  struct EndWait {
    bool* recorded;
    bool* posted;
    double* expiring_from;
    ~EndWait() {
      if (*recorded) flight::end_wait();
      if (*posted) flight::withdraw_wait();
      if (*expiring_from >= 0) flight::clear_expiring();  // completed within the grace
    }
  } end_wait{&recorded, &posted, &expiring_from};
  int author = -1;  // the rank whose watchdog expired first in this call
  for (;;) {
    int flag = 0;
    const int rc = MPI_Testall(n, requests, &flag, statuses);
    if (rc != MPI_SUCCESS || flag) {
      return rc;
    }
    errors::poll(n, requests, site.peers != nullptr, site.primitive);
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (expiring_from < 0 && limit > 0 && waited > limit) {
      if (!(posted && site.in_last_call)) expire(n, requests, site, waited, limit);
      expiring_from = waited;
      next_look = waited;
      author = flight::mark_expiring();
      if (author < 0) expire(n, requests, site, waited, limit);
    } else if (expiring_from < 0 && posted && site.in_last_call && waited >= next_look) {
      // Another rank's watchdog expired in this call: this rank prints its
      // line too before the first MPI_Abort ends it.
      next_look = waited + look_every(limit);
      author = flight::expiring_by();
      if (author >= 0) {
        expiring_from = waited;
        next_look = waited;
      }
    }
    if (expiring_from >= 0 && waited >= next_look) {
      // A collective gives ranks that joined late the grace to post (and may
      // still complete meanwhile: then nothing is named); a point-to-point
      // wait knows its missing ranks and reads the board only for the count
      // of ranks in this call.
      next_look = waited + 0.05;
      const flight::BoardView view = flight::read_board(to_world(site.comm, nullptr));
      if (!view.ok) expire(n, requests, site, waited, limit);
      if (is_point_to_point(n, site) || waited >= expiring_from + grace(limit)) {
        expire_by_board(n, requests, site, waited, limit, author, view);
      }
    }
    if (waited >= 1e-2 && !recorded) {
      // A long wait: tell the flight recorder what it waits for (Note
      // [flight recorder]; not on the fast path, the translation asks MPI).
      recorded = true;
      std::vector<int> pending;
      if (is_point_to_point(n, site)) {
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
    if (limit > 0 && !post_tried && waited >= post_after(limit)) {
      // Posted for every long wait (also point-to-point ones and those of an
      // earlier call), so that a rank whose collective expires can say what
      // this rank does instead.
      post_tried = true;
      posted = flight::post_wait(site.primitive, site.in_last_call);
      next_look = waited + look_every(limit);
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
