#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <shardtensor/core/error.h>
#include <shardtensor/core/launch.h>
#include <shardtensor/core/process_group.h>
#include <shardtensor/core/runtime.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/channel.h"
#include "core/process_groups.h"
#include "core/settings.h"
#include "core/wait_board.h"

#if SHARDTENSOR_WITH_MPI && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_CUDA_AWARE_SUPPORT (Note [CUDA-aware MPI])
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardtensor {

namespace detail {
// Internal (not in the public headers): upper layers register work that must
// happen in finalize() while MPI is still usable, e.g. mesh/ frees the
// library's communicators. Hooks run in reverse order of registration.
void register_finalize_hook(std::function<void()> hook);

// Internal, for Note [OMPIO vulcan write corruption] and its test (tests/test_core.cpp
// declares them too). Local; callable before MPI_Init.
// MPI_Get_library_version's string, e.g. "Open MPI v4.1.4, package: Debian OpenMPI, ...".
std::string mpi_library_version() {
#if !SHARDTENSOR_WITH_MPI
  return {};  // no MPI library (Note [c10d-only build])
#else
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) return {};
  return std::string(text, static_cast<size_t>(std::max(0, length)));
#endif
}
// True for Open MPI 4.1.x ("Open MPI v4.1." at the start of the library version string).
bool is_open_mpi_4_1(const std::string& library_version) {
  return library_version.rfind("Open MPI v4.1.", 0) == 0;
}
// Whether init() started MPI with OMPI_MCA_fcoll=dynamic set by itself.
bool ompio_vulcan_workaround_applied();
}  // namespace detail

namespace {

// MPI_THREAD_FUNNELED's value (the MPI standard fixes the order SINGLE <
// FUNNELED < SERIALIZED < MULTIPLE; Open MPI and MPICH number them 0..3), what
// mpi_thread_level() reports when no MPI runs (Note [c10d-only build]).
#if SHARDTENSOR_WITH_MPI
constexpr int kThreadFunneled = MPI_THREAD_FUNNELED;
#else
constexpr int kThreadFunneled = 1;
#endif

struct RuntimeState {
  std::mutex mutex;
  bool initialized = false;          // between init() and finalize()
  bool owns_mpi = false;             // init() called MPI_Init_thread, so finalize() finalizes
  int thread_level = -1;             // MPI_THREAD_* provided
  Comm error_channel = comm_null();  // Note [carried errors] (comm/error_channel.h)
  std::vector<std::function<void()>> finalize_hooks;
  bool ompio_vulcan_avoided =
      false;  // init() set OMPI_MCA_fcoll (Note [OMPIO vulcan write corruption])
  std::vector<std::pair<std::string, std::string>> exported_env;  // Note [launcher detection]
  std::string transport = "mpi";                                  // resolve_transport()'s choice
};

RuntimeState& state() {
  static RuntimeState* s = new RuntimeState();  // leaked: usable during static destruction
  return *s;
}

// A c10d-only build (Note [c10d-only build]) never has MPI up.
bool mpi_initialized() {
  int flag = 0;
#if SHARDTENSOR_WITH_MPI
  MPI_Initialized(&flag);
#endif
  return flag != 0;
}

bool mpi_finalized() {
  int flag = 0;
#if SHARDTENSOR_WITH_MPI
  MPI_Finalized(&flag);
#endif
  return flag != 0;
}

// Note [OMPIO vulcan write corruption]
// Open MPI 4.1's OMPIO component, with its default collective-I/O module
// `fcoll/vulcan`, sometimes writes wrong values when ranks write non-contiguous
// hyperslabs of one contiguous HDF5 dataset collectively (Debian 12's Open MPI
// 4.1.4: a 2x2 mesh writing 3x2 blocks of a 6x4 dataset lost values in about
// 4 runs of 10; every other fcoll module and ROMIO wrote it right 20 of 20; the
// same failure mode is reported against HDF5 and AMReX). The variable is read
// when MPI starts, so the library picks the `dynamic` module before it calls
// MPI_Init, unless the user chose an I/O component or fcoll module
// (OMPI_MCA_io, OMPI_MCA_fcoll), or SHARDTENSOR_KEEP_OMPIO_VULCAN=1. The Python
// package does the same at import time. A host that starts MPI itself keeps
// its own settings; docs/io.md says what to export.
// Only for Open MPI 4.1, the version it was seen on (Note [Open MPI 4.1 and 5.0
// spellings], cmake/MpiLaunch.cmake): the library is asked with
// MPI_Get_library_version, which MPI-3 allows before MPI_Init. Open MPI 5.0 (and
// any other MPI) starts with its own defaults; should 5.0's vulcan lose values
// too, WriteHdf5.RepeatedCollectiveBlockWritesAreExact (tests/test_io.cpp) fails
// there, and this gate is where to widen it.
void avoid_ompio_vulcan() {
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0';
  };
  if (set("OMPI_MCA_io") || set("OMPI_MCA_fcoll") || set("SHARDTENSOR_KEEP_OMPIO_VULCAN")) return;
  if (!detail::is_open_mpi_4_1(detail::mpi_library_version())) return;
  setenv("OMPI_MCA_fcoll", "dynamic", /*overwrite=*/0);
  state().ompio_vulcan_avoided = true;
}

