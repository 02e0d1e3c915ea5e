// Scenarios for the watchdog tests (Note [watchdog]): one rank misbehaves while
// the others enter a collective or an exchange; the job must end within the
// timeout with the watchdog's message and exit code, never hang. Run by
// tests/watchdog_check.sh, which asserts the exit code, the message and the time.
#include <mpi.h>
#include <shardtensor/shardtensor.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/agree.h"
#include "comm/blocking.h"
#include "ops/common.h"
#include "ops/registry.h"

namespace st = shardtensor;

namespace {

// A rule that raises on some ranks only (Note [carried rule errors]), for
// aten::_test_check_tensor, a testing op that no rule of the library uses.
// "before": raises before the rule's all-reduce (the others wait in it);
// "after": after it (the others pass the op); "local": a rule that does not
// communicate. g_culprit < 0: every rank raises.
std::string g_rule_mode;
int g_culprit = -1;
const st::DeviceMesh* g_mesh = nullptr;

void maybe_raise() {
  if (g_culprit < 0 || st::world_rank() == g_culprit) {
    TORCH_CHECK(false, "simulated rule failure on world rank ", st::world_rank());
  }
}

// An autograd Function whose backward formula raises (mode "backward"),
// written as the library's own (Note [carried rule errors]): its formula runs
// through carried_backward; after it, an all-gather (the others wait in it).
struct RaisingBackwardFn : torch::autograd::Function<RaisingBackwardFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext*,
                                                const at::Tensor& x) {
    return {x * 2};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return st::ops::carried_backward("RaisingBackwardFn::backward", ctx, std::move(grads),
                                     &backward_formula);
  }
  static torch::autograd::variable_list backward_formula(torch::autograd::AutogradContext*,
                                                         torch::autograd::variable_list grads) {
    maybe_raise();
    // The pieces have 4 rows on every rank: an all-gather over the mesh.
    std::vector<int64_t> sizes(st::world_size(), 4);
    at::Tensor all = st::comm::all_gather(grads[0].detach(), *g_mesh, 0, 0, sizes);
    return {grads[0] * 2 + all.sum() * 0};
  }
};

const st::ops::RuleRegistrar test_rule({"_test_check_tensor"}, [](const c10::OperatorHandle&,
                                                                  st::ops::Stack* stack) {
  at::Tensor x = stack->back().toTensor();
  stack->pop_back();
  if (g_rule_mode == "backward") {
    // As the library's rules do: the Function works on the local piece.
    const st::ShardSpec& spec = *st::ops::spec_of(x);
    at::Tensor local = st::ops::to_layout(x, spec, spec);
    stack->push_back(st::ops::wrap(RaisingBackwardFn::apply(local)[0], st::ops::spec_ptr_of(x)));
    return;
  }
  if (g_rule_mode != "after") maybe_raise();
  at::Tensor r = g_rule_mode == "local" ? x * 2 : x - x.mean();
  if (g_rule_mode == "after") maybe_raise();
  stack->push_back(r);
});

