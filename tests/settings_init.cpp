// Settings agreed at init (Note [agreed settings], src/core/settings.h),
// without SHARDTENSOR_DEBUG: `settings_init VAR VALUE` sets the environment
// variable VAR to VALUE on the last rank only, before init (as a launcher that
// passes an environment to some hosts only would). Every rank's init() must
// throw the same c10::Error naming VAR and every rank's value; nothing may
// hang. `settings_init VAR VALUE all` sets it on every rank: init() must
// succeed, count nothing in CommStats, and a sum must still be right; it
// also prints the mean time of the agreement (repeated 200 times).
// `settings_init VAR VALUE after` (4 ranks, SHARDTENSOR_DEBUG=1; only
// SHARDTENSOR_HALO_NEIGHBOR so far): every rank inits alike, then the last
// rank sets VAR after init (a setenv in rank-dependent code, which the init
// check cannot see). A halo exchange along each mesh dim of the 2x2 mesh must
// throw on every rank, naming the setting and every mesh rank's value (the
// per-use check of Note [agreed settings], over the whole mesh); no result may
// come back and nothing may hang.
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

// The `after` case (see the header).
void changed_after_init(const std::string& var, const char* value, int rank, int size,
                        std::vector<std::string>& fails) {
  if (size != 4) {
    fails.push_back("the `after` case runs on 4 ranks (a 2x2 mesh)");
    return;
  }
  auto mesh = st::DeviceMesh::create({2, 2});
  const at::Tensor full = torch::arange(64.0).reshape({8, 8});
  // Tensor dim d sharded over mesh dim d: each halo exchange runs on the two
  // lines of ranks along one mesh dim.
  at::Tensor x = st::distribute_tensor(full, mesh, {st::Shard{0}, st::Shard{1}});
  const bool odd = rank == size - 1;
  if (odd) setenv(var.c_str(), value, 1);
  for (int64_t d : {0, 1}) {
    try {
      at::Tensor h = st::halo_exchange(x, d, 1, 1);
      fails.push_back("halo_exchange along dim " + std::to_string(d) + " returned " +
                      std::to_string(h.size(d)) + " rows although world rank " +
                      std::to_string(size - 1) + " set " + var + "=" + value + " after init");
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      std::vector<std::string> want = {"SHARDTENSOR_DEBUG: ranks disagree on the setting " + var,
                                       "which decides the collectives"};
      for (int r = 0; r < size; ++r) want.push_back("mesh rank " + std::to_string(r) + ": ");
      for (const auto& w : want) {
        if (msg.find(w) == std::string::npos) fails.push_back("message lacks '" + w + "': " + msg);
      }
      int on = 0, off = 0;
      for (size_t at = msg.find(": on"); at != std::string::npos; at = msg.find(": on", at + 1)) {
        ++on;
      }
      for (size_t at = msg.find(": off"); at != std::string::npos; at = msg.find(": off", at + 1)) {
        ++off;
      }
      if (on != 1 || off != size - 1) {
        fails.push_back("message names " + std::to_string(on) + " 'on' and " + std::to_string(off) +
                        " 'off' values: " + msg);
      }
      if (fails.empty()) {
        std::printf("settings_init rank %d: caught (dim %lld): %s\n", rank,
                    static_cast<long long>(d), msg.c_str());
      }
    }
  }
  if (odd) unsetenv(var.c_str());
}

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
  const bool after = argc > 3 && std::string(argv[3]) == "after";
  // The launcher's rank, before init (mpirun or torchrun).
  const int rank = env_int("OMPI_COMM_WORLD_RANK", "RANK");
  const int size = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE");
  if (rank < 0 || size < 2) {
    std::fprintf(stderr, "settings_init: run under mpirun or torchrun with 2 or more ranks\n");
    return 2;
  }
  const bool odd = rank == size - 1;
  if (all || (odd && !after)) setenv(var.c_str(), value, 1);
  std::vector<std::string> fails;
  try {
    st::init(&argc, &argv);
    if (after) {
      changed_after_init(var, value, rank, size, fails);
    } else if (!all) {
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
    if (all || after) {
      fails.push_back(
          std::string(after ? "an unexpected error: " : "init threw although every rank agrees: ") +
          msg);
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