// Number of intra-op threads per rank: SHARDTENSOR_NUM_THREADS, else
// OMP_NUM_THREADS, else 1. An empty variable counts as unset.
int thread_count_from_env() {
  for (const char* name : {"SHARDTENSOR_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') {
      continue;
    }
    errno = 0;
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    while (end != nullptr && (*end == ' ' || *end == '\t')) {
      ++end;
    }
    TORCH_CHECK(
        errno == 0 && end != value && end != nullptr && *end == '\0' && n > 0 && n <= 1 << 20,
        "shardtensor::init: environment variable ", name, "='", value,
        "' is not a positive integer number of threads");
    return static_cast<int>(n);
  }
  return 1;
}

#if SHARDTENSOR_WITH_MPI
// Note [launcher detection] (src/core/launch.cpp): the launcher's process count
// and rank must be MPI_COMM_WORLD's. A size mismatch is seen alike by every
// process; a rank mismatch may be seen by some only, so it is agreed with an
// all-reduce first and every process throws. Collective over MPI_COMM_WORLD.
void check_launch_against_mpi(const LaunchInfo& launch) {
  int rank = 0;
  int size = 1;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  SHARDTENSOR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  if (launch.launcher == "none") return;
  const std::string who = launch.launcher + "'s " + launch.size_variable;
  TORCH_CHECK(launch.world_size == size, "shardtensor::init: ", who, "=", launch.world_size,
              " says ", launch.world_size, " processes, but MPI_COMM_WORLD has ", size,
              size == 1 ? ": MPI did not join the processes (srun needs PMI: `srun --mpi=pmix`; "
                          "a torchrun launch without mpirun uses the c10d transport by itself)"
                        : ": the launcher and MPI disagree about the job");
  int mismatch = launch.rank != rank ? 1 : 0;
  int any = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Allreduce(&mismatch, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  TORCH_CHECK(any == 0, "shardtensor::init: ", launch.launcher, "'s ", launch.rank_variable, "=",
              launch.rank, mismatch ? " but" : " and", " MPI_COMM_WORLD's rank is ", rank, " (of ",
              size, ")", mismatch ? "" : " here, but they differ on another process",
              ": the launcher's ranks and MPI's disagree (a stale RANK/WORLD_SIZE in the "
              "environment?)");
}

// Rank 0's hostname and a port it found free, broadcast to every rank.
// Collective over MPI_COMM_WORLD.
std::pair<std::string, std::string> agree_master_address() {
  int rank = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  char buffer[256 + 16] = {};
  if (rank == 0) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "127.0.0.1");
    int port = 29500;  // torch's default, when no free port can be found
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0) {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      addr.sin_port = 0;
      socklen_t len = sizeof(addr);
      if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
          getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        port = ntohs(addr.sin_port);
      }
      close(fd);
    }
    std::snprintf(buffer, sizeof(buffer), "%s", host);
    std::snprintf(buffer + 256, 16, "%d", port);
  }
  SHARDTENSOR_MPI_CHECK(MPI_Bcast(buffer, sizeof(buffer), MPI_CHAR, 0, MPI_COMM_WORLD));
  buffer[255] = '\0';
  buffer[sizeof(buffer) - 1] = '\0';
  return {std::string(buffer), std::string(buffer + 256)};
}

