// The c10d process groups (core/process_groups.h): the only file that makes
// Gloo groups. ProcessGroupGloo.hpp needs gloo's headers, which the torch
// wheel does not ship; Debian's libgloo-dev provides them (headers only: all
// gloo code runs from libtorch_cpu). Only pointers to gloo types are touched
// here, so the header version need not match torch's bundled gloo exactly.
#include "core/process_groups.h"

#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_set>

namespace shardtensor::detail::pg {

namespace {

struct Group {
  c10::intrusive_ptr<::c10d::ProcessGroup> pg;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;
  std::string name;
  bool shared = false;  // one group per member set, kept until stop_world()
};

struct State {
  std::mutex mu;
  bool active = false;
  c10::intrusive_ptr<::c10d::Store> store;
  Group* world = nullptr;
  std::unordered_set<Group*> live;                   // every group, the world included
  std::map<std::vector<int>, Group*> shared;         // by sorted world ranks
  std::map<std::vector<int>, int64_t> private_made;  // private groups made per member set
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<::c10d::ProcessGroup> adopted;  // the host's group (adopt_world())
};

State& state() {
  static auto* s = new State();  // leaked: groups may be dropped after static destruction
  return *s;
}

Comm handle(Group* g) { return reinterpret_cast<Comm>(g); }

Group* group(Comm comm, const char* fn) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto* g = reinterpret_cast<Group*>(comm);
  TORCH_CHECK(s.active && s.live.count(g) != 0, "shardtensor: ", fn,
              ": the communicator is not a live c10d group");
  return g;
}

c10::intrusive_ptr<::c10d::ProcessGroup> make_world(const c10::intrusive_ptr<::c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = ::c10d::ProcessGroupGloo::Options::create_default(timeout);
  auto gloo = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, options);
  auto pg = c10::make_intrusive<::c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(c10::DeviceType::CPU, ::c10d::ProcessGroup::BackendType::GLOO, gloo);
  pg->setDefaultBackend(::c10d::ProcessGroup::BackendType::GLOO);
  pg->setGroupName("shardtensor/world");
  return pg;
}

// Every rank waits here until all have made their Gloo group. Gloo's
// connectFullMesh returns on a rank once its own pairs are connected; a rank
// that then left at once (init, finalize, exit) closed a pair a slower peer
// was still completing, and that peer failed with "Connection closed by peer"
// (seen in launch.torchrun_cpp.np3). Counted on the store, like torch's own
// store-based barrier; the key carries the how-manieth world of this process,
// so a world started again on a long-lived store (torchrun's agent) never
// reads an old count.
void join_barrier(::c10d::Store& store, int size) {
  static int64_t generation = 0;
  const std::string key = "world" + std::to_string(generation++) + "/joined";
  const std::string done = key + "/all";
  if (store.add(key, 1) == size) store.set(done, std::vector<uint8_t>{1});
  store.wait({done});
}

// Our watchdog bounds every wait (Note [c10d data movement]); Gloo's own
// timeout only backs it up, so it is a minute longer (a day without a watchdog).
std::chrono::milliseconds gloo_timeout(double timeout_s) {
  return std::chrono::milliseconds(timeout_s > 0 ? static_cast<int64_t>(timeout_s * 1000.0) + 60'000
                                                 : int64_t{24} * 3600'000);
}

// The world group of `size` ranks over `pg`, installed as the started world.
// One home for start_world() and adopt_world(); `adopted` is the host's group
// (null for a world of our own).
void install_world(c10::intrusive_ptr<::c10d::ProcessGroup> pg,
                   c10::intrusive_ptr<::c10d::Store> store, int rank, int size, std::string name,
                   std::chrono::milliseconds timeout,
                   c10::intrusive_ptr<::c10d::ProcessGroup> adopted) {
  auto* g = new Group();
  g->pg = std::move(pg);
  g->rank = rank;
  g->size = size;
  g->world_ranks.resize(size);
  for (int r = 0; r < size; ++r) g->world_ranks[r] = r;
  g->name = std::move(name);
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.store = std::move(store);
  s.world = g;
  s.adopted = std::move(adopted);
  s.live.insert(g);
  s.timeout = timeout;
  s.active = true;
}

}  // namespace

