// shardtensor_bench_rebalance: per-rank time of a neighbour-search +
// message-passing step on a point cloud of strongly non-uniform density,
// before and after rebalance() by measured seconds (docs/irregular.md).
//
//   mpirun -np P shardtensor_bench_rebalance [--points 10000] [--dense 0.7]
//       [--radius 0.08] [--max-neighbors 64] [--features 64] [--hidden 256]
//       [--rounds 3] [--repeats 3] [--out F.json]
//
// The cloud: a `dense` fraction of the points uniform in x in [0, 0.15], the
// rest uniform in [0.15, 1] (y, z uniform in [0, 1]), sorted along x and
// split into balanced row blocks, so the low ranks hold the dense region.
// One step: radius_search(points, points, r, max_neighbors), then a mean of
// the found neighbours' features through a GhostPlan (ghost_plan,
// extend_rows, gather_rows, index_add_) after an MLP on every edge, so a
// point's cost grows with the neighbours it finds (many in the dense region).
// Each rank's compute time is its wall time minus the growth of
// comm_stats().comm_seconds (waiting for a slower rank is not its cost);
// the step's time is the slowest rank's wall time. Round 0 measures the
// balanced-by-rows partition; each later round first calls
// rebalance({points, features}, measured compute seconds). Prints and
// appends one record per round: per-rank compute seconds, max/mean, the
// step's wall time, the rows per rank, and the load average.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <mpi.h>
#include <shardtensor/shardtensor.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "results.h"
#include "tool.h"

namespace st = shardtensor;

namespace {

std::vector<double> all_gather(double v) {
  int p = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  std::vector<double> out(static_cast<size_t>(p));
  MPI_Allgather(&v, 1, MPI_DOUBLE, out.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
  return out;
}

double max_over_mean(const std::vector<double>& v) {
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return mean > 0 ? *std::max_element(v.begin(), v.end()) / mean : 1.0;
}

struct Timing {
  double compute = 0;  // this rank: wall - MPI
  double wall = 0;     // this rank's wall time
};

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  int64_t n = 10000, max_neighbors = 64, features = 64, hidden = 256;
  double dense = 0.7, radius = 0.08;
  int rounds = 3, repeats = 3;
  std::string out;
  CLI::App app{
      "shardtensor_bench_rebalance: a radius-search + message-passing step on a "
      "non-uniform cloud, before and after rebalance by measured seconds",
      "shardtensor_bench_rebalance"};
  app.add_option("--points", n, "points in the cloud")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dense", dense, "fraction of the points in x < 0.15")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--radius", radius, "search radius")->capture_default_str();
  app.add_option("--max-neighbors", max_neighbors)->capture_default_str();
  app.add_option("--features", features, "node feature width")->capture_default_str();
  app.add_option("--hidden", hidden, "hidden width of the edge MLP")->capture_default_str();
  app.add_option("--rounds", rounds, "measure-and-rebalance rounds after round 0")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--repeats", repeats, "timed steps per round (the median is kept)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--out", out, "append the records to this JSON array file");
  if (auto rc = bench::parse_command_line(app, argc, argv, "shardtensor_bench_rebalance"))
    return *rc;
  at::set_num_threads(1);
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const int P = static_cast<int>(mesh.size());
  const bool root = mesh.rank() == 0;

  // The same cloud on every rank (one generator seed), sorted along x.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t nd = static_cast<int64_t>(static_cast<double>(n) * dense);
  at::Tensor p = at::rand({n, 3}, gen, at::kFloat);
  p.narrow(0, 0, nd).select(1, 0).mul_(0.15);
  p.narrow(0, nd, n - nd).select(1, 0).mul_(0.85).add_(0.15);
  p = p.index_select(0, std::get<1>(p.select(1, 0).sort()));
  at::Tensor feat = at::randn({n, features}, gen, at::kFloat);
  at::Tensor w1 = at::randn({features, hidden}, gen, at::kFloat) / std::sqrt(double(features));
  at::Tensor w2 = at::randn({hidden, features}, gen, at::kFloat) / std::sqrt(double(hidden));
  at::Tensor pts = st::distribute_tensor(p, mesh, {st::Shard{0}});
  at::Tensor f = st::distribute_tensor(feat, mesh, {st::Shard{0}});

  auto step = [&](const at::Tensor& q, const at::Tensor& x) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    const double comm0 = st::comm_stats().comm_seconds;
    at::NoGradGuard no_grad;
    auto res = st::radius_search(q, q, radius, max_neighbors);
    at::Tensor nbr = st::ShardTensor(res.first).local();
    at::Tensor valid = nbr.ge(0);
    at::Tensor ids = nbr.masked_select(valid);
    auto plan = st::ghost_plan(x, ids);
    at::Tensor rows = st::gather_rows(st::extend_rows(x, plan), plan.local_index(ids));
    at::Tensor dst =
        at::arange(nbr.size(0), at::kLong).unsqueeze(1).expand_as(nbr).masked_select(valid);
    at::Tensor msg = at::relu(rows.matmul(w1)).matmul(w2);
    at::Tensor agg = at::zeros({nbr.size(0), msg.size(1)}, msg.options())
                         .index_add_(0, dst, msg)
                         .div_(valid.sum(1, true).clamp_min(1));
    (void)agg;
    Timing t;
    t.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.compute = t.wall - (st::comm_stats().comm_seconds - comm0);
    return t;
  };

  std::vector<bench::Json> records;
  step(pts, f);  // warm-up
  for (int round = 0; round <= rounds; ++round) {
    std::vector<double> computes, walls;
    for (int r = 0; r < repeats; ++r) {
      Timing t = step(pts, f);
      computes.push_back(t.compute);
      walls.push_back(t.wall);
    }
    std::sort(computes.begin(), computes.end());
    std::sort(walls.begin(), walls.end());
    const double compute = computes[computes.size() / 2];
    const auto per_rank = all_gather(compute);
    const auto walls_all = all_gather(walls[walls.size() / 2]);
    const double step_wall = *std::max_element(walls_all.begin(), walls_all.end());
    const auto rows = all_gather(static_cast<double>(st::ShardTensor(pts).local().size(0)));
    if (root) {
      std::printf("round %d: rows", round);
      for (double v : rows) std::printf(" %.0f", v);
      std::printf("; compute s");
      for (double v : per_rank) std::printf(" %.4f", v);
      std::printf("; max/mean %.3f; step %.4f s; load %s\n", max_over_mean(per_rank), step_wall,
                  bench::load_average().c_str());
      records.push_back(bench::Json{{"scenario", "rebalance"},
                                    {"ranks", P},
                                    {"points", n},
                                    {"dense", dense},
                                    {"radius", radius},
                                    {"max_neighbors", max_neighbors},
                                    {"features", features},
                                    {"hidden", hidden},
                                    {"round", round},
                                    {"rows", rows},
                                    {"compute_seconds", per_rank},
                                    {"compute_max_over_mean", max_over_mean(per_rank)},
                                    {"step_seconds", step_wall},
                                    {"load_average", bench::load_average()}});
    }
    if (round < rounds) {
      auto moved = st::rebalance({pts, f}, compute);
      pts = moved[0];
      f = moved[1];
    }
  }
  if (root && !out.empty()) bench::append_records(out, records);
  return 0;
}
