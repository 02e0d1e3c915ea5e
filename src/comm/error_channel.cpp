// Carried errors (Note [carried errors] in comm/error_channel.h).
#include "comm/error_channel.h"

#include <c10/util/Exception.h>
#include <shardtensor/core/runtime.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "comm/flight_recorder.h"
#include "core/channel.h"
#include "core/fingerprint.h"
#include "core/process_groups.h"

namespace shardtensor {
namespace detail {
void register_finalize_hook(std::function<void()> hook);  // core/runtime.cpp
}  // namespace detail

namespace comm::errors {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTag = 4242;
// kOpFailed: an op raised here (Note [carried rule errors]); kFinal: this rank
// has reached finalize; kEnded: under MPI, a rank of a poisoned job has reached
// finalize (the ranks end together, as over c10d; see the finalize hook).
enum Kind : int64_t { kFailed = 1, kPoison = 2, kOpFailed = 3, kFinal = 4, kEnded = 5 };

// The key under which this rank's own op failures are kept (numbered by this
// rank only); no communicator's fingerprint.
constexpr uint64_t kOpKey = 0x6f702d6661696cULL;

// The calls a rank had entered on each communicator (its next_seq).
using Entered = std::map<uint64_t, uint64_t>;

/// What the library caches on each communicator it has seen (an MPI
/// attribute, so it goes away with the communicator).
struct CommInfo {
  uint64_t key = 0;
  std::vector<int> world_ranks;  // of the communicator's ranks, in its order
};

#if SHARDTENSOR_WITH_MPI
int delete_info(Comm, int, void* value, void*) {
  delete static_cast<CommInfo*>(value);
  return MPI_SUCCESS;
}
#endif

struct Message {
  int64_t kind = 0;
  uint64_t key = 0;
  uint64_t seq = 0;
  int origin = -1;  // world rank
  std::string text;
  Entered entered;  // kOpFailed: the sender's calls entered when it failed
};

/// A call that failed here (locally or carried at entry): the world ranks of
/// its communicator not yet heard from.
struct Failure {
  std::set<int> waiting;
  std::string text;
  Entered entered;  // for an op failure: this rank's calls entered when it failed
};

struct State {
#if SHARDTENSOR_WITH_MPI
  int keyval = MPI_KEYVAL_INVALID;
#endif
  bool hook_registered = false;
  bool poisoned = false;
  int poison_origin = -1;
  std::string poison_text;
  std::map<std::pair<uint64_t, uint64_t>, Failure> failures;
  // Calls are numbered per set of ranks (the key), not per Comm handle:
  // two handles over the same ranks (a mesh dim and a one-dim group) share
  // the numbering, which every rank advances in the same order.
  std::map<uint64_t, uint64_t> next_seq;
  // Failures of calls this rank has not entered yet (ranks ahead of it).
  std::multimap<std::pair<uint64_t, uint64_t>, Message> early;
  // Sends in flight, with their buffers (kept until MPI has completed them).
#if SHARDTENSOR_WITH_MPI
  std::deque<std::pair<MPI_Request, std::vector<char>>> sends;
#endif
  // Under c10d: messages of the store's list already read.
  int64_t store_seen = 0;
  // Note [carried rule errors]: this rank's op failures so far, op failures
  // of other ranks not yet matched by one of this rank (in arrival order), the
  // ranks that reached finalize, and the world ranks of each communicator key.
  uint64_t op_failures = 0;
  std::vector<Message> pending_ops;
  std::set<int> finals;
  std::map<uint64_t, std::vector<int>> members;
  // Under MPI: world ranks that reached finalize in a poisoned job (kEnded).
  std::set<int> ended;
  // Errors this library raised that the channel already carries (a rule that
  // passes one on must not carry it again).
  uint64_t carried_throws = 0;
};

State& state() {
  static State* s = new State();  // leaked: usable from finalize hooks at exit
  return *s;
}

bool over_c10d() { return shardtensor::detail::pg::active(); }

// An op failure's text carries the sender's entered calls on its first line.
std::string encode_entered(const Entered& entered, const std::string& text) {
  std::ostringstream os;
  os << entered.size();
  for (const auto& kv : entered) os << ' ' << kv.first << ' ' << kv.second;
  os << '\n' << text;
  return os.str();
}

void decode_entered(Message& m) {
  if (m.kind != kOpFailed) return;
  const size_t nl = m.text.find('\n');
  if (nl == std::string::npos) return;
  std::istringstream is(m.text.substr(0, nl));
  size_t n = 0;
  is >> n;
  for (size_t i = 0; i < n; ++i) {
    uint64_t key = 0, seq = 0;
    is >> key >> seq;
    m.entered[key] = seq;
  }
  m.text = m.text.substr(nl + 1);
}

int world_rank_of_me() {
  if (over_c10d()) return shardtensor::detail::pg::rank(shardtensor::detail::pg::world());
  int r = -1;
#if SHARDTENSOR_WITH_MPI
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
#endif
  return r;
}

#if SHARDTENSOR_WITH_MPI
CommInfo& info_of(Comm comm) {
  auto& s = state();
  if (s.keyval == MPI_KEYVAL_INVALID) {
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_info, &s.keyval, nullptr);
  }
  void* value = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm, s.keyval, &value, &found);
  if (found) {
    return *static_cast<CommInfo*>(value);
  }
  auto* info = new CommInfo();
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  int n = 0;
  MPI_Group_size(group, &n);
  std::vector<int> ranks(n);
  for (int i = 0; i < n; ++i) ranks[i] = i;
  info->world_ranks.resize(n);
  MPI_Group_translate_ranks(group, n, ranks.data(), world, info->world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  std::vector<int64_t> as64(info->world_ranks.begin(), info->world_ranks.end());
  info->key = shardtensor::detail::Fingerprint().add(as64).value();
  MPI_Comm_set_attr(comm, s.keyval, info);
  return *info;
}

void reap_sends() {
  auto& s = state();
  while (!s.sends.empty()) {
    int done = 0;
    MPI_Test(&s.sends.front().first, &done, MPI_STATUS_IGNORE);
    if (!done) break;
    s.sends.pop_front();
  }
}
#else
// A c10d-only build has no MPI communicators (Note [c10d-only build]): every
// group is a c10d one, whose channel is the store.
CommInfo& info_of(Comm) {
  TORCH_INTERNAL_ASSERT(false, "an MPI communicator in a c10d-only build");
}
#endif

// ---- the channel over c10d: a list of messages in the rendezvous store ----------
// Key "carried/n" counts the messages, "carried/<i>" holds message i: a header
// line "kind key seq origin ntargets target..." and the text. Every rank reads
// the whole list in order and keeps the messages addressed to it.

std::string store_key(int64_t i) { return "carried/" + std::to_string(i); }

void post_store(Kind kind, uint64_t key, uint64_t seq, const std::string& text,
                const std::vector<int>& targets) {
  ::c10d::Store* store = shardtensor::detail::pg::store();
  if (store == nullptr) return;
  std::ostringstream os;
  os << static_cast<int64_t>(kind) << ' ' << key << ' ' << seq << ' ' << world_rank_of_me() << ' '
     << targets.size();
  for (int t : targets) os << ' ' << t;
  os << '\n' << text;
  const std::string v = os.str();
  try {
    const int64_t i = store->add("carried/n", 1) - 1;
    store->set(store_key(i), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardtensor: world rank %d could not post an error to the store: %s\n",
                 world_rank_of_me(), e.what());
  }
}

void drain_store(const std::function<void(const Message&)>& handle) {
  ::c10d::Store* store = shardtensor::detail::pg::store();
  if (store == nullptr) return;
  auto& s = state();
  const int me = world_rank_of_me();
  int64_t n = 0;
  try {
    n = store->add("carried/n", 0);
  } catch (...) {
    return;
  }
  while (s.store_seen < n) {
    std::vector<uint8_t> raw;
    try {
      const std::string key = store_key(s.store_seen);
      if (!store->check({key})) return;  // posted but not yet written: next poll
      raw = store->get(key);
    } catch (...) {
      return;
    }
    ++s.store_seen;
    const std::string v(raw.begin(), raw.end());
    const size_t nl = v.find('\n');
    std::istringstream is(v.substr(0, nl));
    Message m;
    size_t ntargets = 0;
    is >> m.kind >> m.key >> m.seq >> m.origin >> ntargets;
    bool mine = false;
    for (size_t k = 0; k < ntargets; ++k) {
      int t = -1;
      is >> t;
      mine = mine || t == me;
    }
    if (!mine || m.origin == me) continue;
    if (nl != std::string::npos) m.text = v.substr(nl + 1);
    decode_entered(m);
    handle(m);
  }
}

#if SHARDTENSOR_WITH_MPI
void post_mpi(Comm channel, Kind kind, uint64_t key, uint64_t seq, const std::string& text,
              const std::vector<int>& targets) {
  auto& s = state();
  reap_sends();
  const int me = world_rank_of_me();
  const int64_t header[4] = {kind, static_cast<int64_t>(key), static_cast<int64_t>(seq), me};
  for (int target : targets) {
    if (target == me) continue;
    std::vector<char> buf(sizeof(header) + text.size());
    std::memcpy(buf.data(), header, sizeof(header));
    std::memcpy(buf.data() + sizeof(header), text.data(), text.size());
    s.sends.emplace_back(MPI_REQUEST_NULL, std::move(buf));
    auto& back = s.sends.back();
    MPI_Isend(back.second.data(), static_cast<int>(back.second.size()), MPI_BYTE, target, kTag,
              channel, &back.first);
  }
}
#endif

/// Posts on the error channel: the MPI duplicate, or the store under c10d.
void post(Comm channel, Kind kind, uint64_t key, uint64_t seq, const std::string& text,
          const std::vector<int>& targets) {
  if (over_c10d()) {
    post_store(kind, key, seq, text, targets);
  } else {
#if SHARDTENSOR_WITH_MPI
    post_mpi(channel, kind, key, seq, text, targets);
#endif
  }
}

std::vector<int> all_world_ranks() {
  int n = 0;
  if (over_c10d()) {
    n = shardtensor::detail::pg::size(shardtensor::detail::pg::world());
  } else {
#if SHARDTENSOR_WITH_MPI
    MPI_Comm_size(MPI_COMM_WORLD, &n);
#endif
  }
  std::vector<int> r(n);
  for (int i = 0; i < n; ++i) r[i] = i;
  return r;
}

/// Calls `handle` on every message waiting on the channel.
void drain(Comm channel, const std::function<void(const Message&)>& handle) {
  if (over_c10d()) {
    drain_store(handle);
    return;
  }
#if SHARDTENSOR_WITH_MPI
  for (;;) {
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kTag, channel, &flag, &status);
    if (!flag) return;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> buf(static_cast<size_t>(bytes));
    MPI_Recv(buf.data(), bytes, MPI_BYTE, status.MPI_SOURCE, kTag, channel, MPI_STATUS_IGNORE);
    int64_t header[4] = {0, 0, 0, -1};
    if (buf.size() >= sizeof(header)) std::memcpy(header, buf.data(), sizeof(header));
    Message m;
    m.kind = header[0];
    m.key = static_cast<uint64_t>(header[1]);
    m.seq = static_cast<uint64_t>(header[2]);
    m.origin = static_cast<int>(header[3]);
    if (buf.size() > sizeof(header)) {
      m.text.assign(buf.data() + sizeof(header), buf.size() - sizeof(header));
    }
    if (m.kind == kEnded) {  // for the finalize hook only
      state().ended.insert(m.origin);
      continue;
    }
    decode_entered(m);
    handle(m);
  }
#endif
}

