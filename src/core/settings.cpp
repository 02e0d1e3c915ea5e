// The registry of settings that change communication and their agreement at
// init (Note [agreed settings], core/settings.h).
#include "core/settings.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core/process_groups.h"

#if SHARDTENSOR_WITH_MPI
#include <mpi.h>

#include <shardtensor/core/error.h>
#endif

namespace shardtensor::detail {
namespace {

// The settings held in the process. FftLayout: Spectral = 0, Input = 1;
// CausalBalance: Contiguous = 0, ZigZag = 1 (static_asserts in ops/fft.cpp
// and ops/attention.cpp); Strict: -1 = not set (use the environment).
std::atomic<int64_t> g_fft_layout{0};
std::atomic<int64_t> g_causal_balance{1};
std::atomic<int64_t> g_strict{-1};

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
    case Setting::Strict:
      return "SHARDTENSOR_STRICT";
    case Setting::HaloNeighbor:
      return "SHARDTENSOR_HALO_NEIGHBOR";
    default:
      return nullptr;
  }
}

// Switches that are on unless set to exactly "0".
int64_t default_on(const char* name) {
  const char* e = std::getenv(name);
  return (e && std::strcmp(e, "0") == 0) ? 0 : 1;
}

// Switches that are off unless set to something but "" or "0".
int64_t default_off(const char* name) {
  const char* e = std::getenv(name);
  return (e != nullptr && e[0] != '\0' && std::strcmp(e, "0") != 0) ? 1 : 0;
}

int64_t strict_from_env() {
  static const int64_t on = default_off("SHARDTENSOR_STRICT");  // read once, as always
  return on;
}

std::atomic<int64_t>* held(Setting s) {
  switch (s) {
    case Setting::FftLayout:
      return &g_fft_layout;
    case Setting::CausalBalance:
      return &g_causal_balance;
    case Setting::Strict:
      return &g_strict;
    default:
      return nullptr;
  }
}

// Every rank's snapshot of every setting, in world-rank order. Uncounted.
std::vector<std::vector<int64_t>> gather_snapshots(const std::vector<int64_t>& mine) {
  const size_t n = mine.size();
  if (pg::active()) {
    const Comm world = pg::world();
    const int size = pg::size(world);
    const int rank = pg::rank(world);
    std::vector<std::vector<int64_t>> all(size, mine);
    if (size == 1) return all;
    // One key per rank and init: inits are collective, so the counter is the
    // same on every rank and a later init never reads an earlier one's keys.
    static int64_t generation = 0;
    const std::string prefix = "settings/" + std::to_string(generation++) + "/";
    ::c10d::Store* store = pg::store();
    TORCH_INTERNAL_ASSERT(store != nullptr, "shardtensor::init: the c10d world has no store");
    const auto* bytes = reinterpret_cast<const uint8_t*>(mine.data());
    store->set(prefix + std::to_string(rank),
               std::vector<uint8_t>(bytes, bytes + n * sizeof(int64_t)));
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const std::vector<uint8_t> raw = store->get(prefix + std::to_string(r));  // waits
      TORCH_INTERNAL_ASSERT(raw.size() == n * sizeof(int64_t));
      std::memcpy(all[r].data(), raw.data(), raw.size());
    }
    return all;
  }
#if SHARDTENSOR_WITH_MPI
  int size = 1;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  std::vector<int64_t> flat(n * static_cast<size_t>(size));
  SHARDTENSOR_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(n), MPI_INT64_T, flat.data(),
                                      static_cast<int>(n), MPI_INT64_T, MPI_COMM_WORLD));
  std::vector<std::vector<int64_t>> all(size);
  for (int r = 0; r < size; ++r) {
    all[r].assign(flat.begin() + r * n, flat.begin() + (r + 1) * n);
  }
  return all;
#else
  return {mine};
#endif
}

}  // namespace

const char* setting_name(Setting s) {
  switch (s) {
    case Setting::FftLayout:
      return "set_fft_layout";
    case Setting::CausalBalance:
      return "set_causal_balance";
    case Setting::Strict:
      return "SHARDTENSOR_STRICT / set_strict";
    default:
      return env_name(s);
  }
}

int64_t setting_value(Setting s) {
  switch (s) {
    case Setting::FftLayout:
    case Setting::CausalBalance:
      return held(s)->load(std::memory_order_relaxed);
    case Setting::Strict: {
      const int64_t v = g_strict.load(std::memory_order_relaxed);
      return v < 0 ? strict_from_env() : v;
    }
    case Setting::HaloNeighbor:
      return default_off(env_name(s));
    default:
      return default_on(env_name(s));
  }
}

std::string setting_value_str(Setting s, int64_t v) {
  switch (s) {
    case Setting::FftLayout:
      return v == 1 ? "FftLayout::Input" : "FftLayout::Spectral";
    case Setting::CausalBalance:
      return v == 1 ? "CausalBalance::ZigZag" : "CausalBalance::Contiguous";
    case Setting::Strict:
    case Setting::HaloNeighbor:
      return v != 0 ? "on" : "off";
    default:
      return v != 0 ? "on" : "off (\"0\")";
  }
}

int64_t store_setting(Setting s, int64_t v) {
  std::atomic<int64_t>* h = held(s);
  TORCH_INTERNAL_ASSERT(h != nullptr, "store_setting: ", setting_name(s),
                        " is an environment variable");
  return h->exchange(v, std::memory_order_relaxed);
}

void agree_settings_at_init() {
  std::vector<int64_t> mine(kSettingCount);
  for (int i = 0; i < kSettingCount; ++i) mine[i] = setting_value(static_cast<Setting>(i));
  const auto all = gather_snapshots(mine);
  std::ostringstream os;
  for (int i = 0; i < kSettingCount; ++i) {
    bool same = true;
    for (const auto& r : all) same = same && r[i] == all[0][i];
    if (same) continue;
    const auto s = static_cast<Setting>(i);
    os << (os.tellp() > 0 ? "\n" : "") << "shardtensor::init: ranks disagree on the setting "
       << setting_name(s) << ", which decides the collectives: ";
    for (size_t r = 0; r < all.size(); ++r) {
      os << (r ? ", " : "") << "world rank " << r << ": " << setting_value_str(s, all[r][i]);
    }
    os << "; set the same value on every rank (Note [agreed settings])";
  }
  TORCH_CHECK(os.tellp() == 0, os.str());
}

}  // namespace shardtensor::detail