// Under an MPI launch, export torch's variables where unset (as DeepSpeed
// does), so that torch.distributed.init_process_group("gloo") works beside
// shardtensor. Collective over MPI_COMM_WORLD. Returns what it set.
std::vector<std::pair<std::string, std::string>> export_torch_env(const LaunchInfo& launch) {
  int rank = 0;
  int size = 1;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  SHARDTENSOR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  int local_rank = launch.local_rank;
  int local_size = launch.local_world_size;
  {
    // The node's processes, from MPI itself (the launcher may not say).
    Comm node = comm_null();
    SHARDTENSOR_MPI_CHECK(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    int r = 0;
    int n = 1;
    MPI_Comm_rank(node, &r);
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
    if (local_rank < 0) local_rank = r;
    if (local_size < 0) local_size = n;
  }
  const auto master = agree_master_address();
  const std::pair<std::string, std::string> wanted[] = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(size)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(local_size)},
      {"MASTER_ADDR", master.first},
      {"MASTER_PORT", master.second},
  };
  std::vector<std::pair<std::string, std::string>> set;
  for (const auto& [name, value] : wanted) {
    const char* old = std::getenv(name.c_str());
    if (old != nullptr && *old != '\0') continue;
    setenv(name.c_str(), value.c_str(), /*overwrite=*/1);
    set.emplace_back(name, value);
  }
  return set;
}
#endif  // SHARDTENSOR_WITH_MPI

// Starts the c10d (Gloo) world of `size` processes (Note [c10d handles]):
// the rendezvous address is torch's MASTER_ADDR/MASTER_PORT (torchrun sets
// them; under an MPI launcher export_torch_env() did). A single process
// without them serves its own store on a free port.
void start_c10d_world(int rank, int size, const char* launcher) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  const bool have = addr != nullptr && *addr != '\0' && port != nullptr && *port != '\0';
  TORCH_CHECK(have || size == 1,
              "shardtensor::init: the c10d transport needs MASTER_ADDR and "
              "MASTER_PORT for its rendezvous (",
              launcher, " says ", size,
              " processes); torchrun sets them, other launchers need them exported");
  int port_number = 0;
  if (have) {
    char* end = nullptr;
    const long p = std::strtol(port, &end, 10);
    TORCH_CHECK(end != port && *end == '\0' && p >= 0 && p <= 65535,
                "shardtensor::init: MASTER_PORT='", port, "' is not a port number");
    port_number = static_cast<int>(p);
  }
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && std::string(agent) == "True";
  detail::pg::start_world(rank, size, have ? addr : "127.0.0.1", port_number, agent_store,
                          shardtensor::timeout());
}

}  // namespace

#if !SHARDTENSOR_WITH_MPI
Comm comm_world() {
  // A fixed address that no group has: the handle of every process of the job,
  // which DeviceMesh::create turns into the c10d world (Note [c10d-only build]).
  static char world_tag = 0;
  return reinterpret_cast<Comm>(&world_tag);
}
#endif

std::string current_transport() { return detail::transport(); }

std::vector<std::pair<std::string, std::string>> exported_launch_env() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.exported_env;
}

namespace detail {
bool ompio_vulcan_workaround_applied() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.ompio_vulcan_avoided;
}

void register_finalize_hook(std::function<void()> hook) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.finalize_hooks.push_back(std::move(hook));
}
}  // namespace detail

