// Settings agreed at init (Note [agreed settings], src/core/settings.h),
// without SHARDTENSOR_DEBUG: `settings_init VAR VALUE` sets the environment
// variable VAR to VALUE on the last rank only, before init (as a launcher that
// passes an environment to some hosts only would). Every rank's init() must
// throw the same c10::Error naming VAR and every rank's value; nothing may
// hang. `settings_init VAR VALUE all` sets it on every rank: init() must
// succeed, count nothing in CommStats, and a sum must still be right; it
// also prints the mean time of the agreement (repeated 200 times).
// Prints "settings_init rank <r>: PASS" per rank; exit code 0 iff it passed.
#include <c10/util/Exception.h>
#include <shardtensor/shardtensor.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/settings.h"

namespace st = shardtensor;

namespace {

int env_int(const char* a, const char* b) {
  const char* v = std::getenv(a);
  if (v == nullptr) v = std::getenv(b);
  return v == nullptr ? -1 : std::atoi(v);
}

// How the message spells a value of VAR (see detail::setting_value_str).
std::string spelled(const std::string& var, const char* value) {
  const bool default_off = var == "SHARDTENSOR_STRICT" || var == "SHARDTENSOR_HALO_NEIGHBOR";
  const bool set = value != nullptr;
  if (default_off) return set && value[0] != '\0' && std::string(value) != "0" ? "on" : "off";
  return set && std::string(value) == "0" ? "off (\"0\")" : "on";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: settings_init VAR VALUE [all]\n");
    return 2;
  }
  const std::string var = argv[1];
  const char* value = argv[2];
  const bool all = argc > 3 && std::string(argv[3]) == "all";
  // The launcher's rank, before init (mpirun or torchrun).
  const int rank = env_int("OMPI_COMM_WORLD_RANK", "RANK");
  const int size = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE");
  if (rank < 0 || size < 2) {
    std::fprintf(stderr, "settings_init: run under mpirun or torchrun with 2 or more ranks\n");
    return 2;
  }
  const bool odd = rank == size - 1;
  if (all || odd) setenv(var.c_str(), value, 1);
  std::vector<std::string> fails;
  try {
    st::init(&argc, &argv);
    if (!all) {
      fails.push_back("init() did not throw although world rank " + std::to_string(size - 1) +
                      " set " + var + "=" + value);
    } else {
      const auto stats = st::comm_stats();
      if (stats.messages != 0 || stats.bytes_sent != 0) {
        fails.push_back("init counted " + std::to_string(stats.messages) + " messages");
      }
      // The cost of the agreement itself (what init() adds): repeated here.
      constexpr int kReps = 200;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kReps; ++i) st::detail::agree_settings_at_init();
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      std::printf("settings_init rank %d: agreement at init: %.1f us (mean of %d)\n", rank,
                  us / kReps, kReps);
      if (st::comm_stats().messages != 0) fails.push_back("the agreement was counted");
      auto mesh = st::DeviceMesh::create({size});
      auto x = st::distribute_tensor(torch::arange(4.0 * size), mesh, {st::Shard{0}});
      const double got = x.sum().item<double>();
      const double want = torch::arange(4.0 * size).sum().item<double>();
      if (got != want)
        fails.push_back("sum " + std::to_string(got) + " != " + std::to_string(want));
    }
    st::finalize();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (all) {
      fails.push_back(std::string("init threw although every rank agrees: ") + msg);
    } else {
      std::vector<std::string> want = {"shardtensor::init: ranks disagree on the setting " + var,
                                       "which decides the collectives"};
      for (int r = 0; r < size; ++r) {
        const char* v = r == size - 1 ? value : nullptr;
        want.push_back("world rank " + std::to_string(r) + ": " + spelled(var, v) +
                       (r + 1 < size ? "," : ";"));
      }
      for (const auto& w : want) {
        if (msg.find(w) == std::string::npos) fails.push_back("message lacks '" + w + "': " + msg);
      }
      if (fails.empty()) std::printf("settings_init rank %d: caught: %s\n", rank, msg.c_str());
    }
  }
  for (const auto& f : fails) std::printf("settings_init rank %d: FAIL: %s\n", rank, f.c_str());
  if (fails.empty()) std::printf("settings_init rank %d: PASS\n", rank);
  std::fflush(stdout);
  return fails.empty() ? 0 : 1;
}
