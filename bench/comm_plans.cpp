// shardtensor_bench_comm_plans: host time per call of the plan-based
// communication primitives (issue 13), printed, never asserted.
//
//   mpirun -np P shardtensor_bench_comm_plans repartition [--calls 1000] [--n 64]
//   mpirun -np P shardtensor_bench_comm_plans halo [--reps 200] [--channels 32] [--n 512]
//
// repartition: `calls` calls of comm::repartition on an [n, n] float tensor
// whose rows are dealt round-robin in blocks of 2 and go to balanced blocks,
// of comm::all_to_all Shard(0) -> Shard(1) on the same tensor, and of both
// with a backward (which runs the inverse plans). Prints the mean time per
// call (the slowest rank's total over `calls`).
//
// halo: comm::halo_exchange of a [1, channels, n, n] float32 field sharded
// on dim 2 with halo widths 1 and 3, `reps` timed calls per path after 10
// warm-up calls, alternating between the point-to-point path (Isend/Irecv of
// packed strips) and the neighbourhood-collective path
// (SHARDTENSOR_HALO_NEIGHBOR=1, Note [neighbourhood collectives] in
// src/comm/halo.cpp) call by call, so that both see the same load. Prints the
// median per call (of the slowest rank's time per call).
//
// Every line carries the load average (bench/tool.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <mpi.h>
#include <shardtensor/shardtensor.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tool.h"

#ifndef SHARDTENSOR_BENCH_NO_PLAN_MODE
#include "comm/primitive_support.h"  // private: internal::axis
#include "comm/repartition.h"        // private: the plans and their cache
#endif

namespace st = shardtensor;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double max_over_ranks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

std::vector<int64_t> balanced(int64_t n, int64_t P) {
  std::vector<int64_t> out(static_cast<size_t>(P), n / P);
  for (int64_t c = 0; c < n % P; ++c) out[static_cast<size_t>(c)] += 1;
  return out;
}

int64_t option(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

struct PerCall {
  double wall_min = 0, wall_median = 0;  // over 10 batches: the slowest rank's mean per call
  double host = 0;  // the slowest rank's mean (wall - time inside MPI data calls) per call
};

/// `calls` calls of `f` in 10 batches (after 10 warm-up calls).
template <class F>
PerCall per_call(int64_t calls, F&& f) {
  for (int i = 0; i < 10; ++i) f();  // warm-up (plans built, allocator warm)
  const int64_t batch = std::max<int64_t>(calls / 10, 1);
  std::vector<double> walls;
  double host = 0;
  for (int b = 0; b < 10; ++b) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double comm0 = st::comm_stats().comm_seconds;
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < batch; ++i) f();
    const double wall = seconds_since(t0);
    host += wall - (st::comm_stats().comm_seconds - comm0);
    walls.push_back(max_over_ranks(wall) / static_cast<double>(batch));
  }
  std::sort(walls.begin(), walls.end());
  PerCall out;
  out.wall_min = walls.front();
  out.wall_median = walls[walls.size() / 2];
  out.host = max_over_ranks(host) / static_cast<double>(10 * batch);
  return out;
}

void bench_repartition(int argc, char** argv, const st::DeviceMesh& mesh) {
  const int64_t calls = option(argc, argv, "--calls", 1000);
  const int64_t n = option(argc, argv, "--n", 64);
  const int64_t P = mesh.size(), me = mesh.rank();
  std::vector<std::vector<st::comm::Segment>> seg(static_cast<size_t>(P));
  for (int64_t k = 0; 2 * k < n; ++k) {
    seg[static_cast<size_t>(k % P)].push_back({2 * k, std::min<int64_t>(2, n - 2 * k)});
  }
  int64_t mine = 0;
  for (const auto& s : seg[static_cast<size_t>(me)]) mine += s.length;
  const auto dst = balanced(n, P);
  at::Tensor rows = at::randn({mine, n});
  at::Tensor block = at::randn({dst[static_cast<size_t>(me)], n});
  const bool root = me == 0;
  auto report = [&](const char* what, PerCall s) {
    if (root) {
      std::printf(
          "P=%lld %s [%lld, %lld] float, %lld calls: wall per call min %.1f us, median %.1f us "
          "(batches of %lld); outside MPI %.1f us; load %s\n",
          static_cast<long long>(P), what, static_cast<long long>(n), static_cast<long long>(n),
          static_cast<long long>(calls), s.wall_min * 1e6, s.wall_median * 1e6,
          static_cast<long long>(std::max<int64_t>(calls / 10, 1)), s.host * 1e6,
          bench::load_average().c_str());
      std::fflush(stdout);
    }
  };
  {
    at::NoGradGuard no_grad;
    report("repartition (round-robin runs -> blocks)",
           per_call(calls, [&] { st::comm::repartition(rows, mesh, 0, 0, seg, dst); }));
    report("all_to_all Shard(0) -> Shard(1)",
           per_call(calls, [&] { st::comm::all_to_all(block, mesh, 0, 0, dst, 1, dst); }));
  }
  at::Tensor x = rows.clone().requires_grad_(true);
  report("repartition forward + backward",
         per_call(calls, [&] { st::comm::repartition(x, mesh, 0, 0, seg, dst).sum().backward(); }));
  at::Tensor y = block.clone().requires_grad_(true);
  report("all_to_all forward + backward", per_call(calls, [&] {
           st::comm::all_to_all(y, mesh, 0, 0, dst, 1, dst).sum().backward();
         }));
}

