// Scenarios for Note [rule errors] (comm/error_channel.h): a rule throws on
// one rank only (injected with SHARDTENSOR_INJECT_RULE_FAULT=op@rank, set by
// tests/reliability.cmake), outside any comm/ primitive. Every rank must raise
// an error naming the op and the failing rank, within seconds, and nothing
// hangs. Run by tests/carried_check.sh, which asserts the exit code, one
// matching line per rank and the time.
#include <mpi.h>
#include <shardtensor/shardtensor.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace st = shardtensor;

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  const std::string scenario = argc > 1 ? argv[1] : "";
  const int rank = st::world_rank();
  const int size = st::world_size();
  const char* mesh_env = std::getenv("SHARDTENSOR_TEST_MESH");
  const bool mesh2x2 = mesh_env != nullptr && std::strcmp(mesh_env, "2x2") == 0 && size == 4;
  auto mesh = mesh2x2 ? st::DeviceMesh::create({2, 2}, {"a", "b"})
                      : st::DeviceMesh::create({-1}, {"domain"});
  // Uneven rows at 3 ranks.
  const int64_t rows = 3 * size - 2;
  torch::manual_seed(0);
  const at::Tensor full = torch::randn({rows, 5});
  st::Placements placements = {st::Shard{0}};
  if (mesh2x2) placements = {st::Shard{0}, st::Shard{1}};
  at::Tensor x = st::distribute_tensor(full, mesh, placements);
  const float want = (full * 2).sum().item<float>();
  at::Tensor warm = x.sum();  // the job is up
  (void)warm;
  MPI_Barrier(MPI_COMM_WORLD);

  auto next_sum = [&] {
    // The following op: right when the error was carried without stranding
    // anyone; an error everywhere when the job was poisoned.
    try {
      const float s = (x * 2).sum().item<float>();
      std::printf("rank %d continues: the next sum is %s\n", rank,
                  std::abs(s - want) <= 1e-4f * (1 + std::abs(want)) ? "right" : "WRONG");
    } catch (const c10::Error& e) {
      std::printf("rank %d raises at the next op: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
  };

  const auto start = std::chrono::steady_clock::now();
  if (scenario == "before_comm" || scenario == "local_op" || scenario == "every_rank") {
    // before_comm: aten::sum's rule throws on the culprit before its all-reduce;
    // local_op: aten::mul (no communication) throws on the culprit only, the
    // others raise at the sum that follows; every_rank: every rank's sum throws.
    // The others start their sum after the culprit's rule has thrown (a rank
    // already waiting in the all-reduce would be stranded: mid_comm).
    const char* inject = std::getenv("SHARDTENSOR_INJECT_RULE_FAULT");
    const int culprit = scenario == "every_rank" || inject == nullptr
                            ? -1
                            : std::atoi(std::strchr(inject, '@') + 1);
    try {
      at::Tensor y = x * 2;
      if (culprit >= 0 && rank != culprit) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      }
      const float s = y.sum().item<float>();
      std::printf("rank %d: unexpected: sum completed %f\n", rank, s);
    } catch (const c10::Error& e) {
      std::printf("rank %d caught: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
    next_sum();
  } else if (scenario == "mid_comm") {
    // The others are already waiting in the sum's all-reduce when the
    // culprit's rule throws: they stop waiting and the job is poisoned.
    const char* inject = std::getenv("SHARDTENSOR_INJECT_RULE_FAULT");
    const int culprit = inject != nullptr ? std::atoi(std::strchr(inject, '@') + 1) : -1;
    at::Tensor y = x * 2;
    if (rank == culprit) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    try {
      const float s = y.sum().item<float>();
      std::printf("rank %d: unexpected: sum completed %f\n", rank, s);
    } catch (const c10::Error& e) {
      std::printf("rank %d caught: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
    next_sum();
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("rank %d took %.2f s\n", rank, took);
  return 0;
}