/// The world rank whose error a message is about.
int culprit(const Message& m) { return m.kind == kPoison ? static_cast<int>(m.seq) : m.origin; }

void poison(Comm channel, int origin, const std::string& text, bool tell_everyone) {
  auto& s = state();
  if (std::getenv("SHARDTENSOR_TRACE_CALLS") != nullptr) {
    std::fprintf(stderr, "[carried errors] world rank %d poisoned by %d: %s\n", world_rank_of_me(),
                 origin, text.c_str());
  }
  if (!s.poisoned) {
    s.poisoned = true;
    s.poison_origin = origin;
    s.poison_text = text;
  }
  if (tell_everyone) {
    // A poison names the rank whose error started it (in the seq slot).
    post(channel, kPoison, 0, static_cast<uint64_t>(s.poison_origin), s.poison_text,
         all_world_ranks());
  }
}

/// Whether the sender of the op failure `m` had entered the same calls as
/// `mine` on every communicator this rank has used that both belong to.
bool same_calls(const Entered& mine, const Message& m) {
  for (const auto& kv : state().members) {
    const auto& ranks = kv.second;
    if (std::find(ranks.begin(), ranks.end(), m.origin) == ranks.end()) continue;
    const auto a = mine.find(kv.first);
    const auto b = m.entered.find(kv.first);
    if ((a == mine.end() ? 0 : a->second) != (b == m.entered.end() ? 0 : b->second)) return false;
  }
  return true;
}