#ifndef SHARDTENSOR_BENCH_NO_PLAN_MODE
/// Host time of the plan step alone (no communication): building the
/// RepartitionPlan / AllToAllPlan, as every call did before the cache, against
/// finding it in the cache (key built and hashed), as every call does now.
void bench_plan(int argc, char** argv, const st::DeviceMesh& mesh) {
  namespace sc = st::comm;
  const int64_t calls = option(argc, argv, "--calls", 100000);
  const int64_t n = option(argc, argv, "--n", 64);
  const int64_t P = mesh.size();
  const sc::internal::Axis a = sc::internal::axis(sc::internal::Prim::Repartition, mesh, 0);
  sc::Layout src(static_cast<size_t>(P)), dst;
  for (int64_t k = 0; 2 * k < n; ++k) {
    src[static_cast<size_t>(k % P)].push_back({2 * k, std::min<int64_t>(2, n - 2 * k)});
  }
  const auto sizes = balanced(n, P);
  int64_t at = 0;
  for (int64_t s : sizes) {
    dst.push_back({sc::Segment{at, s}});
    at += s;
  }
  // Each step timed in 20 rounds of calls / 20, interleaved; the fastest round
  // counts (the machine is shared: the minimum is the least disturbed).
  std::vector<std::function<void()>> steps = {
      [&] { (void)std::make_shared<const sc::RepartitionPlan>(a, 0, src, dst); },
      [&] { (void)sc::cached_repartition_plan(a, 0, src, dst); },
      [&] { (void)std::make_shared<const sc::AllToAllPlan>(a, 0, sizes, 1, sizes); },
      [&] { (void)sc::cached_all_to_all_plan(a, 0, sizes, 1, sizes); }};
  std::vector<double> best(steps.size(), 1e30);
  const int64_t round_calls = std::max<int64_t>(calls / 20, 1);
  for (int round = 0; round < 20; ++round) {
    for (size_t k = 0; k < steps.size(); ++k) {
      steps[k]();
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < round_calls; ++i) steps[k]();
      best[k] = std::min(best[k], seconds_since(t0) / static_cast<double>(round_calls));
    }
  }
  for (auto& b : best) b = max_over_ranks(b);
  const double build_rep = best[0], find_rep = best[1], build_a2a = best[2], find_a2a = best[3];
  if (mesh.rank() == 0) {
    std::printf(
        "P=%lld plan step per call, [%lld, %lld] (%lld calls): repartition build %.2f us, cached "
        "%.2f us; all_to_all build %.2f us, cached %.2f us; load %s\n",
        static_cast<long long>(P), static_cast<long long>(n), static_cast<long long>(n),
        static_cast<long long>(calls), build_rep * 1e6, find_rep * 1e6, build_a2a * 1e6,
        find_a2a * 1e6, bench::load_average().c_str());
  }
}
#endif

