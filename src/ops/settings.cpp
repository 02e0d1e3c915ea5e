// Settings that change communication and their check (Note [agreed settings],
// ops/settings.h).
#include "ops/settings.h"

#include <c10/util/Exception.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/ops/attention.h>
#include <shardtensor/ops/fft.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "comm/agree.h"
#include "comm/diagnostic.h"
#include "core/debug.h"
#include "core/fingerprint.h"

namespace shardtensor::ops {
namespace {

const char* env_name(Setting s) {
  switch (s) {
    case Setting::ConvOverlap:
      return "SHARDTENSOR_CONV_OVERLAP";
    case Setting::PoolSplit:
      return "SHARDTENSOR_POOL_SPLIT";
    case Setting::TconvSplit:
      return "SHARDTENSOR_TCONV_SPLIT";
    case Setting::InterpSplit:
      return "SHARDTENSOR_INTERP_SPLIT";
    case Setting::FsdpPrefetch:
      return "SHARDTENSOR_FSDP_PREFETCH";
    default:
      return nullptr;
  }
}

std::string value_str(Setting s, int64_t v) {
  switch (s) {
    case Setting::FftLayout:
      return v == static_cast<int64_t>(FftLayout::Input) ? "FftLayout::Input"
                                                         : "FftLayout::Spectral";
    case Setting::CausalBalance:
      return v == static_cast<int64_t>(CausalBalance::ZigZag) ? "CausalBalance::ZigZag"
                                                              : "CausalBalance::Contiguous";
    default:
      return v != 0 ? "on" : "off (\"0\")";
  }
}

}  // namespace

const char* setting_name(Setting s) {
  switch (s) {
    case Setting::FftLayout:
      return "set_fft_layout";
    case Setting::CausalBalance:
      return "set_causal_balance";
    default:
      return env_name(s);
  }
}

int64_t setting_value(Setting s) {
  switch (s) {
    case Setting::FftLayout:
      return static_cast<int64_t>(fft_layout());
    case Setting::CausalBalance:
      return static_cast<int64_t>(causal_balance());
    default: {
      const char* e = std::getenv(env_name(s));
      return (e && std::strcmp(e, "0") == 0) ? 0 : 1;
    }
  }
}

int64_t use_setting(const DeviceMesh& mesh, Setting s) {
  const int64_t v = setting_value(s);
  if (!detail::debug_enabled() || mesh.size() == 1) return v;
  detail::Fingerprint fp;
  fp.add(static_cast<int64_t>(s)).add(v);
  if (comm::diagnostic_agree(mesh, fp.value()).same) return v;
  // Every rank saw the disagreement: all take this branch together.
  const auto all = comm::all_gather_records(mesh, {v});
  std::ostringstream os;
  os << "SHARDTENSOR_DEBUG: ranks disagree on the setting " << setting_name(s);
  const char* op = OpLabel::current();
  if (op != nullptr && op[0] != '\0') os << " (" << op << ")";
  os << ", which decides the collectives: ";
  for (size_t r = 0; r < all.size(); ++r) {
    os << (r ? ", " : "") << "mesh rank " << r << ": "
       << (all[r].empty() ? std::string("?") : value_str(s, all[r][0]));
  }
  os << "; set the same value on every rank";
  TORCH_CHECK(false, os.str());
  return v;  // unreachable
}

}  // namespace shardtensor::ops