/// True if `m` is handled without poisoning the job: a verdict on one of
/// this rank's own failures, or a failure of a call (or an op) this rank has
/// not passed yet (kept for then).
bool settle_verdict(const Message& m) {
  auto& s = state();
  if (m.kind == kFailed) {
    auto it = s.failures.find({m.key, m.seq});
    if (it != s.failures.end()) {
      it->second.waiting.erase(m.origin);
      return true;
    }
    auto seq = s.next_seq.find(m.key);
    if (seq == s.next_seq.end() || m.seq >= seq->second) {
      // A call this rank has not entered yet: it finds the error there.
      s.early.emplace(std::make_pair(m.key, m.seq), m);
      return true;
    }
  } else if (m.kind == kOpFailed) {
    // Note [carried rule errors]: the oldest failure of this rank still
    // waiting for the sender's verdict must be at the same calls.
    for (auto& kv : s.failures) {
      if (kv.first.first != kOpKey || kv.second.waiting.count(m.origin) == 0) continue;
      if (!same_calls(kv.second.entered, m)) return false;
      kv.second.waiting.erase(m.origin);
      return true;
    }
    s.pending_ops.push_back(m);
    return true;
  }
  return false;
}

/// An op failure of another rank that this rank cannot wait out: since it
/// failed, this rank has entered (or is entering) a call on a communicator of
/// both that the failed rank had not entered, and will never enter.
const Message* blocking_op_failure() {
  auto& s = state();
  for (const Message& m : s.pending_ops) {
    for (const auto& kv : s.members) {
      const auto& ranks = kv.second;
      if (std::find(ranks.begin(), ranks.end(), m.origin) == ranks.end()) continue;
      const auto mine = s.next_seq.find(kv.first);
      const auto theirs = m.entered.find(kv.first);
      if ((mine == s.next_seq.end() ? 0 : mine->second) >
          (theirs == m.entered.end() ? 0 : theirs->second)) {
        return &m;
      }
    }
  }
  return nullptr;
}