// The next collective after a carried error (`x` as main made it): right
// when every rank failed alike (nothing was started), an error everywhere
// when some ranks had started theirs.
void next_sum(const at::Tensor& x, int rank) {
  try {
    const float s = (x * 2).sum().item<float>();
    torch::manual_seed(0);
    const float want = (torch::randn({4 * st::world_size(), 3}) * 2).sum().item<float>();
    std::printf("rank %d continues: the next sum is %s\n", rank,
                std::abs(s - want) <= 1e-4f * (1 + std::abs(want)) ? "right" : "WRONG");
  } catch (const c10::Error& e) {
    std::printf("rank %d raises at the next op: %s\n", rank, e.what_without_backtrace());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  const std::string scenario = argc > 1 ? argv[1] : "";
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const int rank = st::world_rank();
  const int culprit = st::world_size() - 1;
  torch::manual_seed(0);
  at::Tensor x =
      st::distribute_tensor(torch::randn({4 * st::world_size(), 3}), mesh, {st::Shard{0}});
  // A first collective that every rank makes, so the job is fully up.
  at::Tensor warm = x.sum();
  (void)warm;
  // Every rank leaves the warm-up before any scenario starts: an all-reduce
  // can return on one rank while another still waits in it, and a carried
  // error poisons the job (Note [carried errors]) for a rank still waiting in
  // the warm-up, outside the scenarios' try blocks (one_rank_bad_piece at 3
  // ranks: rank 0 already in the failing all_gather poisons, rank 1 still in
  // the warm-up sum raises there).
  st::comm::barrier(mesh);  // over the transport: also under torchrun (c10d)

  if (scenario == "throw_mid_op") {
    // The culprit raises (as a rule or user callback would) after the others
    // have entered the op's collective; it handles the error and carries on
    // with something else (a REPL, a retry loop) instead of dying.
    if (rank == culprit) {
      try {
        TORCH_CHECK(false, "simulated failure inside an op on rank ", rank);
      } catch (const c10::Error& e) {
        std::fprintf(stderr, "rank %d caught: %s\n", rank, e.what_without_backtrace());
      }
      std::this_thread::sleep_for(std::chrono::seconds(120));
    } else {
      at::Tensor s = (x * 2).sum();  // all-reduce: waits for the culprit
      std::printf("rank %d: unexpected: sum completed %f\n", rank, s.item<float>());
    }
  } else if (scenario == "skip_collective") {
    // The culprit skips the reduction and goes on to finalize.
    if (rank != culprit) {
      at::Tensor s = x.sum();
      std::printf("rank %d: unexpected: sum completed %f\n", rank, s.item<float>());
    }
  } else if (scenario == "rank_exits") {
    // The culprit leaves the job without finalizing, as after a crash handler.
    if (rank == culprit) {
      std::fflush(stdout);
      std::_Exit(0);
    }
    at::Tensor s = x.sum();
    std::printf("rank %d: unexpected: sum completed %f\n", rank, s.item<float>());
  } else if (scenario == "skip_exchange") {
    // Point-to-point: the culprit skips a halo exchange; its neighbours wait for it.
    // At 3 ranks or more, a rank that is no neighbour of the culprit completes
    // its exchange; it then stays away from MPI_Finalize until the job is
    // aborted (Open MPI 4.1's mpirun can crash in PMIx_server_finalize, exit
    // code 139, when a rank finalizes while another calls MPI_Abort).
    if (rank != culprit) {
      at::Tensor h = st::halo_exchange(x, 0, 1, 1);
      std::printf("rank %d: exchange completed (%lld rows; not a neighbour of the culprit)\n", rank,
                  static_cast<long long>(h.size(0)));
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::seconds(120));
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(120));
    }
  } else if (scenario == "backward_one_rank") {
    // A backward that reaches the registered parameters on some ranks only:
    // the gradient buckets' all-reduces wait for the culprit.
    torch::nn::Linear lin(3, 2);
    st::distribute_module(*lin, mesh);
    at::Tensor xin = st::distribute_tensor(torch::randn({4 * st::world_size(), 3}), mesh,
                                           {st::Shard{0}}, /*requires_grad=*/true);
    at::Tensor loss = lin(xin).sum();
    if (rank != culprit) {
      loss.backward();
      std::printf("rank %d: unexpected: backward completed\n", rank);
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(120));
    }
  } else if (scenario == "blocking_collective") {
    // A collective inside another library (as HDF5's MPI-IO runs H5Dwrite),
    // which the transport cannot poll: bounded by a BlockingScope.
    if (rank != culprit) {
      st::comm::watchdog::BlockingScope scope("MPI_Barrier (stand-in for a collective H5Dwrite)",
                                              mesh.comm(0));
      MPI_Barrier(mesh.comm(0));
      std::printf("rank %d: unexpected: barrier completed\n", rank);
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(120));
    }
  } else if (scenario == "rule_backward") {
    // A backward formula raises on the culprit only, before the all-reduce
    // that the others' formulas wait in.
    g_rule_mode = "backward";
    g_culprit = culprit;
    g_mesh = &mesh;
    at::Tensor xg = st::distribute_tensor(torch::randn({4 * st::world_size(), 3}), mesh,
                                          {st::Shard{0}}, /*requires_grad=*/true);
    at::Tensor y = at::_test_check_tensor(xg);
    try {
      y.sum().backward();
      std::printf("rank %d: unexpected: backward completed\n", rank);
    } catch (const c10::Error& e) {
      std::printf("rank %d caught: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
    try {
      const float s = (x * 2).sum().item<float>();
      std::printf("rank %d: unexpected: the next op completed (%f)\n", rank, s);
    } catch (const c10::Error& e) {
      std::printf("rank %d raises at the next op: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
  } else if (scenario.rfind("rule_", 0) == 0) {
    // Note [carried rule errors]: an outermost op's rule raises on the culprit
    // only (or on every rank: rule_alike), before or after the rule's
    // all-reduce, or in a rule that does not communicate after which no rank
    // communicates again (rule_local_last: finalize finds it).
    g_rule_mode = scenario == "rule_after"        ? "after"
                  : scenario == "rule_local_last" ? "local"
                                                  : "before";
    g_culprit = scenario == "rule_alike" ? -1 : culprit;
    try {
      at::Tensor r = at::_test_check_tensor(x);
      std::printf("rank %d: the op completed here (%lld rows)\n", rank,
                  static_cast<long long>(r.size(0)));
    } catch (const c10::Error& e) {
      std::printf("rank %d caught: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
    if (scenario != "rule_local_last") {
      next_sum(x, rank);
    }
  } else if (scenario == "one_rank_bad_piece" || scenario == "every_rank_bad_piece") {
    // Note [carried errors]: a check of the local tensor fails on the culprit
    // only (or on every rank); no SHARDTENSOR_DEBUG. Every rank must raise,
    // naming the primitive and the culprit's error, within the timeout.
    const bool everyone = scenario == "every_rank_bad_piece";
    std::vector<int64_t> sizes(st::world_size(), 4);
    const bool bad = everyone || rank == culprit;
    at::Tensor piece = torch::ones({bad ? 3 : 4, 2});
    try {
      at::Tensor full = st::comm::all_gather(piece, mesh, 0, 0, sizes);
      std::printf("rank %d: unexpected: all_gather completed (%lld rows)\n", rank,
                  static_cast<long long>(full.size(0)));
    } catch (const c10::Error& e) {
      std::printf("rank %d caught: %s\n", rank, e.what_without_backtrace());
    }
    std::fflush(stdout);
    next_sum(x, rank);
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  return 0;
}