// The end of every init(): Note [agreed settings]. Collective over the world;
// on disagreement every rank undoes its init (so that nothing is left half
// started) and throws the same error.
static void agree_settings_or_undo(RuntimeState& s) {
  try {
    detail::agree_settings_at_init();
  } catch (...) {
    detail::pg::stop_world();
#if SHARDTENSOR_WITH_MPI
    if (s.error_channel != comm_null()) MPI_Comm_free(&s.error_channel);
    s.error_channel = comm_null();
    if (s.owns_mpi) {
      MPI_Finalize();  // every rank is here, so nothing waits
      s.owns_mpi = false;
    }
#endif
    s.initialized = false;
    throw;
  }
}

void init(int* argc, char*** argv) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) {
    return;
  }
  // Read the thread policy first, so that a bad value throws before MPI starts.
  const int threads = thread_count_from_env();
  // Note [launcher detection]: a bad launch throws here, before MPI starts, when it can.
  const LaunchInfo launch = detect_launch();
  const std::string transport = resolve_transport(launch, process_env());
  if (transport == "gloo" && !launch.mpi_launcher && !mpi_initialized()) {
    // torchrun (or one process): no MPI at all; the c10d world is the job.
    start_c10d_world(launch.rank, launch.world_size, launch.launcher.c_str());
    at::set_num_threads(threads);
    s.transport = transport;
    s.thread_level = kThreadFunneled;  // what the library needs; there is no MPI
    s.initialized = true;
    agree_settings_or_undo(s);
    return;
  }
#if !SHARDTENSOR_WITH_MPI
  // resolve_transport() chose Gloo, and no MPI is up without MPI.
  TORCH_INTERNAL_ASSERT(false, "shardtensor::init: an MPI launch in a c10d-only build");
#else
  TORCH_CHECK(!mpi_finalized(),
              "shardtensor::init: MPI has already been finalized and cannot be initialized "
              "again (MPI allows one MPI_Init/MPI_Finalize per process)");
  if (mpi_initialized()) {
    // Adopt the host's MPI: touch none of its communicators or error handlers.
    int provided = MPI_THREAD_SINGLE;
    SHARDTENSOR_MPI_CHECK(MPI_Query_thread(&provided));
    s.owns_mpi = false;
    s.thread_level = provided;
  } else {
    int provided = MPI_THREAD_SINGLE;
    avoid_ompio_vulcan();  // Note [OMPIO vulcan write corruption]
    SHARDTENSOR_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    s.owns_mpi = true;
    s.thread_level = provided;
  }
  try {
    check_launch_against_mpi(launch);  // collective; every rank throws alike
  } catch (...) {
    if (s.owns_mpi) {
      MPI_Finalize();  // every rank is here, so nothing waits
      s.owns_mpi = false;
    }
    throw;
  }
  s.exported_env = export_torch_env(launch);
  at::set_num_threads(threads);
  if (transport == "gloo") {
    // An MPI launch with SHARDTENSOR_BACKEND=gloo: MPI stays up for the host
    // (and agreed on the rendezvous address); the library's groups are c10d,
    // so there is no MPI error channel (Note [c10d data movement]).
    int rank = 0, size = 1;
    SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    SHARDTENSOR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
    start_c10d_world(rank, size, launch.launcher.c_str());
    s.transport = transport;
    s.initialized = true;
    agree_settings_or_undo(s);
    return;
  }
  // Every rank calls init(), so the duplicate is collective like MPI_Init itself.
  SHARDTENSOR_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s.error_channel));
  MPI_Comm_set_name(s.error_channel, "shardtensor error channel");
  // Collective too, before any user collective (Note [flight recorder]).
  detail::board::start();
  s.initialized = true;
  agree_settings_or_undo(s);
#endif
}