/// One message read from the channel: settled, or it poisons the job. Returns
/// whether it poisoned (or found this rank blocked by a failed rank).
bool handle(Comm channel, const Message& m) {
  auto& s = state();
  if (m.kind == kFinal) {
    // Its sender has finalized: a verdict it has not given on a failure of
    // this rank will never come (it would have come first), so that rank
    // passed the failed call or op.
    s.finals.insert(m.origin);
    for (const auto& kv : s.failures) {
      if (kv.second.waiting.count(m.origin) != 0) {
        poison(channel, world_rank_of_me(), kv.second.text, /*tell_everyone=*/true);
        return true;
      }
    }
    return false;
  }
  if (settle_verdict(m)) {
    if (const Message* b = blocking_op_failure()) {
      const Message copy = *b;
      poison(channel, copy.origin, copy.text, /*tell_everyone=*/true);
      return true;
    }
    return false;
  }
  poison(channel, culprit(m), m.text, /*tell_everyone=*/m.kind != kPoison);
  return true;
}

[[noreturn]] void throw_poisoned(const char* where) {
  auto& s = state();
  ++s.carried_throws;
  TORCH_CHECK(false, "shardtensor: ", where, ": communication is inconsistent since world rank ",
              s.poison_origin, " raised an error that other ranks were waiting on: ", s.poison_text,
              " (Note [carried errors]: every shardtensor call now raises; end the job; finalize "
              "exits with code ",
              kCarriedErrorExitCode, ")");
}

bool unresolved() {
  for (const auto& kv : state().failures) {
    if (!kv.second.waiting.empty()) return true;
  }
  return false;
}

/// Waits until every earlier failure of this rank has a verdict from all the
/// other ranks of its communicator (watchdog-bounded); drops the settled ones.
void resolve(Comm channel) {
  auto& s = state();
  const auto start = Clock::now();
  const double limit = shardtensor::timeout();
  while (unresolved()) {
    drain(channel, [&](const Message& m) { handle(channel, m); });
    if (s.poisoned || !unresolved()) break;
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (limit > 0 && waited > limit) {
      std::fprintf(stderr,
                   "shardtensor watchdog: world rank %d waited %g s (SHARDTENSOR_TIMEOUT = %g s) "
                   "for the other ranks' verdict on an error it raised (Note [carried errors]); "
                   "aborting the job with exit code %d\n",
                   world_rank_of_me(), waited, limit, kWatchdogExitCode);
      shardtensor::abort(kWatchdogExitCode);
    }
    // Over c10d each read is a store round trip: a modest rate.
    std::this_thread::sleep_for(std::chrono::microseconds(over_c10d()     ? 1000
                                                          : waited < 1e-2 ? 1
                                                                          : 100));
  }
  for (auto it = s.failures.begin(); it != s.failures.end();) {
    it = it->second.waiting.empty() ? s.failures.erase(it) : std::next(it);
  }
}

