// The flight recorder (Note [flight recorder] in comm/flight_recorder.h).
#include "comm/flight_recorder.h"

#include <c10/util/Exception.h>
#include <shardtensor/core/runtime.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/process_groups.h"
#include "core/wait_board.h"

namespace shardtensor::comm::flight {

namespace {

constexpr int kMaxRanks = 16;  // world ranks kept per call / per wait (then "...")

struct Entry {
  const char* name = nullptr;
  uint64_t seq = 0;
  uint64_t comm_key = 0;
  int n = 0;  // number of world ranks of the communicator
  int ranks[kMaxRanks] = {};
};

struct Wait {
  const char* step = nullptr;  // null: not waiting
  int n = 0;                   // communicator's world ranks
  int ranks[kMaxRanks] = {};
  int npeers = 0;  // 0: a collective
  int peers[kMaxRanks] = {};
  int done = 0;  // peers [0, done) have arrived
};

// One recorder per process (the primitives run on the thread that calls the
// ops). Read by the SIGTERM handler, hence plain data and no locks; a torn
// read can only garble a diagnostic line.
Entry g_ring[kRingSize];
std::atomic<uint64_t> g_count{0};
Wait g_wait;
volatile std::sig_atomic_t g_waiting = 0;
int g_world_rank = -1;
std::atomic<bool> g_handler_installed{false};

void copy_ranks(const std::vector<int>& from, int* to, int& n) {
  n = static_cast<int>(from.size());
  const int m = std::min(n, kMaxRanks);
  for (int i = 0; i < m; ++i) to[i] = from[i];
}

// ---- async-signal-safe formatting ---------------------------------------------

struct Buf {
  char data[4096];
  size_t len = 0;
  void s(const char* str) {
    while (str != nullptr && *str != '\0' && len + 1 < sizeof(data)) data[len++] = *str++;
  }
  void i(long long v) {
    char tmp[24];
    int k = 0;
    const bool neg = v < 0;
    unsigned long long u = neg ? 0ULL - static_cast<unsigned long long>(v) : v;
    do {
      tmp[k++] = static_cast<char>('0' + u % 10);
      u /= 10;
    } while (u != 0 && k < 23);
    if (neg) s("-");
    while (k > 0 && len + 1 < sizeof(data)) data[len++] = tmp[--k];
  }
  void list(const int* r, int n, bool unique = false) {
    s("[");
    bool first = true;
    for (int k = 0; k < n && k < kMaxRanks; ++k) {
      bool seen = false;
      for (int j = 0; unique && j < k; ++j) seen = seen || r[j] == r[k];
      if (seen) continue;
      if (!first) s(", ");
      first = false;
      i(r[k]);
    }
    if (n > kMaxRanks) s(", ...");
    s("]");
  }
  void entry(const Entry& e) {
    s(e.name != nullptr ? e.name : "?");
    s(" call #");
    i(static_cast<long long>(e.seq));
    s(" on world ranks ");
    list(e.ranks, e.n);
  }
  void last() {
    const uint64_t c = g_count.load(std::memory_order_relaxed);
    if (c == 0) {
      s("no primitive call yet");
    } else {
      entry(g_ring[(c - 1) % kRingSize]);
    }
  }
  void history() {
    const uint64_t c = g_count.load(std::memory_order_relaxed);
    s("shardtensor flight recorder: world rank ");
    i(g_world_rank);
    s(", last calls (oldest first): ");
    const uint64_t first = c > static_cast<uint64_t>(kRingSize) ? c - kRingSize : 0;
    for (uint64_t k = first; k < c; ++k) {
      if (k != first) s("; ");
      entry(g_ring[k % kRingSize]);
    }
    if (c == 0) s("none");
    s("\n");
  }
  void wait() {
    if (!g_waiting || g_wait.step == nullptr) {
      s(" outside any wait (its last primitive call: ");
      last();
      s(")");
      return;
    }
    s(" while waiting in ");
    s(g_wait.step);
    s(" (its last primitive call: ");
    last();
    s(") ");
    if (g_wait.npeers > 0) {
      s("for the messages of world ranks ");
      const int from = std::min(g_wait.done, g_wait.npeers);
      list(g_wait.peers + from, std::min(g_wait.npeers, kMaxRanks) - from, /*unique=*/true);
    } else {
      s("for a collective over world ranks ");
      list(g_wait.ranks, g_wait.n);
      s(" to complete (a rank cannot see which ranks have not joined an MPI collective)");
    }
  }
  void flush() const {
    size_t off = 0;
    while (off < len) {
      const ssize_t w = ::write(2, data + off, len - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
  }
};

void on_sigterm(int sig) {
  Buf b;
  b.s("shardtensor: world rank ");
  b.i(g_world_rank);
  b.s(" received SIGTERM (a launcher ends the job, e.g. after another rank died)");
  b.wait();
  b.s("\n");
  b.history();
  b.flush();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install_handler() {
  bool expected = false;
  if (!g_handler_installed.compare_exchange_strong(expected, true)) return;
  struct sigaction old {};
  if (sigaction(SIGTERM, nullptr, &old) != 0) return;
  if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return;  // someone else's
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGTERM, &sa, nullptr);
}

std::string lost_key(int rank) { return "lost_by/" + std::to_string(rank); }

}  // namespace

void record(const char* name, uint64_t seq, uint64_t comm_key,
            const std::vector<int>& world_ranks) noexcept {
  const uint64_t c = g_count.load(std::memory_order_relaxed);
  if (c == 0) {
    try {
      g_world_rank = shardtensor::world_rank();
    } catch (...) {
    }
    install_handler();
  }
  Entry& e = g_ring[c % kRingSize];
  e.name = name;
  e.seq = seq;
  e.comm_key = comm_key;
  copy_ranks(world_ranks, e.ranks, e.n);
  g_count.store(c + 1, std::memory_order_relaxed);
}

void begin_wait(const char* step, const std::vector<int>& world_ranks,
                const std::vector<int>& peers) noexcept {
  g_waiting = 0;
  g_wait.step = step;
  copy_ranks(world_ranks, g_wait.ranks, g_wait.n);
  copy_ranks(peers, g_wait.peers, g_wait.npeers);
  g_wait.done = 0;
  g_waiting = 1;
}

void wait_progress(int done) noexcept { g_wait.done = done; }

void end_wait() noexcept { g_waiting = 0; }

std::string last_call() {
  Buf b;
  b.last();
  return std::string(b.data, b.len);
}

std::string history_line() {
  Buf b;
  b.history();
  return std::string(b.data, b.len);
}

void fail_job(const std::string& line, int code) {
  std::string out = line;
  if (out.empty() || out.back() != '\n') out += '\n';
  out += history_line();
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
  shardtensor::abort(code);
  std::_Exit(code);
}

void post_lost(int lost) noexcept {
  try {
    ::c10d::Store* store = detail::pg::store();
    if (store == nullptr) return;
    const std::string v = std::to_string(lost);
    store->set(lost_key(shardtensor::world_rank()), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (...) {
  }
}

int lost_by(int peer) noexcept {
  try {
    ::c10d::Store* store = detail::pg::store();
    if (store == nullptr) return -1;
    const std::string key = lost_key(peer);
    if (!store->check({key})) return -1;
    const std::vector<uint8_t> v = store->get(key);
    return std::stoi(std::string(v.begin(), v.end()));
  } catch (...) {
    return -1;
  }
}

int root_of(int peer) noexcept {
  int me = -1;
  try {
    me = shardtensor::world_rank();
  } catch (...) {
  }
  int at = peer;
  for (int hop = 0; hop < kRingSize; ++hop) {
    const int next = lost_by(at);
    if (next < 0 || next == me || next == at) break;
    at = next;
  }
  return at;
}

// ---- the wait board (MPI; core/wait_board.h) -----------------------------------

namespace {

std::string wait_key(int rank) { return "wait/" + std::to_string(rank); }

// The last recorded call, or false.
bool last_entry(Entry& out) {
  const uint64_t c = g_count.load(std::memory_order_relaxed);
  if (c == 0) return false;
  out = g_ring[(c - 1) % kRingSize];
  return true;
}

std::string call_key(const char* what) {
  Entry e;
  if (!last_entry(e)) return "";
  return std::string(what) + "/" + std::to_string(e.comm_key) + "/" + std::to_string(e.seq);
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// A post: "call\t<comm key>\t<seq>\t<name>\t<step>\t<world ranks>" or
// "step\t<step>\t<world ranks>"; empty: no long wait.
struct Post {
  bool any = false;
  bool call = false;
  uint64_t comm_key = 0;
  uint64_t seq = 0;
  std::string name, step, ranks;
};

Post decode(const std::vector<uint8_t>& v) {
  Post p;
  std::vector<std::string> f;
  std::string cur;
  for (uint8_t ch : v) {
    if (ch == '\t') {
      f.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(ch);
    }
  }
  f.push_back(cur);
  try {
    if (f.size() == 6 && f[0] == "call") {
      p.any = p.call = true;
      p.comm_key = std::stoull(f[1]);
      p.seq = std::stoull(f[2]);
      p.name = f[3];
      p.step = f[4];
      p.ranks = f[5];
    } else if (f.size() == 3 && f[0] == "step") {
      p.any = true;
      p.step = f[1];
      p.ranks = f[2];
    }
  } catch (...) {
    p = Post{};
  }
  return p;
}

}  // namespace

bool post_wait(const char* step, bool in_last_call) noexcept {
  ::c10d::Store* store = detail::board::store();
  Entry e;
  if (store == nullptr || g_world_rank < 0 || !last_entry(e)) return false;
  try {
    Buf r;
    r.list(e.ranks, e.n);
    std::ostringstream os;
    if (in_last_call) {
      os << "call\t" << e.comm_key << "\t" << e.seq << "\t" << (e.name ? e.name : "?") << "\t"
         << step << "\t" << std::string(r.data, r.len);
    } else {
      os << "step\t" << step << "\t" << std::string(r.data, r.len);
    }
    store->set(wait_key(g_world_rank), bytes(os.str()));
    return true;
  } catch (...) {
    return false;
  }
}

void withdraw_wait() noexcept {
  ::c10d::Store* store = detail::board::store();
  if (store == nullptr || g_world_rank < 0) return;
  try {
    store->set(wait_key(g_world_rank), std::vector<uint8_t>{});
  } catch (...) {
  }
}

BoardView read_board(const std::vector<int>& world_ranks) noexcept {
  BoardView view;
  ::c10d::Store* store = detail::board::store();
  Entry e;
  if (store == nullptr || !last_entry(e)) return view;
  try {
    std::vector<int> others;
    std::vector<std::string> keys;
    for (int r : world_ranks) {
      if (r == g_world_rank) continue;
      others.push_back(r);
      keys.push_back(wait_key(r));
    }
    const auto values = keys.empty() ? std::vector<std::vector<uint8_t>>{} : store->multiGet(keys);
    std::ostringstream os;
    view.in_call = 1;
    for (size_t i = 0; i < others.size() && i < values.size(); ++i) {
      const Post p = decode(values[i]);
      if (p.call && p.comm_key == e.comm_key && p.seq == e.seq) ++view.in_call;
      if (p.call && p.comm_key == e.comm_key && p.seq >= e.seq) continue;  // in it, or past it
      view.missing.push_back(others[i]);
      os << (os.tellp() == 0 ? "" : "; ") << "world rank " << others[i];
      if (!p.any) {
        os << " reported no wait: it is computing, in a wait shorter than the post threshold, "
              "or dead";
      } else if (p.call) {
        os << " waits in " << p.name << " call #" << p.seq << " on world ranks " << p.ranks << " ("
           << p.step << ")";
        if (p.comm_key == e.comm_key) os << ", an earlier call of this communicator";
      } else {
        os << " waits in " << p.step << " on world ranks " << p.ranks;
      }
    }
    view.detail = os.str();
    view.ok = true;
  } catch (...) {
    view = BoardView{};
  }
  return view;
}

int mark_expiring() noexcept {
  ::c10d::Store* store = detail::board::store();
  const std::string key = call_key("expiring");
  if (store == nullptr || key.empty()) return -1;
  try {
    const auto v =
        store->compareSet(key, std::vector<uint8_t>{}, bytes(std::to_string(g_world_rank)));
    return std::stoi(std::string(v.begin(), v.end()));
  } catch (...) {
    return -1;
  }
}

int expiring_by() noexcept {
  ::c10d::Store* store = detail::board::store();
  const std::string key = call_key("expiring");
  if (store == nullptr || key.empty()) return -1;
  try {
    if (!store->check({key})) return -1;
    const auto v = store->get(key);
    return std::stoi(std::string(v.begin(), v.end()));
  } catch (...) {
    return -1;
  }
}

void clear_expiring() noexcept {
  ::c10d::Store* store = detail::board::store();
  const std::string key = call_key("expiring");
  if (store == nullptr || key.empty()) return;
  try {
    store->deleteKey(key);
  } catch (...) {
  }
}

void printed_and_wait(int n, double seconds) noexcept {
  ::c10d::Store* store = detail::board::store();
  const std::string key = call_key("printed");
  if (store == nullptr || key.empty()) return;
  try {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(seconds));
    int64_t count = store->add(key, 1);
    while (count < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      count = store->add(key, 0);
    }
  } catch (...) {
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

}  // namespace shardtensor::comm::flight