void init(const c10::intrusive_ptr<::c10d::ProcessGroup>& group) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) {
    TORCH_CHECK(detail::pg::is_world(group.get()),
                "shardtensor::init: shardtensor already runs (transport '", s.transport,
                "'), not on this process group; call finalize() first");
    return;
  }
  const int threads = thread_count_from_env();
  detail::pg::adopt_world(group, shardtensor::timeout());
  at::set_num_threads(threads);
  s.transport = "gloo";
  s.thread_level = kThreadFunneled;  // what the library needs
  s.initialized = true;
  agree_settings_or_undo(s);
}

namespace detail {
Comm world_comm() {
  if (pg::active()) return pg::world();
  return comm_world();
}

std::string transport() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.initialized ? s.transport : std::string();
}

Comm error_channel() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.initialized ? s.error_channel : comm_null();
}
}  // namespace detail

void finalize() {
  auto& s = state();
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.initialized) {
      return;
    }
    hooks = s.finalize_hooks;
  }
  // Hooks may call back into the runtime (e.g. world_rank()), so run them unlocked.
  if (detail::pg::active() || (mpi_initialized() && !mpi_finalized())) {
    for (auto it = hooks.rbegin(); it != hooks.rend(); ++it) {
      (*it)();
    }
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.initialized) {
    return;
  }
  s.initialized = false;
  detail::pg::stop_world();
  s.transport = "mpi";
#if SHARDTENSOR_WITH_MPI
  if (s.error_channel != comm_null() && mpi_initialized() && !mpi_finalized()) {
    MPI_Comm_free(&s.error_channel);
  }
  const bool owns = s.owns_mpi;
  if (owns && mpi_initialized() && !mpi_finalized()) {
    s.owns_mpi = false;
    s.error_channel = comm_null();
    SHARDTENSOR_MPI_CHECK(MPI_Finalize());
  }
#endif
  s.error_channel = comm_null();
  s.owns_mpi = false;
}

bool is_initialized() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.initialized;
}

int world_rank() {
  if (detail::pg::active()) return detail::pg::rank(detail::pg::world());
  TORCH_CHECK(mpi_initialized() && !mpi_finalized(),
              "shardtensor::world_rank: MPI is not initialized (call shardtensor::init() first)");
  int rank = -1;
#if SHARDTENSOR_WITH_MPI
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
#endif
  return rank;
}

int world_size() {
  if (detail::pg::active()) return detail::pg::size(detail::pg::world());
  TORCH_CHECK(mpi_initialized() && !mpi_finalized(),
              "shardtensor::world_size: MPI is not initialized (call shardtensor::init() first)");
  int size = 0;
#if SHARDTENSOR_WITH_MPI
  SHARDTENSOR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
#endif
  return size;
}

int local_rank() {
  TORCH_CHECK(is_initialized(),
              "shardtensor::local_rank: shardtensor is not initialized (call shardtensor::init() "
              "first)");
  // init() exported LOCAL_RANK under an MPI launch (export_torch_env); a
  // launcher that sets it is believed.
  const char* value = std::getenv("LOCAL_RANK");
  if (value == nullptr || *value == '\0') {
    const LaunchInfo launch = detect_launch();
    return launch.local_rank >= 0 ? launch.local_rank : 0;
  }
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && v >= 0 && v <= INT_MAX,
              "shardtensor::local_rank: LOCAL_RANK='", value, "' is not a non-negative integer");
  return static_cast<int>(v);
}

int mpi_thread_level() {
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.initialized) {
      return s.thread_level;
    }
  }
  TORCH_CHECK(mpi_initialized() && !mpi_finalized(),
              "shardtensor::mpi_thread_level: MPI is not initialized");
  int provided = 0;
#if SHARDTENSOR_WITH_MPI
  SHARDTENSOR_MPI_CHECK(MPI_Query_thread(&provided));
#endif
  return provided;
}