/// The channel to post on: the MPI duplicate, or comm_null() under c10d (the store).
Comm current_channel() { return over_c10d() ? comm_null() : shardtensor::detail::error_channel(); }

// How long finalize waits for the other ranks to reach it (Note [carried rule
// errors]) when the watchdog allows longer or is off.
constexpr double kFinalWaitSeconds = 30.0;

/// Note [carried rule errors]: at finalize every rank tells the others it got
/// here and waits (bounded) until each has, or the job is poisoned. An op
/// that failed on some ranks while the others passed it and never
/// communicated again is found here: its failure reaches the others before
/// its ranks' kFinal does.
void exchange_finals(Comm channel) {
  auto& s = state();
  const std::vector<int> world = all_world_ranks();
  if (world.size() > 1) {
    post(channel, kFinal, 0, 0, "", world);
    const double t = shardtensor::timeout();
    const double limit = t > 0 ? std::min(t, kFinalWaitSeconds) : kFinalWaitSeconds;
    const auto start = Clock::now();
    while (!s.poisoned && s.finals.size() + 1 < world.size()) {
      drain(channel, [&](const Message& m) { handle(channel, m); });
      if (s.poisoned || s.finals.size() + 1 >= world.size()) break;
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > limit) break;  // a rank that never finalizes: nothing more to learn
      std::this_thread::sleep_for(std::chrono::microseconds(over_c10d() ? 1000 : 100));
    }
  }
  // Failures of ops this rank has passed without failing them.
  if (!s.poisoned && !s.pending_ops.empty()) {
    const Message m = s.pending_ops.front();
    poison(channel, m.origin, m.text, /*tell_everyone=*/true);
  }
  s.pending_ops.clear();
  s.finals.clear();
}