bool active() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active;
}

bool owns(Comm comm) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active && s.live.count(reinterpret_cast<Group*>(comm)) != 0;
}

void start_world(int rank, int size, const std::string& addr, int port, bool agent_store,
                 double timeout_s) {
  auto& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    TORCH_CHECK(!s.active, "shardtensor::init: the c10d world is already started");
  }
  // A write to a peer that died would raise SIGPIPE and end this process
  // silently before it can name the dead rank (Note [flight recorder]; seen in
  // dead_rank.sigkill.torchrun.np3). Ignored, the write fails with EPIPE and
  // Gloo reports the closed connection. Only where SIGPIPE still has its
  // default action (Python already ignores it; a host's handler is kept).
  {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  }
  const auto timeout = gloo_timeout(timeout_s);
  c10::intrusive_ptr<::c10d::Store> store;
  c10::intrusive_ptr<::c10d::ProcessGroup> pg;
  try {
    ::c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = !agent_store && rank == 0;
    so.numWorkers = agent_store ? std::nullopt : std::optional<std::size_t>(size);
    so.waitWorkers = false;
    // torch.distributed's own store may serve the same address in this process.
    so.multiTenant = true;
    so.timeout = std::chrono::milliseconds(std::max<int64_t>(timeout.count(), 300'000));
    auto tcp = c10::make_intrusive<::c10d::TCPStore>(addr, so);
    // Our keys live under our own prefix: user code may share the store
    // (torch.distributed under torchrun uses the agent's store too).
    store = c10::make_intrusive<::c10d::PrefixStore>("shardtensor", tcp);
    pg = make_world(store, rank, size, timeout);
    join_barrier(*store, size);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "shardtensor::init: could not start the c10d (Gloo) world of ", size,
                " processes as rank ", rank, " through the store at ", addr, ":", port,
                agent_store ? " (torchrun's agent store)" : "", ": ", e.what());
  }
  install_world(std::move(pg), std::move(store), rank, size, "world", timeout, nullptr);
}

void adopt_world(const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s) {
  auto& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    TORCH_CHECK(!s.active, "shardtensor::init: the c10d world is already started");
  }
  TORCH_CHECK(group, "shardtensor::init: the process group to adopt is null");
  const int rank = group->getRank();
  const int size = group->getSize();
  const std::string name = group->getGroupName();
  c10::intrusive_ptr<::c10d::Store> base = group->getStore();
  TORCH_CHECK(base, "shardtensor::init: the process group '", name, "' has no store");
  const auto timeout = gloo_timeout(timeout_s);
  // The group's own store, which every member has; our keys get our prefix
  // and the group's name. On it, shardtensor's Gloo world over exactly the
  // group's members, made like its own (make_world), so meshes split it as
  // they split that one (Note [c10d group reuse]).
  c10::intrusive_ptr<::c10d::Store> store;
  c10::intrusive_ptr<::c10d::ProcessGroup> pg;
  try {
    store = c10::make_intrusive<::c10d::PrefixStore>("shardtensor/" + name, base);
    pg = make_world(store, rank, size, timeout);
    join_barrier(*store, size);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "shardtensor::init: could not start on the process group '", name,
                "' (rank ", rank, " of ", size, "): ", e.what());
  }
  install_world(std::move(pg), std::move(store), rank, size, "world (adopted '" + name + "')",
                timeout, group);
}

bool is_world(const ::c10d::ProcessGroup* group) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active && s.adopted.get() == group;
}

void stop_world() noexcept {
  auto& s = state();
  std::unordered_set<Group*> groups;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.active) return;
    groups.swap(s.live);
    s.shared.clear();
    s.private_made.clear();
    s.active = false;
    s.world = nullptr;
  }
  for (Group* g : groups) {
    try {
      delete g;
    } catch (...) {
    }
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.store.reset();
  s.adopted.reset();
}

