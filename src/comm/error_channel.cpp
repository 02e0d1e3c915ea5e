// Carried errors (Note [carried errors] in comm/error_channel.h).
#include "comm/error_channel.h"

#include <c10/util/Exception.h>
#include <shardtensor/core/runtime.h>

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

#include "core/channel.h"
#include "core/fingerprint.h"

namespace shardtensor {
namespace detail {
void register_finalize_hook(std::function<void()> hook);  // core/runtime.cpp
}  // namespace detail

namespace comm::errors {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTag = 4242;
enum Kind : int64_t { kFailed = 1, kPoison = 2, kRuleFailed = 3, kRuleAlike = 4 };

/// What the library caches on each communicator it has seen (an MPI
/// attribute, so it goes away with the communicator).
struct CommInfo {
  uint64_t key = 0;
  std::vector<int> world_ranks;  // of the communicator's ranks, in its order
};

int delete_info(MPI_Comm, int, void* value, void*) {
  delete static_cast<CommInfo*>(value);
  return MPI_SUCCESS;
}

struct Message {
  int64_t kind = 0;
  uint64_t key = 0;
  uint64_t seq = 0;
  int origin = -1;  // world rank
  std::string text;
  // kRuleFailed: the origin's next call number on each communicator it had
  // used when the rule threw (Note [rule errors]).
  std::map<uint64_t, uint64_t> snapshot;
};

/// A rule that threw on this rank (Note [rule errors]): the world ranks not
/// yet heard from, and where this rank stood.
struct RuleFailure {
  uint64_t id = 0;
  std::set<int> waiting;
  std::map<uint64_t, uint64_t> snapshot;
  std::string text;
};

/// A call that failed here (locally or carried at entry): the world ranks of
/// its communicator not yet heard from.
struct Failure {
  std::set<int> waiting;
};

struct State {
  int keyval = MPI_KEYVAL_INVALID;
  bool hook_registered = false;
  bool poisoned = false;
  int poison_origin = -1;
  std::string poison_text;
  std::map<std::pair<uint64_t, uint64_t>, Failure> failures;
  // Calls are numbered per set of ranks (the key), not per MPI_Comm handle:
  // two handles over the same ranks (a mesh dim and a one-dim group) share
  // the numbering, which every rank advances in the same order.
  std::map<uint64_t, uint64_t> next_seq;
  // Failures of calls this rank has not entered yet (ranks ahead of it).
  std::multimap<std::pair<uint64_t, uint64_t>, Message> early;
  // Sends in flight, with their buffers (kept until MPI has completed them).
  std::deque<std::pair<MPI_Request, std::vector<char>>> sends;
  // Note [rule errors]: this rank's rules that threw, awaiting verdicts; rule
  // failures of other ranks not yet matched to a call here; the world ranks of
  // every communicator seen, by key; the call entered last.
  uint64_t next_rule_id = 0;
  std::deque<RuleFailure> rule_failures;
  std::deque<Message> rule_early;
  std::map<uint64_t, std::vector<int>> members;
  CallId current;
};

/// Set just before the error channel throws, so that the dispatcher's rule
/// hook does not post an error the channel already carried.
thread_local bool channel_threw = false;

State& state() {
  static State* s = new State();  // leaked: usable from finalize hooks at exit
  return *s;
}

int world_rank_of_me() {
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

CommInfo& info_of(MPI_Comm comm) {
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
  s.members[info->key] = info->world_ranks;
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

void post(MPI_Comm channel, Kind kind, uint64_t key, uint64_t seq, const std::string& text,
          const std::vector<int>& targets, const std::map<uint64_t, uint64_t>* snapshot = nullptr) {
  auto& s = state();
  reap_sends();
  const int me = world_rank_of_me();
  // Header: kind, key, seq, origin, number of snapshot pairs; then the pairs;
  // then the text.
  std::vector<int64_t> head = {kind, static_cast<int64_t>(key), static_cast<int64_t>(seq), me,
                               snapshot != nullptr ? static_cast<int64_t>(snapshot->size()) : 0};
  if (snapshot != nullptr) {
    for (const auto& kv : *snapshot) {
      head.push_back(static_cast<int64_t>(kv.first));
      head.push_back(static_cast<int64_t>(kv.second));
    }
  }
  const size_t head_bytes = head.size() * sizeof(int64_t);
  for (int target : targets) {
    if (target == me) continue;
    std::vector<char> buf(head_bytes + text.size());
    std::memcpy(buf.data(), head.data(), head_bytes);
    std::memcpy(buf.data() + head_bytes, text.data(), text.size());
    s.sends.emplace_back(MPI_REQUEST_NULL, std::move(buf));
    auto& back = s.sends.back();
    MPI_Isend(back.second.data(), static_cast<int>(back.second.size()), MPI_BYTE, target, kTag,
              channel, &back.first);
  }
}

std::vector<int> all_world_ranks() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<int> r(n);
  for (int i = 0; i < n; ++i) r[i] = i;
  return r;
}

/// Calls `handle` on every message waiting on the channel.
void drain(MPI_Comm channel, const std::function<void(const Message&)>& handle) {
  for (;;) {
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kTag, channel, &flag, &status);
    if (!flag) return;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> buf(static_cast<size_t>(bytes));
    MPI_Recv(buf.data(), bytes, MPI_BYTE, status.MPI_SOURCE, kTag, channel, MPI_STATUS_IGNORE);
    int64_t header[5] = {0, 0, 0, -1, 0};
    if (buf.size() >= sizeof(header)) std::memcpy(header, buf.data(), sizeof(header));
    Message m;
    m.kind = header[0];
    m.key = static_cast<uint64_t>(header[1]);
    m.seq = static_cast<uint64_t>(header[2]);
    m.origin = static_cast<int>(header[3]);
    size_t at = sizeof(header);
    for (int64_t i = 0; i < header[4] && at + 2 * sizeof(int64_t) <= buf.size(); ++i) {
      int64_t kv[2];
      std::memcpy(kv, buf.data() + at, sizeof(kv));
      m.snapshot[static_cast<uint64_t>(kv[0])] = static_cast<uint64_t>(kv[1]);
      at += sizeof(kv);
    }
    if (buf.size() > at) m.text.assign(buf.data() + at, buf.size() - at);
    handle(m);
  }
}

/// The world rank whose error a message is about.
int culprit(const Message& m) { return m.kind == kPoison ? static_cast<int>(m.seq) : m.origin; }

void poison(MPI_Comm channel, int origin, const std::string& text, bool tell_everyone) {
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

bool member(uint64_t key, int world_rank) {
  auto it = state().members.find(key);
  if (it == state().members.end()) return false;
  for (int r : it->second) {
    if (r == world_rank) return true;
  }
  return false;
}

uint64_t seq_in(const std::map<uint64_t, uint64_t>& snapshot, uint64_t key) {
  auto it = snapshot.find(key);
  return it == snapshot.end() ? 0 : it->second;
}

/// Whether `mine` (this rank's next call numbers) and `theirs` (those of
/// world rank `other`) agree on every communicator this rank knows that both
/// belong to: neither has entered a call of it that the other has not.
bool same_point(const std::map<uint64_t, uint64_t>& mine,
                const std::map<uint64_t, uint64_t>& theirs, int other) {
  const int me = world_rank_of_me();
  for (const auto& kv : state().members) {
    if (!member(kv.first, me) || !member(kv.first, other)) continue;
    if (seq_in(mine, kv.first) != seq_in(theirs, kv.first)) return false;
  }
  return true;
}

/// True if `m` is handled without poisoning the job: a verdict on one of
/// this rank's own failures, or a failure of a call this rank has not entered
/// yet (kept for then).
bool settle_verdict(const Message& m) {
  auto& s = state();
  if (m.kind == kRuleAlike) {
    for (auto& f : s.rule_failures) {
      if (f.id != m.seq) continue;
      f.waiting.erase(m.origin);
    }
    return true;
  }
  if (m.kind == kRuleFailed) {
    // A rule that threw there too, at the same point: both failed alike.
    for (auto& f : s.rule_failures) {
      if (f.waiting.count(m.origin) != 0 && same_point(f.snapshot, m.snapshot, m.origin)) {
        f.waiting.erase(m.origin);
        return true;
      }
    }
    s.rule_early.push_back(m);  // matched at this rank's next call (enter)
    return true;
  }
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
  }
  return false;
}

[[noreturn]] void throw_poisoned(const char* where) {
  auto& s = state();
  channel_threw = true;
  TORCH_CHECK(false, "shardtensor: ", where, ": communication is inconsistent since world rank ",
              s.poison_origin, " raised an error that other ranks were waiting on: ", s.poison_text,
              " (Note [carried errors]: every shardtensor call now raises; end the job; finalize "
              "exits with code ",
              kCarriedErrorExitCode, ")");
}

/// `entering`: the world ranks of the communicator of the call about to be
/// entered (Note [rule errors]: a rule failure must have the verdicts of those
/// ranks first); null at finalize.
bool unresolved(const std::vector<int>* entering) {
  for (const auto& kv : state().failures) {
    if (!kv.second.waiting.empty()) return true;
  }
  if (entering != nullptr) {
    for (const auto& f : state().rule_failures) {
      for (int r : *entering) {
        if (f.waiting.count(r) != 0) return true;
      }
    }
  }
  return false;
}

/// Waits until every earlier failure of this rank has a verdict from all the
/// other ranks of its communicator, and every rule failure one from the ranks
/// of `entering` (watchdog-bounded); drops the settled ones.
void resolve(MPI_Comm channel, const std::vector<int>* entering = nullptr) {
  auto& s = state();
  const auto start = Clock::now();
  const double limit = shardtensor::timeout();
  while (unresolved(entering)) {
    drain(channel, [&](const Message& m) {
      if (settle_verdict(m)) return;
      poison(channel, culprit(m), m.text, /*tell_everyone=*/m.kind != kPoison);
    });
    if (s.poisoned || !unresolved(entering)) break;
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (limit > 0 && waited > limit) {
      std::fprintf(stderr,
                   "shardtensor watchdog: world rank %d waited %g s (SHARDTENSOR_TIMEOUT = %g s) "
                   "for the other ranks' verdict on an error it raised (Note [carried errors]); "
                   "aborting the job with exit code %d\n",
                   world_rank_of_me(), waited, limit, kWatchdogExitCode);
      shardtensor::abort(kWatchdogExitCode);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(waited < 1e-2 ? 1 : 100));
  }
  for (auto it = s.failures.begin(); it != s.failures.end();) {
    it = it->second.waiting.empty() ? s.failures.erase(it) : std::next(it);
  }
  for (auto it = s.rule_failures.begin(); it != s.rule_failures.end();) {
    it = it->waiting.empty() ? s.rule_failures.erase(it) : std::next(it);
  }
}

/// Note [rule errors]: whether a rule failure of another rank, found while
/// this rank waits in its current call, leaves this rank's call stranded (the
/// origin, or ranks failing alike with it, will never join it).
bool rule_failure_strands(const Message& m) {
  auto& s = state();
  const CallId& c = s.current;
  if (c.comm_key == 0) return false;
  if (member(c.comm_key, m.origin)) return seq_in(m.snapshot, c.comm_key) <= c.seq;
  return same_point(s.next_seq, m.snapshot, m.origin);
}

/// Note [rule errors]: at the entry of a call on `info` (not yet numbered),
/// fails it alike if another rank's rule threw at this point.
void match_rule_failures(MPI_Comm channel, const CommInfo& info) {
  auto& s = state();
  const uint64_t k = seq_in(s.next_seq, info.key);
  std::vector<Message> matched;
  for (auto it = s.rule_early.begin(); it != s.rule_early.end();) {
    bool match = false;
    if (member(info.key, it->origin)) {
      const uint64_t theirs = seq_in(it->snapshot, info.key);
      if (theirs < k) {
        // This rank completed calls the origin never entered.
        poison(channel, it->origin, it->text, /*tell_everyone=*/true);
        s.rule_early.erase(it);
        throw_poisoned("a shardtensor primitive");
      }
      match = theirs == k;
    } else {
      match = same_point(s.next_seq, it->snapshot, it->origin);
    }
    if (match) {
      matched.push_back(std::move(*it));
      it = s.rule_early.erase(it);
    } else {
      ++it;
    }
  }
  if (matched.empty()) return;
  for (const Message& m : matched) {
    post(channel, kRuleAlike, 0, m.seq, "", {m.origin});
  }
  channel_threw = true;
  TORCH_CHECK(false, matched.front().text, " [carried to world rank ", world_rank_of_me(),
              " at its next communication, before it communicated (Note [rule errors])]");
}

void register_hook() {
  auto& s = state();
  if (s.hook_registered) return;
  s.hook_registered = true;
  shardtensor::detail::register_finalize_hook([] {
    const MPI_Comm channel = shardtensor::detail::error_channel();
    if (channel == MPI_COMM_NULL) return;
    resolve(channel);
    auto& st = state();
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

CallId enter(MPI_Comm comm) {
  CallId id;
  const MPI_Comm channel = shardtensor::detail::error_channel();
  if (channel == MPI_COMM_NULL || comm == MPI_COMM_NULL) return id;
  register_hook();
  CommInfo& info = info_of(comm);
  id.comm = comm;
  id.comm_key = info.key;
  auto& s = state();
  // Before this call is numbered, so that failures of it by ranks ahead of
  // this one count as early (they are taken below, not as a poison).
  drain(channel, [&](const Message& m) {
    if (settle_verdict(m)) return;
    poison(channel, culprit(m), m.text, /*tell_everyone=*/m.kind != kPoison);
  });
  if (!s.poisoned) resolve(channel, &info.world_ranks);
  if (s.poisoned) throw_poisoned("a shardtensor primitive");
  match_rule_failures(channel, info);
  id.seq = s.next_seq[info.key]++;
  s.current = id;
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
      for (int r : info.world_ranks) f.waiting.insert(r);
      f.waiting.erase(world_rank_of_me());
      s.failures[{id.comm_key, id.seq}] = std::move(f);
      post(channel, kFailed, id.comm_key, id.seq, it->second.text, info.world_ranks);
    }
    s.failures[{id.comm_key, id.seq}].waiting.erase(it->second.origin);
    it = s.early.erase(it);
  }
  if (carried != nullptr) {
    channel_threw = true;
    TORCH_CHECK(false, first_carried.text, " [raised on world rank ", first_carried.origin,
                " and carried to world rank ", world_rank_of_me(),
                " before it communicated (Note [carried errors])]");
  }
  return id;
}

void fail(const CallId& call, const std::string& message) {
  const MPI_Comm channel = shardtensor::detail::error_channel();
  if (channel != MPI_COMM_NULL && call.comm != MPI_COMM_NULL) {
    CommInfo& info = info_of(call.comm);
    if (std::getenv("SHARDTENSOR_TRACE_CALLS") != nullptr) {
      std::fprintf(stderr, "[carried errors] world rank %d fails call %llu on %llx\n",
                   world_rank_of_me(), static_cast<unsigned long long>(call.seq),
                   static_cast<unsigned long long>(call.comm_key));
    }
    if (info.world_ranks.size() > 1) {
      Failure f;
      for (int r : info.world_ranks) f.waiting.insert(r);
      f.waiting.erase(world_rank_of_me());
      auto& s = state();
      s.failures[{call.comm_key, call.seq}] = std::move(f);
      post(channel, kFailed, call.comm_key, call.seq, message, info.world_ranks);
    }
  }
  channel_threw = true;
  TORCH_CHECK(false, message);
}

void poll(int n, MPI_Request* requests, bool p2p, const char* what) {
  const MPI_Comm channel = shardtensor::detail::error_channel();
  if (channel == MPI_COMM_NULL) return;
  auto& s = state();
  bool abandon = false;
  Message why;
  drain(channel, [&](const Message& m) {
    if (!(m.kind == kRuleFailed && rule_failure_strands(m)) && settle_verdict(m)) return;
    if (!abandon) {
      abandon = true;
      why = m;
    }
    poison(channel, culprit(m), m.text, /*tell_everyone=*/m.kind != kPoison);
  });
  if (!abandon) return;
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
  const char* op = OpLabel::current();
  channel_threw = true;
  TORCH_CHECK(false, "shardtensor: world rank ", world_rank_of_me(), " stopped waiting in ", what,
              " during op '", (*op != '\0' ? op : "<none>"), "' because world rank ",
              s.poison_origin, " raised: ", s.poison_text,
              " (Note [carried errors]: communication is now inconsistent; every shardtensor "
              "call raises from now on; end the job; finalize exits with code ",
              kCarriedErrorExitCode, ")");
}

void op_begins(const char* op) {
  channel_threw = false;
  // The test hook (Note [rule errors]): SHARDTENSOR_INJECT_RULE_FAULT=op@rank[@n]
  // makes the n-th (default first) top-level call of `op` throw on that world
  // rank (* = every rank).
  static const char* inject = std::getenv("SHARDTENSOR_INJECT_RULE_FAULT");
  static int64_t seen = 0;
  if (inject == nullptr) return;
  std::string spec(inject);
  int64_t nth = 1;
  auto at = spec.rfind('@');
  if (at != std::string::npos && spec.find('@') != at) {
    nth = std::atoll(spec.c_str() + at + 1);
    spec.resize(at);
    at = spec.rfind('@');
  }
  if (at == std::string::npos || spec.compare(0, at, op) != 0 || at != std::strlen(op)) return;
  const char* who = spec.c_str() + at + 1;  // a world rank, or * for every rank
  if (std::strcmp(who, "*") != 0 && std::atoi(who) != world_rank_of_me()) return;
  if (++seen != nth) return;
  TORCH_CHECK(false, "SHARDTENSOR_INJECT_RULE_FAULT: injected failure in the rule of op '", op,
              "' on world rank ", world_rank_of_me());
}

void rule_failed(MPI_Comm comm, const char* op, const std::exception& e) {
  if (channel_threw) {  // carried by the channel already
    channel_threw = false;
    return;
  }
  const MPI_Comm channel = shardtensor::detail::error_channel();
  if (channel == MPI_COMM_NULL) return;
  auto& s = state();
  if (s.poisoned) return;
  register_hook();
  const std::vector<int> targets =
      comm != MPI_COMM_NULL ? info_of(comm).world_ranks : all_world_ranks();
  if (targets.size() <= 1) return;
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::ostringstream text;
  text << "shardtensor: op '" << op << "' raised on world rank " << world_rank_of_me() << ": "
       << (c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
  // Messages already here first: ranks that failed alike before this one.
  drain(channel, [&](const Message& m) {
    if (settle_verdict(m)) return;
    poison(channel, culprit(m), m.text, /*tell_everyone=*/m.kind != kPoison);
  });
  if (s.poisoned) return;
  RuleFailure f;
  f.id = s.next_rule_id++;
  f.snapshot = s.next_seq;
  f.text = text.str();
  for (int r : targets) f.waiting.insert(r);
  f.waiting.erase(world_rank_of_me());
  for (auto it = s.rule_early.begin(); it != s.rule_early.end();) {
    if (f.waiting.count(it->origin) != 0 && same_point(f.snapshot, it->snapshot, it->origin)) {
      f.waiting.erase(it->origin);
      it = s.rule_early.erase(it);
    } else {
      ++it;
    }
  }
  post(channel, kRuleFailed, 0, f.id, f.text, targets, &f.snapshot);
  s.rule_failures.push_back(std::move(f));
}

bool poisoned() { return state().poisoned; }

size_t tracked_entries() {
  reap_sends();
  auto& s = state();
  return s.next_seq.size() + s.failures.size() + s.early.size() + s.sends.size() +
         s.rule_failures.size() + s.rule_early.size();
}

}  // namespace comm::errors
}  // namespace shardtensor