void register_hook() {
  auto& s = state();
  if (s.hook_registered) return;
  s.hook_registered = true;
  shardtensor::detail::register_finalize_hook([] {
    const Comm channel = shardtensor::detail::error_channel();
    if (channel == comm_null() && !over_c10d()) return;
    if (!state().poisoned) exchange_finals(channel);
    resolve(channel);
    auto& st = state();
    if (st.poisoned && over_c10d()) {
      // A rank that ends now makes torchrun's agent end the others within
      // 0.1 s, perhaps before they have read the error: end together, once
      // every rank got here (bounded by the watchdog, else 10 s).
      try {
        ::c10d::Store* store = shardtensor::detail::pg::store();
        const int64_t n = static_cast<int64_t>(all_world_ranks().size());
        if (store != nullptr) {
          store->add("carried/ended", 1);
          const double limit = shardtensor::timeout() > 0 ? shardtensor::timeout() : 10.0;
          const auto start = Clock::now();
          while (store->add("carried/ended", 0) < n &&
                 std::chrono::duration<double>(Clock::now() - start).count() < limit) {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
      } catch (...) {
      }
    }
    if (st.poisoned && !over_c10d()) {
      // Under MPI too, the first MPI_Abort ends every rank at once, perhaps
      // before a slower one has raised the error (its lines were missing,
      // 1 run in ~40 of carried_errors.one_rank_bad_piece.np3): end together,
      // once every rank got here, told over the error channel (point-to-point
      // on its own communicator, untouched by the abandoned collectives);
      // bounded by the watchdog, else 10 s.
      const std::vector<int> everyone = all_world_ranks();
      post(channel, kEnded, 0, 0, "", everyone);
      const double limit = shardtensor::timeout() > 0 ? shardtensor::timeout() : 10.0;
      const auto start = Clock::now();
      while (st.ended.size() + 1 < everyone.size() &&
             std::chrono::duration<double>(Clock::now() - start).count() < limit) {
        drain(channel, [&](const Message& m) { handle(channel, m); });
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (st.poisoned) {
      std::fprintf(stderr,
                   "shardtensor: world rank %d ends the job with exit code %d: communication "
                   "was left inconsistent by an error raised on world rank %d (%s) (Note "
                   "[carried errors])\n",
                   world_rank_of_me(), kCarriedErrorExitCode, st.poison_origin,
                   st.poison_text.c_str());
      shardtensor::abort(kCarriedErrorExitCode);
    }
  });
}

}  // namespace

CallId enter(Comm comm, const char* name) {
  CallId id;
  if (comm == comm_null()) return id;
  // Under c10d (Note [c10d handles]) the channel is the store, read at entry
  // only while this rank awaits verdicts (a store round trip per call would
  // cost the success path); errors reach the others in their waits.
  const bool c10d = shardtensor::detail::pg::owns(comm);
  const Comm channel = c10d ? comm_null() : shardtensor::detail::error_channel();
  if (!c10d && channel == comm_null()) return id;
  register_hook();
  const std::vector<int>* world_ranks = nullptr;
  if (c10d) {
    world_ranks = &shardtensor::detail::pg::world_ranks(comm);
    std::vector<int64_t> as64(world_ranks->begin(), world_ranks->end());
    id.comm_key = shardtensor::detail::Fingerprint().add(as64).value();
  } else {
    CommInfo& info = info_of(comm);
    world_ranks = &info.world_ranks;
    id.comm_key = info.key;
  }
  id.comm = comm;
  auto& s = state();
  // Before this call is numbered, so that failures of it by ranks ahead of
  // this one count as early (they are taken below, not as a poison).
  if (!c10d) {
    drain(channel, [&](const Message& m) { handle(channel, m); });
  }
  if (!s.poisoned) resolve(channel);
  if (s.poisoned) throw_poisoned("a shardtensor primitive");
  if (s.members.count(id.comm_key) == 0) s.members[id.comm_key] = *world_ranks;
  id.seq = s.next_seq[id.comm_key]++;
  // A rank whose op failed before it entered this call will never enter it
  // (Note [carried rule errors]).
  if (!s.pending_ops.empty()) {
    if (const Message* b = blocking_op_failure()) {
      const Message copy = *b;
      poison(channel, copy.origin, copy.text, /*tell_everyone=*/true);
      throw_poisoned("a shardtensor primitive");
    }
  }
  flight::record(name, id.seq, id.comm_key, *world_ranks);
  if (std::getenv("SHARDTENSOR_TRACE_CALLS") != nullptr) {
    std::fprintf(stderr, "[carried errors] world rank %d enters call %llu on %llx\n",
                 world_rank_of_me(), static_cast<unsigned long long>(id.seq),
                 static_cast<unsigned long long>(id.comm_key));
  }
  // Failures of this very call by ranks that got here first: fail alike,
  // before communicating, and tell the others of the communicator.
  const Message* carried = nullptr;
  Message first_carried;
  for (auto it = s.early.lower_bound({id.comm_key, id.seq});
       it != s.early.end() && it->first == std::make_pair(id.comm_key, id.seq);) {
    if (carried == nullptr) {
      first_carried = it->second;
      carried = &first_carried;
      Failure f;
      for (int r : *world_ranks) f.waiting.insert(r);
      f.waiting.erase(world_rank_of_me());
      s.failures[{id.comm_key, id.seq}] = std::move(f);
      post(channel, kFailed, id.comm_key, id.seq, it->second.text, *world_ranks);
    }
    s.failures[{id.comm_key, id.seq}].waiting.erase(it->second.origin);
    it = s.early.erase(it);
  }
  if (carried != nullptr) {
    ++s.carried_throws;
    TORCH_CHECK(false, first_carried.text, " [raised on world rank ", first_carried.origin,
                " and carried to world rank ", world_rank_of_me(),
                " before it communicated (Note [carried errors])]");
  }
  return id;
}

void fail(const CallId& call, const std::string& message) {
  const bool c10d = call.comm != comm_null() && shardtensor::detail::pg::owns(call.comm);
  const Comm channel = c10d ? comm_null() : shardtensor::detail::error_channel();
  if ((c10d || channel != comm_null()) && call.comm != comm_null()) {
    const std::vector<int>& world_ranks =
        c10d ? shardtensor::detail::pg::world_ranks(call.comm) : info_of(call.comm).world_ranks;
    if (std::getenv("SHARDTENSOR_TRACE_CALLS") != nullptr) {
      std::fprintf(stderr, "[carried errors] world rank %d fails call %llu on %llx\n",
                   world_rank_of_me(), static_cast<unsigned long long>(call.seq),
                   static_cast<unsigned long long>(call.comm_key));
    }
    if (world_ranks.size() > 1) {
      Failure f;
      for (int r : world_ranks) f.waiting.insert(r);
      f.waiting.erase(world_rank_of_me());
      auto& s = state();
      s.failures[{call.comm_key, call.seq}] = std::move(f);
      post(channel, kFailed, call.comm_key, call.seq, message, world_ranks);
    }
  }
  ++state().carried_throws;
  TORCH_CHECK(false, message);
}

// ---- outermost ops (Note [carried rule errors]) ----------------------------------

namespace {

uint64_t op_begin() {
  auto& s = state();
  if (!s.hook_registered) register_hook();
  return s.carried_throws;
}

void op_failed(uint64_t token, const char* op_name, const std::string& what) {
  auto& s = state();
  // Raised by the channel itself (already carried), or a poisoned job.
  if (s.poisoned || s.carried_throws != token) return;
  const Comm channel = current_channel();
  if (!over_c10d() && channel == comm_null()) return;
  const std::vector<int> world = all_world_ranks();
  if (world.size() <= 1) return;
  const int me = world_rank_of_me();
  Failure f;
  f.waiting.insert(world.begin(), world.end());
  f.waiting.erase(me);
  f.text =
      std::string("op '") + op_name + "' raised on world rank " + std::to_string(me) + ": " + what;
  f.entered = s.next_seq;
  if (std::getenv("SHARDTENSOR_TRACE_CALLS") != nullptr) {
    std::fprintf(stderr, "[carried errors] world rank %d fails in op %s\n", me, op_name);
  }
  // The oldest op failure of each rank that failed before this one did: at
  // the same calls, it failed alike; else they went apart.
  std::set<int> seen;
  for (auto it = s.pending_ops.begin(); it != s.pending_ops.end();) {
    if (!seen.insert(it->origin).second) {
      ++it;
      continue;
    }
    if (!same_calls(f.entered, *it)) {
      const Message copy = *it;
      poison(channel, copy.origin, copy.text, /*tell_everyone=*/true);
      return;
    }
    f.waiting.erase(it->origin);
    it = s.pending_ops.erase(it);
  }
  post(channel, kOpFailed, kOpKey, s.op_failures, encode_entered(f.entered, f.text), world);
  s.failures[{kOpKey, s.op_failures++}] = std::move(f);
}

// The text of the exception being handled.
std::string current_what() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// How many run_as_op brackets are open on this thread.
thread_local int t_nesting = 0;

}  // namespace

void run_as_op(const char* name, c10::function_ref<void()> body) {
  if (t_nesting > 0) {
    body();
    return;
  }
  const uint64_t token = op_begin();
  ++t_nesting;
  struct Leave {
    ~Leave() { --t_nesting; }
  } leave;
  try {
    body();
  } catch (...) {
    op_failed(token, name, current_what());
    throw;
  }
}

#if SHARDTENSOR_WITH_MPI
void poll(int n, MPI_Request* requests, bool p2p, const char* what) {
  const Comm channel = shardtensor::detail::error_channel();
  if (channel == comm_null()) return;
  auto& s = state();
  bool abandon = false;
  drain(channel, [&](const Message& m) { abandon = handle(channel, m) || abandon; });
  if (!abandon) return;
  // A wait whose requests have all completed meanwhile is not abandoned: its
  // call completed on every rank it involves (the messages it waited for were
  // sent before the error that poisoned the job, and the probe above
  // progressed them), so it returns normally and the job, now poisoned,
  // raises at this rank's next primitive. Otherwise a rank still leaving an
  // earlier call (a warm-up barrier) would raise outside the code that made
  // the failing call. MPI_Request_get_status leaves the requests (and their
  // statuses) to the caller's MPI_Testall.
  bool all_done = true;
  for (int i = 0; i < n && all_done; ++i) {
    int done = 1;
    if (requests[i] != MPI_REQUEST_NULL) {
      MPI_Request_get_status(requests[i], &done, MPI_STATUS_IGNORE);
    }
    all_done = done != 0;
  }
  if (all_done) return;
  // Cancel what can be cancelled (point-to-point); collective requests cannot
  // be, and are left to MPI (the job ends at finalize).
  for (int i = 0; i < n; ++i) {
    if (requests[i] == MPI_REQUEST_NULL) continue;
    if (p2p) {
      MPI_Cancel(&requests[i]);
      int done = 0;
      const auto start = Clock::now();
      while (!done && std::chrono::duration<double>(Clock::now() - start).count() < 0.5) {
        MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE);
      }
      if (!done) MPI_Request_free(&requests[i]);
    }
    requests[i] = MPI_REQUEST_NULL;
  }
  ++s.carried_throws;
  const char* op = OpLabel::current();
  TORCH_CHECK(false, "shardtensor: world rank ", world_rank_of_me(), " stopped waiting in ", what,
              " during op '", (*op != '\0' ? op : "<none>"), "' because world rank ",
              s.poison_origin, " raised: ", s.poison_text,
              " (Note [carried errors]: communication is now inconsistent; every shardtensor "
              "call raises from now on; end the job; finalize exits with code ",
              kCarriedErrorExitCode, ")");
}
#endif

// ---- waits of the c10d transport: a monitor thread reads the store ----------------

struct StoreWatchAccess {
  static void interrupt(StoreWatch* w) {
    w->interrupted_.store(true);
    try {
      w->interrupt_();
    } catch (...) {
    }
  }
  static long long& id(StoreWatch* w) { return w->id_; }
};

namespace {

struct WatchMonitor {
  std::mutex mu;
  std::condition_variable cv;
  StoreWatch* current = nullptr;
  long long current_id = -1;
  long long next_id = 0;
  bool started = false;
  bool idle = true;  // the thread waits for a watch without a deadline
};

WatchMonitor& watch_monitor() {
  static auto* m = new WatchMonitor();  // leaked: the detached thread may outlive statics
  return *m;
}

void watch_loop() {
  WatchMonitor& m = watch_monitor();
  std::unique_lock<std::mutex> lock(m.mu);
  const auto period =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kStorePollSeconds));
  int quiet_periods = 0;
  for (;;) {
    if (m.current == nullptr) {
      // Between the waits of a busy rank: keep ticking (a wake-up per period)
      // for a second, so that a new watch needs no notify; then sleep.
      if (++quiet_periods < 50) {
        m.cv.wait_for(lock, period);
        continue;
      }
      m.idle = true;
      m.cv.wait(lock);
      m.idle = false;
      quiet_periods = 0;
      continue;
    }
    quiet_periods = 0;
    const long long id = m.current_id;
    if (m.cv.wait_for(lock, period, [&] { return m.current_id != id; })) continue;
    StoreWatch* w = m.current;
    if (w == nullptr || w->interrupted()) continue;
    // The waiting thread is blocked in Gloo until this poll ends (its
    // ~StoreWatch takes the lock), so the state is not shared meanwhile.
    bool abandon = false;
    drain(comm_null(), [&](const Message& msg) { abandon = handle(comm_null(), msg) || abandon; });
    if (abandon) StoreWatchAccess::interrupt(w);
  }
}

}  // namespace