Comm world() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active ? handle(s.world) : comm_null();
}

::c10d::Store* store() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active ? s.store.get() : nullptr;
}

int size(Comm comm) { return group(comm, "comm_size")->size; }

int rank(Comm comm) { return group(comm, "comm_rank")->rank; }

const std::vector<int>& world_ranks(Comm comm) { return group(comm, "world_ranks")->world_ranks; }

std::string name(Comm comm) {
  if (!owns(comm)) return "<not a c10d group>";
  return group(comm, "name")->name;
}

::c10d::ProcessGroup& process_group(Comm comm) { return *group(comm, "process_group")->pg; }

Comm split(Comm parent, std::vector<int> members, const std::string& what, bool shared) {
  Group* p = group(parent, "split");
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  for (int m : members) {
    TORCH_CHECK(m >= 0 && m < p->size, "shardtensor: ", what, ": rank ", m,
                " is not a rank of the c10d group '", p->name, "' of size ", p->size);
  }
  const auto me = std::find(members.begin(), members.end(), p->rank);
  TORCH_CHECK(me != members.end(), "shardtensor: ", what, ": this process (rank ", p->rank, " of '",
              p->name, "') is not among the members of its own group");
  std::vector<int> world_members;
  for (int m : members) world_members.push_back(p->world_ranks[m]);
  // A name every member computes alike and no other group has: the parent,
  // the how-manieth split of it, and the first member (Note [collective discipline]).
  // Note [c10d group reuse]: every member of a set asks for it alike, so a
  // hit or a miss (the collective creation) happens on all of them together.
  std::string child;
  Group* w = nullptr;
  std::chrono::milliseconds timeout{0};
  bool adopted = false;
  c10::intrusive_ptr<::c10d::Store> store;
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (shared) {
      auto it = s.shared.find(world_members);
      if (it != s.shared.end()) return handle(it->second);
    }
    std::ostringstream os;
    os << (shared ? "m" : "d");
    for (size_t i = 0; i < world_members.size(); ++i) os << (i ? "," : ":") << world_members[i];
    if (!shared) os << "#" << s.private_made[world_members]++;
    child = os.str();
    w = s.world;
    timeout = s.timeout;
    adopted = s.adopted != nullptr;
    store = s.store;
  }
  c10::intrusive_ptr<::c10d::ProcessGroup> sub;
  try {
    if (adopted) {
      // Note [adopted process group]: splitGroup crashed in ProcessGroupGloo::split
      // on a world made over a host's store (torch 2.13); the members make the
      // child group themselves, through the store under the child's name.
      const int sub_rank = static_cast<int>(me - members.begin());
      sub = make_world(c10::make_intrusive<::c10d::PrefixStore>(child, store), sub_rank,
                       static_cast<int>(members.size()), timeout);
    } else {
      sub = w->pg->splitGroup(world_members, timeout, std::nullopt, child, what);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "shardtensor: ", what, ": could not make the c10d group '", child,
                "': ", e.what());
  }
  TORCH_CHECK(sub, "shardtensor: ", what, ": c10d made no group '", child, "' for this rank");
  auto* g = new Group();
  g->pg = std::move(sub);
  g->size = static_cast<int>(members.size());
  g->rank = static_cast<int>(me - members.begin());
  g->world_ranks = std::move(world_members);
  g->name = child;
  g->shared = shared;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.live.insert(g);
  if (shared) s.shared.emplace(g->world_ranks, g);
  return handle(g);
}

void free_group(Comm& comm) noexcept {
  if (comm == comm_null()) return;
  auto& s = state();
  Group* g = reinterpret_cast<Group*>(comm);
  comm = comm_null();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (g == s.world || g->shared || s.live.erase(g) == 0) return;
  }
  try {
    delete g;
  } catch (...) {
  }
}

int64_t live_groups() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.active ? static_cast<int64_t>(s.live.size()) - 1 : 0;
}

}  // namespace shardtensor::detail::pg