MpiCudaSupport mpi_cuda_support() {
  static std::mutex mu;
  static bool known = false;
  static MpiCudaSupport kept;
  std::lock_guard<std::mutex> lock(mu);
  if (known) return kept;
  MpiCudaSupport s;
  if (const char* e = std::getenv("SHARDTENSOR_MPI_CUDA_AWARE"); e != nullptr && *e != '\0') {
    const std::string v(e);
    TORCH_CHECK(v == "0" || v == "1",
                "shardtensor: SHARDTENSOR_MPI_CUDA_AWARE must be 0 or 1, got '", v, "'");
    s.aware = v == "1";
    s.reason = "SHARDTENSOR_MPI_CUDA_AWARE=" + v;
#if !SHARDTENSOR_WITH_MPI
    s.aware = false;
    s.reason += " (no effect: this build has no MPI)";
#endif
    known = true;
    kept = s;
    return s;
  }
#if !SHARDTENSOR_WITH_MPI
  s.reason = "this build has no MPI (SHARDTENSOR_WITH_MPI=OFF)";
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  if (!mpi_initialized() || mpi_finalized()) {
    s.reason =
        "Open MPI was built with CUDA support; MPI is not running, so "
        "MPIX_Query_cuda_support() was not asked yet";
    return s;  // not kept: asked again once MPI runs
  }
  s.aware = MPIX_Query_cuda_support() == 1;
  s.reason = s.aware ? "Open MPI: built with CUDA support and MPIX_Query_cuda_support() is 1"
                     : "Open MPI was built with CUDA support, but MPIX_Query_cuda_support() is 0 "
                       "at run time";
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  s.reason = "Open MPI was built without CUDA support (MPIX_CUDA_AWARE_SUPPORT is 0 in mpi-ext.h)";
#else
  s.reason =
      "this MPI library declares no CUDA query (no MPIX_CUDA_AWARE_SUPPORT in mpi-ext.h); "
      "SHARDTENSOR_MPI_CUDA_AWARE=1 says that it takes device memory";
#endif
  known = true;
  kept = s;
  return s;
}

void abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
#if SHARDTENSOR_WITH_MPI
  if (mpi_initialized() && !mpi_finalized()) {
    MPI_Abort(MPI_COMM_WORLD, code);
  }
#endif
  std::_Exit(code);
}

// ---- watchdog settings (Note [watchdog]) ----------------------------------------

namespace {

constexpr double kDefaultTimeoutSeconds = 600.0;

double timeout_from_env() {
  const char* value = std::getenv("SHARDTENSOR_TIMEOUT");
  if (value == nullptr || *value == '\0') {
    return kDefaultTimeoutSeconds;
  }
  errno = 0;
  char* end = nullptr;
  const double t = std::strtod(value, &end);
  while (end != nullptr && (*end == ' ' || *end == '\t')) {
    ++end;
  }
  TORCH_CHECK(
      errno == 0 && end != value && end != nullptr && *end == '\0' && std::isfinite(t) && t >= 0,
      "shardtensor: environment variable SHARDTENSOR_TIMEOUT='", value,
      "' is not a non-negative number of seconds (0 disables the watchdog)");
  return t;
}

// Negative: not read yet.
std::atomic<double> g_timeout{-1.0};

thread_local const char* t_op_label = nullptr;

}  // namespace

void set_timeout(double seconds) {
  TORCH_CHECK(std::isfinite(seconds) && seconds >= 0, "shardtensor::set_timeout: ", seconds,
              " is not a non-negative number of seconds (0 disables the watchdog)");
  g_timeout.store(seconds);
}

double timeout() {
  double t = g_timeout.load();
  if (t < 0) {
    t = timeout_from_env();
    double expected = -1.0;
    if (!g_timeout.compare_exchange_strong(expected, t)) {
      t = expected;  // set concurrently
    }
  }
  return t;
}

OpLabel::OpLabel(const char* label) : previous_(t_op_label) { t_op_label = label; }

OpLabel::~OpLabel() { t_op_label = previous_; }

const char* OpLabel::current() { return t_op_label == nullptr ? "" : t_op_label; }

Runtime::Runtime(int* argc, char*** argv) { init(argc, argv); }

Runtime::~Runtime() {
  try {
    finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardtensor::Runtime: finalize failed: %s\n", e.what());
  }
}

}  // namespace shardtensor
