#include <c10/util/Exception.h>
#include <shardtensor/core/policy.h>
#include <shardtensor/core/stats.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "core/settings.h"

namespace shardtensor {
namespace {

struct Warned {
  std::mutex mu;
  std::set<std::string> ops;
};

Warned& warned() {
  static Warned* w = new Warned();  // leaked: usable during static destruction
  return *w;
}

}  // namespace

// Strict mode lives in the registry of settings that change communication
// (Note [agreed settings], core/settings.h).
void set_strict(bool on) { detail::store_setting(Setting::Strict, on ? 1 : 0); }

bool strict() { return detail::setting_value(Setting::Strict) != 0; }

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