StoreWatch::StoreWatch(std::function<void()> interrupt) : interrupt_(std::move(interrupt)) {
  WatchMonitor& m = watch_monitor();
  std::lock_guard<std::mutex> lock(m.mu);
  if (!m.started) {
    std::thread(watch_loop).detach();
    m.started = true;
  }
  id_ = m.next_id++;
  m.current = this;
  m.current_id = id_;
  // A busy thread finds the new watch when its period ends (no wake-up per wait).
  if (m.idle) m.cv.notify_all();
}

StoreWatch::~StoreWatch() {
  WatchMonitor& m = watch_monitor();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.current_id == id_) {
    m.current = nullptr;
    m.current_id = -1;
  }
}

bool poll_store() {
  if (!over_c10d()) return poisoned();
  WatchMonitor& m = watch_monitor();
  std::lock_guard<std::mutex> lock(m.mu);  // not while the monitor reads
  drain(comm_null(), [&](const Message& msg) { handle(comm_null(), msg); });
  return state().poisoned;
}

void StoreWatch::raise(const char* what) const { raise_poisoned(what); }

void raise_poisoned(const char* what) {
  auto& s = state();
  ++s.carried_throws;
  const char* op = OpLabel::current();
  TORCH_CHECK(false, "shardtensor: world rank ", world_rank_of_me(), " stopped waiting in ", what,
              " during op '", (*op != '\0' ? op : "<none>"), "' because world rank ",
              s.poison_origin, " raised: ", s.poison_text,
              " (Note [carried errors]: communication is now inconsistent; every shardtensor "
              "call raises from now on; end the job; finalize exits with code ",
              kCarriedErrorExitCode, ")");
}

bool poisoned() { return state().poisoned; }

size_t tracked_entries() {
  auto& s = state();
  size_t sends = 0;
#if SHARDTENSOR_WITH_MPI
  reap_sends();
  sends = s.sends.size();
#endif
  return s.next_seq.size() + s.failures.size() + s.early.size() + s.pending_ops.size() +
         s.finals.size() + sends;
}

}  // namespace comm::errors
}  // namespace shardtensor
