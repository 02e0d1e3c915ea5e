#include <c10/util/Exception.h>
#include <shardtensor/core/policy.h>
#include <shardtensor/core/stats.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace shardtensor {
namespace {

// -1: not set (use the environment), 0: off, 1: on.
std::atomic<int> g_strict{-1};

bool strict_from_env() {
  static const bool on = [] {
    const char* e = std::getenv("SHARDTENSOR_STRICT");
    return e != nullptr && std::string(e) != "0" && std::string(e) != "";
  }();
  return on;
}

struct Warned {
  std::mutex mu;
  std::set<std::string> ops;
};

Warned& warned() {
  static Warned* w = new Warned();  // leaked: usable during static destruction
  return *w;
}

}  // namespace

void set_strict(bool on) { g_strict.store(on ? 1 : 0, std::memory_order_relaxed); }

bool strict() {
  const int s = g_strict.load(std::memory_order_relaxed);
  return s < 0 ? strict_from_env() : s == 1;
}

namespace detail {

void record_gather(const std::string& op, int64_t bytes, bool announce, const std::string& how) {
  record_gathered(bytes);
  if (bytes == 0) return;  // nothing moved (e.g. P = 1): no news for the user
  auto& w = warned();
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    first = w.ops.insert(op).second;
  }
  if (first && announce) {
    TORCH_WARN("shardtensor: ", op, " gathered ", bytes, " bytes per rank (", how,
               "); warned once per op; SHARDTENSOR_STRICT=1 refuses it");
  }
}

void reset_gather_warnings() {
  auto& w = warned();
  std::lock_guard<std::mutex> lock(w.mu);
  w.ops.clear();
}

}  // namespace detail
}  // namespace shardtensor