void bench_halo(int argc, char** argv, const st::DeviceMesh& mesh) {
  const int64_t reps = option(argc, argv, "--reps", 200);
  const int64_t channels = option(argc, argv, "--channels", 32);
  const int64_t n = option(argc, argv, "--n", 512);
  const int64_t P = mesh.size(), me = mesh.rank();
  const auto sizes = balanced(n, P);
  at::Tensor local = at::randn({1, channels, sizes[static_cast<size_t>(me)], n});
  at::NoGradGuard no_grad;
  for (int64_t width : {1, 3}) {
    // Same results on both paths (checked once, before timing).
    setenv("SHARDTENSOR_HALO_NEIGHBOR", "0", 1);
    at::Tensor a = st::comm::halo_exchange(local, mesh, 0, 2, sizes, width, width);
    setenv("SHARDTENSOR_HALO_NEIGHBOR", "1", 1);
    at::Tensor b = st::comm::halo_exchange(local, mesh, 0, 2, sizes, width, width);
    const double same = max_over_ranks(at::equal(a, b) ? 0.0 : 1.0);
    std::vector<double> times[2], in_mpi[2];
    for (int64_t i = 0; i < reps + 10; ++i) {
      for (int k = 0; k < 2; ++k) {
        const int path = (k + static_cast<int>(i)) % 2;  // either path first, in turn
        setenv("SHARDTENSOR_HALO_NEIGHBOR", path == 0 ? "0" : "1", 1);
        MPI_Barrier(MPI_COMM_WORLD);
        const double comm0 = st::comm_stats().comm_seconds;
        const auto t0 = Clock::now();
        st::comm::halo_exchange(local, mesh, 0, 2, sizes, width, width);
        const double s = max_over_ranks(seconds_since(t0));
        const double m = max_over_ranks(st::comm_stats().comm_seconds - comm0);
        if (i >= 10) {
          times[path].push_back(s);
          in_mpi[path].push_back(m);
        }
      }
    }
    unsetenv("SHARDTENSOR_HALO_NEIGHBOR");
    if (me == 0) {
      // Paired (the two paths alternate call by call): the median ratio of
      // pair i and how many pairs the neighbourhood path won (a sign test:
      // without a difference, about half, +- sqrt(reps)/2 ~ 7 of 200).
      std::vector<double> ratio;
      int64_t wins = 0;
      for (size_t i = 0; i < times[0].size(); ++i) {
        ratio.push_back(times[1][i] / times[0][i]);
        wins += times[1][i] < times[0][i] ? 1 : 0;
      }
      std::sort(ratio.begin(), ratio.end());
      double med[2], mpi_med[2];
      for (int path = 0; path < 2; ++path) {
        auto& t = times[path];
        std::sort(t.begin(), t.end());
        med[path] = t[t.size() / 2];
        auto& m = in_mpi[path];
        std::sort(m.begin(), m.end());
        mpi_med[path] = m[m.size() / 2];
      }
      std::printf(
          "P=%lld halo [1, %lld, %lld, %lld] float32 dim 2, width %lld, %lld reps: "
          "isend/irecv median %.1f us (p10 %.1f, p90 %.1f), neighbour alltoallw median %.1f us "
          "(p10 %.1f, p90 %.1f), ratio %.3f; paired: median ratio %.3f, neighbour faster in %lld "
          "of %lld; inside MPI calls median %.1f us vs %.1f us; results %s, load %s\n",
          static_cast<long long>(P), static_cast<long long>(channels), static_cast<long long>(n),
          static_cast<long long>(n), static_cast<long long>(width), static_cast<long long>(reps),
          med[0] * 1e6, times[0][times[0].size() / 10] * 1e6,
          times[0][times[0].size() * 9 / 10] * 1e6, med[1] * 1e6,
          times[1][times[1].size() / 10] * 1e6, times[1][times[1].size() * 9 / 10] * 1e6,
          med[1] / med[0], ratio[ratio.size() / 2], static_cast<long long>(wins),
          static_cast<long long>(ratio.size()), mpi_med[0] * 1e6, mpi_med[1] * 1e6,
          same == 0.0 ? "identical" : "DIFFERENT", bench::load_average().c_str());
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  at::set_num_threads(1);
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "repartition") {
    bench_repartition(argc, argv, mesh);
#ifndef SHARDTENSOR_BENCH_NO_PLAN_MODE
  } else if (mode == "plan") {
    bench_plan(argc, argv, mesh);
#endif
  } else if (mode == "halo") {
    bench_halo(argc, argv, mesh);
  } else {
    if (mesh.rank() == 0) {
      std::fprintf(stderr, "usage: shardtensor_bench_comm_plans repartition|halo [options]\n");
    }
    return 2;
  }
  return 0;
}
