// A MeshGraphNet-style GNN learns one step of a diffusion solver on an
// unstructured 2-D triangle mesh, trained domain-parallel with shardtensor's
// index halos (shardtensor/comm/ghost.h, shardtensor/ops/graph.h).
//
//   mpirun --oversubscribe -np 4 build/examples/gnn_train [flags]   (make demo DEMO=gnn_train)
//
// Mesh. A perturbed s x s grid on the unit square (every interior vertex
// jittered by up to 0.3 h), each cell split into two triangles along a
// randomly chosen diagonal: >= 10^5 vertices by default (--nodes). Vertices
// are numbered along a Morton (Z-order) space-filling curve and split into
// contiguous, balanced row blocks, one per rank, so a rank's vertices form a
// compact patch and only the patch boundary is exchanged. Directed edges (both
// ways along every triangle edge) are sorted by destination and sharded with
// their destination's owner, so the scatter back to the nodes is local and
// only the sources need ghosts.
//
// Task. u_t = Laplacian u discretised on the graph: one explicit step
// u1_i = u0_i + dt * sum_j (u0_j - u0_i) / |x_j - x_i|^2, with dt = 0.05 h^2.
// Input per node: (u0, x, y); per edge: (dx, dy, |d|). Target: (u1 - u0) / (dt/h^2)
// (order one).
//
// Model. Encoder (node MLP, edge MLP) -> processor (--layers message-passing
// layers: e += MLP([e, h_src, h_dst]); h += MLP([h, sum_dst e])) -> decoder
// MLP. Plain libtorch modules; the sharded run feeds them ShardTensors, the
// single-process run plain tensors, through the same code.
//
// At the end of the run: one sharded Adam step in float64 on a small mesh
// (--check-nodes) against a single-process step (loss and every parameter);
// prints MATCH or MISMATCH (exit code 1 on mismatch). Peak memory per rank of
// a training step is reported against the single-process peak / P.
#include <mpi.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include "models/check.h"
#include "models/graphnet.h"

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace st = shardtensor;

namespace {

struct Config {
  int64_t nodes = 100000;
  int64_t check_nodes = 1200;
  int64_t steps = 6;
  int64_t hidden = 16;
  int64_t layers = 3;
  double lr = 2e-3;
  bool single = true;  // measure the single-process step for the memory comparison
};

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--nodes")
      c.nodes = std::stoll(next());
    else if (a == "--check-nodes")
      c.check_nodes = std::stoll(next());
    else if (a == "--steps")
      c.steps = std::stoll(next());
    else if (a == "--hidden")
      c.hidden = std::stoll(next());
    else if (a == "--layers")
      c.layers = std::stoll(next());
    else if (a == "--lr")
      c.lr = std::stod(next());
    else if (a == "--no-single")
      c.single = false;
    else if (a == "--help" || a == "-h") {
      std::printf(
          "gnn_train [--nodes N] [--check-nodes N] [--steps S] [--hidden H] [--layers L] "
          "[--lr LR] [--no-single]\n");
      std::exit(0);
    } else {
      throw std::runtime_error("unknown flag " + a);
    }
  }
  return c;
}

using namespace models;

at::Tensor loss_of(GraphNet& net, const Graph& g) {
  return (net->forward(g) - g.target).pow(2).mean();
}

using check::max_over_ranks;

/// One sharded Adam step in float64 against a single-process step.
bool verify_small(const Config& c, const st::DeviceMesh& mesh, bool root) {
  Mesh m = make_mesh(c.check_nodes, 77);
  Graph sharded = shard_graph(m, mesh, at::kDouble), whole = whole_graph(m, at::kDouble);
  torch::manual_seed(5);
  GraphNet ref(c.hidden, c.layers);
  ref->to(at::kDouble);
  torch::manual_seed(5);
  GraphNet net(c.hidden, c.layers);
  net->to(at::kDouble);
  st::distribute_module(*net, mesh);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(c.lr));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(c.lr));
  auto ref_loss = loss_of(ref, whole);
  ref_loss.backward();
  ref_opt.step();
  auto loss = loss_of(net, sharded);
  loss.backward();
  opt.step();
  // float64: summation-order noise ~1e-16 relative; Adam's first step is
  // lr * sign-like, so a wrong ghost or a missing gradient sum is far above
  // these tolerances.
  const double rtol = 1e-8, atol = 1e-10;
  const check::StepError err = check::compare_step(*net, *ref, loss, ref_loss, rtol, atol);
  const double worst = err.worst;
  const std::string& worst_name = err.where;
  const bool ok = err.ok();
  if (root) {
    std::printf(
        "check: one sharded Adam step on a %lld-node mesh (float64, %lld ranks) vs single-process: "
        "loss %.12f vs %.12f; worst |diff|/(atol+rtol|ref|) = %.3g (%s) -> %s\n",
        static_cast<long long>(m.n), static_cast<long long>(mesh.size()), loss.item<double>(),
        ref_loss.item<double>(), worst, worst_name.c_str(), ok ? "MATCH" : "MISMATCH");
  }
  return ok;
}

int run(int argc, char** argv) {
  Config c = parse(argc, argv);
  const int P = st::world_size();
  const bool root = st::world_rank() == 0;
  auto mesh = st::DeviceMesh::create({-1}, {"nodes"});
  at::set_num_threads(1);

  Mesh m = make_mesh(c.nodes, 1234);
  if (root) {
    std::printf(
        "gnn_train: %lld ranks, mesh of %lld vertices and %lld directed edges (Morton "
        "order), hidden %lld, %lld message-passing layers, %lld steps\n",
        static_cast<long long>(P), static_cast<long long>(m.n),
        static_cast<long long>(m.edges.size(0)), static_cast<long long>(c.hidden),
        static_cast<long long>(c.layers), static_cast<long long>(c.steps));
  }
  Graph g = shard_graph(m, mesh, at::kFloat);
  {
    std::vector<int64_t> ghosts = {g.plan->num_ghost(), g.plan->num_owned()};
    MPI_Allreduce(MPI_IN_PLACE, ghosts.data(), 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    if (root)
      std::printf("partition: %lld ghost rows in all (%.2f%% of the owned rows)\n",
                  static_cast<long long>(ghosts[0]),
                  100.0 * ghosts[0] / std::max<int64_t>(1, ghosts[1]));
  }
  torch::manual_seed(1);
  GraphNet net(c.hidden, c.layers);
  st::distribute_module(*net, mesh);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(c.lr));
  double peak_mb = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const int64_t base = st::memory_stats().current_bytes;
    st::reset_peak_memory_stats();
    st::reset_comm_stats();
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto loss = loss_of(net, g);
    loss.backward();
    opt.step();
    const double secs = max_over_ranks(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    peak_mb = std::max(peak_mb, max_over_ranks((st::memory_stats().peak_bytes - base) / 1e6));
    const double sent_mb = max_over_ranks(st::comm_stats().bytes_sent / 1e6);
    if (root)
      std::printf("step %2lld  loss %.6f  %.2f s  max sent/rank %.2f MB\n",
                  static_cast<long long>(step), loss.item<float>(), secs, sent_mb);
  }
  if (c.single) {
    double single_mb = 0;
    if (root) {
      Graph whole = whole_graph(m, at::kFloat);
      torch::manual_seed(1);
      GraphNet ref(c.hidden, c.layers);
      const int64_t base = st::memory_stats().current_bytes;
      st::reset_peak_memory_stats();
      auto loss = loss_of(ref, whole);
      loss.backward();
      single_mb = (st::memory_stats().peak_bytes - base) / 1e6;
    }
    MPI_Bcast(&single_mb, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (root)
      std::printf(
          "memory: peak per rank of a training step %.1f MB; single-process %.1f MB, / P = "
          "%.1f MB (ratio %.2f)\n",
          peak_mb, single_mb, single_mb / P, peak_mb / (single_mb / P));
  }
  const bool ok = verify_small(c, mesh, root);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gnn_train: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
