// Ring k-NN and radius search on row-sharded point clouds against a brute
// force single-process search (ties broken by global id), uneven pieces with
// an empty one, the bounding-box pre-filter on a spatially sorted cloud, and
// the per-rank memory bound.
#include <ATen/CPUGeneratorImpl.h>
#include <shardtensor/ops/graph.h>
#include <shardtensor/ops/neighbors.h>
#include <shardtensor/ops/rebalance.h>
#include <torch/torch.h>

#include <chrono>
#include <limits>
#include <numeric>
#include <vector>

#include "comm/agree.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

/// Brute force: all pairwise squared distances (dim by dim, float64), sorted
/// by (distance, id), first k; radius filter; -1/inf padding.
std::pair<at::Tensor, at::Tensor> brute(const at::Tensor& q, const at::Tensor& p, int64_t k,
                                        double r = std::numeric_limits<double>::infinity()) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t m = q.size(0), n = p.size(0);
  at::Tensor d2 = at::zeros({m, n}, at::kDouble);
  for (int64_t j = 0; j < q.size(1); ++j)
    d2.add_(
        (q.to(at::kDouble).select(1, j).unsqueeze(1) - p.to(at::kDouble).select(1, j).unsqueeze(0))
            .square());
  at::Tensor idx = at::empty({m, k}, at::kLong), dist = at::empty({m, k}, at::kDouble);
  auto a = d2.accessor<double, 2>();
  for (int64_t i = 0; i < m; ++i) {
    std::vector<int64_t> order(n);
    for (int64_t j = 0; j < n; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return a[i][x] < a[i][y]; });
    for (int64_t c = 0; c < k; ++c) {
      const bool ok = c < n && a[i][order[c]] <= r * r;
      idx[i][c] = ok ? order[c] : -1;
      dist[i][c] = ok ? std::sqrt(a[i][order[c]]) : inf;
    }
  }
  return {idx, dist.to(p.scalar_type())};
}

at::Tensor cloud(int64_t n, int64_t d, uint64_t seed, bool lattice) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (lattice) return at::randint(4, {n, d}, gen, at::kLong).to(at::kFloat);  // many ties
  return at::rand({n, d}, gen, at::kFloat);
}

st::ShardSizes sizes_for(const st::DeviceMesh& mesh, const st::Placements& pl, int64_t n,
                         bool empty) {
  if (empty) return sizes_with_empty_first(mesh, pl, {n, 1});
  st::ShardSizes s(mesh.ndim());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!std::holds_alternative<st::Shard>(pl[m])) continue;
    // Deliberately uneven: coordinate c gets a share proportional to c + 1.
    const int64_t P = mesh.size(m);
    int64_t left = n, tot = P * (P + 1) / 2;
    for (int64_t c = 0; c < P; ++c) {
      int64_t v = c + 1 == P ? left : n * (c + 1) / tot;
      s[m].push_back(v);
      left -= v;
    }
  }
  return s;
}

void check(bool radius, bool lattice, bool empty_q, bool empty_p) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t nq = 23, np = 41, k = 5;
  at::Tensor q = cloud(nq, 3, 1, lattice), p = cloud(np, 3, 2, lattice);
  const double r = lattice ? 1.5 : 0.35;
  auto sq = st::distribute_tensor(q, mesh, pl, false, sizes_for(mesh, pl, nq, empty_q));
  auto sp = st::distribute_tensor(p, mesh, pl, false, sizes_for(mesh, pl, np, empty_p));
  auto res = radius ? st::radius_search(sq, sp, r, k) : st::knn(sq, sp, k);
  auto ref = radius ? brute(q, p, k, r) : brute(q, p, k);
  EXPECT_TRUE(st::ShardTensor::is_shard_tensor(res.first));
  EXPECT_TRUE(all_close(gathered(res.first), ref.first, 0, 0));
  EXPECT_TRUE(all_close(gathered(res.second), ref.second, 0, 0));
}

TEST(Knn, EqualsBruteForceUneven) { check(false, false, false, false); }
TEST(Knn, EqualsBruteForceWithTiesAndEmptyPieces) {
  check(false, true, true, false);
  check(false, true, false, true);
}
TEST(Knn, MoreNeighboursThanPointsPads) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  at::Tensor q = cloud(6, 2, 3, false), p = cloud(4, 2, 4, false);
  auto res = st::knn(st::distribute_tensor(q, mesh, pl), st::distribute_tensor(p, mesh, pl), 6);
  auto ref = brute(q, p, 6);
  EXPECT_TRUE(all_close(gathered(res.first), ref.first, 0, 0));
  EXPECT_TRUE(all_close(gathered(res.second), ref.second, 0, 0));
}
TEST(RadiusSearch, EqualsBruteForce) {
  check(true, false, false, false);
  check(true, true, true, true);
}
TEST(Knn, PlainTensorsAreSingleProcess) {
  at::Tensor q = cloud(9, 3, 5, true), p = cloud(17, 3, 6, true);
  auto res = st::knn(q, p, 4);
  auto ref = brute(q, p, 4);
  EXPECT_TRUE(at::equal(res.first, ref.first));
  EXPECT_TRUE(at::equal(res.second, ref.second));
}

TEST(Knn, BoxFilterSkipsFarPiecesOnASortedCloud) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 1200;
  // A cloud sorted along x: every rank's piece is a slab.
  at::Tensor p = cloud(n, 3, 7, false);
  p = p.index_select(0, std::get<1>(p.select(1, 0).sort()));
  auto sp = st::distribute_tensor(p, mesh, pl);
  st::NeighborStats stats;
  auto res = st::knn(sp, sp, 8, &stats);
  std::vector<int64_t> tot = {stats.bytes_skipped, stats.bytes_fetched, stats.pieces_skipped,
                              stats.pieces_fetched};
  st::comm::all_reduce_sum(mesh, tot);
  const int64_t P = mesh.size(0);
  for (auto& v : tot) v /= mesh.size() / P;  // replicas along the other mesh dims
  if (mesh.rank() == 0) {
    std::printf(
        "[ knn ] sorted cloud n=%ld P=%ld: bytes fetched %ld, skipped %ld (%.0f%%), "
        "pieces fetched %ld, skipped %ld\n",
        (long)n, (long)P, (long)tot[1], (long)tot[0],
        tot[0] + tot[1] > 0 ? 100.0 * tot[0] / (tot[0] + tot[1]) : 0.0, (long)tot[3], (long)tot[2]);
  }
  // Slabs: only the two neighbouring slabs can hold a nearer point, so at
  // most 2 (P - 1) pieces move in all and the others are skipped.
  EXPECT_LE(tot[3], 2 * (P - 1));
  EXPECT_GE(tot[2], (P - 1) * (P - 2));
  auto ref = brute(p, p, 8);
  EXPECT_TRUE(all_close(gathered(res.first), ref.first, 0, 0));
}

TEST(Knn, MemoryPerRankIsLocal) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 6000, k = 4;
  at::Tensor p = cloud(n, 3, 8, false);
  p = p.index_select(0, std::get<1>(p.select(1, 0).sort()));
  auto sp = st::distribute_tensor(p, mesh, pl);
  const int64_t full_bytes = n * 3 * 4;
  st::reset_peak_memory_stats();
  const int64_t before = st::memory_stats().current_bytes;
  auto res = st::knn(sp, sp, k);
  const int64_t extra = st::memory_stats().peak_bytes - before;
  std::vector<int64_t> worst = {extra};
  st::comm::all_reduce_max(mesh, worst);
  const int64_t P = mesh.size(0);
  const int64_t local_rows = (n + P - 1) / P;
  if (mesh.rank() == 0) {
    std::printf("[ knn ] n=%ld P=%ld: peak extra bytes per rank %ld (full cloud %ld bytes)\n",
                (long)n, (long)P, (long)worst[0], (long)full_bytes);
  }
  // The blocked distance matrix (2^20 float64 elements; about six temporaries
  // of that size in the merge, measured 50.6 MB at 1 and 4 ranks) plus
  // O(local rows * k) state and one foreign piece: independent of n, whereas
  // an unblocked search needs n * n * 8 bytes (288 MB at one rank).
  const int64_t bound = (int64_t{1} << 20) * 8 * 8 + local_rows * k * 64 + n * 3 * 4;
  EXPECT_LT(worst[0], bound);
}

TEST(Knn, BadArgumentsThrowEverywhere) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  auto sq = st::distribute_tensor(cloud(5, 3, 9, false), mesh, pl);
  auto sp = st::distribute_tensor(cloud(5, 2, 9, false), mesh, pl);
  EXPECT_TRUE(throws_everywhere([&] { st::knn(sq, sq, 0); }, {"knn", "k must be"}));
  EXPECT_TRUE(throws_everywhere([&] { st::knn(sq, sp, 2); }, {"knn", "[5, 3]", "[5, 2]"}));
  EXPECT_TRUE(throws_everywhere([&] { st::radius_search(sq, sq, -1.0, 2); }, {"r must be"}));
}

}  // namespace

// ---- rebalancing by cost -------------------------------------------------------------

namespace {

double imbalance(const std::vector<double>& per_rank) {
  double mx = 0, sum = 0;
  for (double v : per_rank) {
    mx = std::max(mx, v);
    sum += v;
  }
  return sum > 0 ? mx / (sum / per_rank.size()) : 1.0;
}

std::vector<double> per_coordinate(const st::DeviceMesh& mesh, double mine) {
  std::vector<int64_t> v(mesh.size(0), 0);
  v[mesh.coordinate()[0]] = static_cast<int64_t>(mine * 1e6);
  st::comm::all_reduce_max(mesh, v);
  std::vector<double> out;
  for (int64_t x : v) out.push_back(x / 1e6);
  return out;
}

TEST(Rebalance, EqualCostsGiveBalancedSizesAndKeepValues) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 50;
  at::Tensor x = rnd({n, 3}, 1);
  auto sx = st::distribute_tensor(x, mesh, pl, false, sizes_with_empty_first(mesh, pl, {n, 3}));
  auto w =
      st::distribute_tensor(at::ones({n}), mesh, pl, false, sizes_with_empty_first(mesh, pl, {n}));
  std::vector<int64_t> sizes;
  auto out = st::rebalance({sx}, w, &sizes);
  const int64_t P = mesh.size(0);
  for (int64_t c = 0; c < P; ++c) EXPECT_LE(std::abs(sizes[c] - n / P), 1) << c;
  EXPECT_TRUE(all_close(gathered(out[0]), x, 0, 0));
}

TEST(Rebalance, NonUniformCloudBalancesCost) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 1500, k = 8;
  // 85% of the points in a small blob, the rest spread: sorted along x, the
  // blob lands in one balanced block.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  const int64_t nb = n * 85 / 100;
  at::Tensor blob = at::rand({nb, 3}, gen, at::kFloat) * 0.05 + 0.6;
  at::Tensor rest = at::rand({n - nb, 3}, gen, at::kFloat);
  at::Tensor p = at::cat({blob, rest});
  p = p.index_select(0, std::get<1>(p.select(1, 0).sort()));
  auto sp = st::distribute_tensor(p, mesh, pl);
  const double r = 0.05;
  auto step = [&](const at::Tensor& pts, at::Tensor* cost) {
    st::comm::barrier(mesh);
    auto t0 = std::chrono::steady_clock::now();
    auto res = st::radius_search(pts, pts, r, k);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (cost) {
      // Per-row cost: 1 + neighbours found within r (what the search and a
      // message-passing layer over the found edges spend per point).
      at::Tensor found = st::ShardTensor(res.first).local().ge(0).sum(1).to(at::kFloat) + 1;
      *cost = st::ShardTensor::from_local(found, mesh, pl,
                                          st::ShardTensor(pts).spec().all_shard_sizes());
    }
    return secs;
  };
  at::Tensor cost;
  const double t_before = step(sp, &cost);
  auto w_before = per_coordinate(mesh, st::ShardTensor(cost).local().sum().item<double>());
  std::vector<int64_t> sizes;
  auto moved = st::rebalance({sp, cost}, cost, &sizes);
  const double t_after = step(moved[0], nullptr);
  auto w_after = per_coordinate(mesh, st::ShardTensor(moved[1]).local().sum().item<double>());
  auto tb = per_coordinate(mesh, t_before), ta = per_coordinate(mesh, t_after);
  if (mesh.rank() == 0) {
    std::printf(
        "[ rebalance ] P=%ld cost max/mean %.2f -> %.2f; radius-search time max/mean "
        "%.2f -> %.2f (max %.4f s -> %.4f s)\n",
        (long)mesh.size(0), imbalance(w_before), imbalance(w_after), imbalance(tb), imbalance(ta),
        *std::max_element(tb.begin(), tb.end()), *std::max_element(ta.begin(), ta.end()));
  }
  EXPECT_TRUE(all_close(gathered(moved[0]), p, 0, 0));
  EXPECT_LE(imbalance(w_after), imbalance(w_before) + 1e-9);
  // Granularity: a coordinate can exceed the mean by at most one row's cost.
  const double mean = std::accumulate(w_after.begin(), w_after.end(), 0.0) / w_after.size();
  EXPECT_LE(*std::max_element(w_after.begin(), w_after.end()), mean + k + 1);
}

// Rebalancing from measured time: a k-NN + message-passing step on the
// non-uniform cloud, measured and rebalanced a few times. The imbalance is
// asserted on the step's deterministic cost (found neighbours + 1 per point,
// given to rebalance() as "seconds"), never on wall time; the wall time is
// printed (bench/ records timings).
TEST(Rebalance, MeasuredSecondsConverges) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 1200, k = 8;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
  const int64_t nb = n * 85 / 100;
  at::Tensor blob = at::rand({nb, 3}, gen, at::kFloat) * 0.05 + 0.6;
  at::Tensor rest = at::rand({n - nb, 3}, gen, at::kFloat);
  at::Tensor p = at::cat({blob, rest});
  p = p.index_select(0, std::get<1>(p.select(1, 0).sort()));
  at::Tensor feat = rnd({n, 4}, 24);
  auto sp = st::distribute_tensor(p, mesh, pl);
  auto sf = st::distribute_tensor(feat, mesh, pl);
  const double r = 0.05;
  // One step: radius search, then a mean over the found neighbours' features
  // (message passing through a GhostPlan). Returns this rank's cost.
  auto step = [&](const at::Tensor& pts, const at::Tensor& f, double* secs) {
    st::comm::barrier(mesh);
    auto t0 = std::chrono::steady_clock::now();
    const double comm0 = st::comm_stats().comm_seconds;
    auto res = st::radius_search(pts, pts, r, k);
    at::Tensor nbr = st::ShardTensor(res.first).local();
    at::Tensor valid = nbr.ge(0);
    at::Tensor ids = nbr.masked_select(valid);
    auto plan = st::ghost_plan(f, ids);
    at::Tensor x_ext = st::extend_rows(f, plan);
    at::Tensor rows = st::gather_rows(x_ext, plan.local_index(ids));
    at::Tensor dst =
        at::arange(nbr.size(0), at::kLong).unsqueeze(1).expand_as(nbr).masked_select(valid);
    at::Tensor mean = at::zeros({nbr.size(0), f.size(1)}, rows.options())
                          .index_add_(0, dst, rows)
                          .div_(valid.sum(1, true).clamp_min(1));
    (void)mean;
    // Compute time: wall time minus the time spent in MPI (waiting for
    // slower ranks is not this rank's cost).
    *secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() -
            (st::comm_stats().comm_seconds - comm0);
    return static_cast<double>(valid.sum().item<int64_t>() + nbr.size(0));
  };
  std::vector<double> cost_imbalance, time_imbalance;
  at::Tensor pts = sp, f = sf;
  for (int round = 0; round < 3; ++round) {
    double secs = 0;
    const double cost = step(pts, f, &secs);
    cost_imbalance.push_back(imbalance(per_coordinate(mesh, cost)));
    time_imbalance.push_back(imbalance(per_coordinate(mesh, secs)));
    // The deterministic cost stands in for seconds (so the test cannot flake).
    auto moved = st::rebalance({pts, f}, cost * 1e-6);
    pts = moved[0];
    f = moved[1];
  }
  double secs = 0;
  cost_imbalance.push_back(imbalance(per_coordinate(mesh, step(pts, f, &secs))));
  time_imbalance.push_back(imbalance(per_coordinate(mesh, secs)));
  if (mesh.rank() == 0) {
    std::printf("[ rebalance by measured seconds ] P=%ld cost max/mean", (long)mesh.size(0));
    for (double v : cost_imbalance) std::printf(" %.2f", v);
    std::printf("; compute time (wall - MPI) max/mean");
    for (double v : time_imbalance) std::printf(" %.2f", v);
    std::printf(" (rounds 0..3)\n");
  }
  EXPECT_TRUE(all_close(gathered(pts), p, 0, 0));
  EXPECT_TRUE(all_close(gathered(f), feat, 0, 0));
  if (mesh.size(0) > 1) {
    EXPECT_LT(cost_imbalance.back(), cost_imbalance.front());
    EXPECT_LE(cost_imbalance.back(), 1.15);
  }
  EXPECT_TRUE(throws_everywhere([&] { st::rebalance({pts}, mesh.rank() == 0 ? -1.0 : 1.0); },
                                {"measured_seconds"}));
}

// rebalance_graph: nodes move to cost-balanced sizes, every edge moves to the
// owner of its destination (in a stable order), edge features move with
// their edges, and the rebuilt plan gives message passing equal to
// single-process, forward and backward.
TEST(Rebalance, GraphMovesEdgesToDestinationOwners) {
  st::DeviceMesh mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, R});
  const int64_t n = 97, e = 400;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  // Skewed in-degree: half of the edges point into the first tenth of the nodes.
  at::Tensor src = at::randint(0, n, {e}, gen, at::kLong);
  at::Tensor dst = at::cat({at::randint(0, n / 10, {e / 2}, gen, at::kLong),
                            at::randint(0, n, {e - e / 2}, gen, at::kLong)});
  at::Tensor ei = at::stack({src, dst}, 1);
  at::Tensor x = rnd({n, 3}, 32, 1.0).to(at::kDouble);
  at::Tensor ef = rnd({e, 2}, 33, 1.0).to(at::kDouble);
  at::Tensor deg = at::ones({n}, at::kDouble).index_add_(0, dst, at::ones({e}, at::kDouble));
  auto sizes_n = sizes_with_empty_first(mesh, pl, {n});
  auto sizes_e = sizes_with_empty_first(mesh, pl, {e, 2});
  auto sx = st::distribute_tensor(x, mesh, pl, true, sizes_n);
  auto sw = st::distribute_tensor(deg, mesh, pl, false, sizes_n);
  auto sei = st::distribute_tensor(ei, mesh, pl, false, sizes_e);
  auto sef = st::distribute_tensor(ef, mesh, pl, true, sizes_e);
  auto g = st::rebalance_graph({sx}, sei, {sef}, sw);
  // The single-process expectation: owners under the new sizes, stable order.
  const int64_t P = mesh.size(0);
  std::vector<int64_t> ends(P);
  int64_t acc = 0;
  for (int64_t c = 0; c < P; ++c) ends[c] = (acc += g.node_sizes[c]);
  at::Tensor owner = at::searchsorted(at::tensor(ends), dst, false, true);
  at::Tensor perm = std::get<1>(owner.sort(true, 0, false));
  EXPECT_TRUE(all_close(gathered(g.edge_index), ei.index_select(0, perm), 0, 0));
  EXPECT_TRUE(all_close(gathered(g.edges[0]), ef.index_select(0, perm), 0, 0));
  EXPECT_TRUE(all_close(gathered(g.nodes[0]), x, 0, 0));
  at::Tensor my_dst = st::ShardTensor(g.edge_index).local().select(1, 1);
  const int64_t lo = g.plan.owned_offset(), hi = lo + g.plan.num_owned();
  EXPECT_TRUE(all_ranks(my_dst.numel() == 0 ||
                        (my_dst.ge(lo).all().item<bool>() && my_dst.lt(hi).all().item<bool>())));
  // Cost balance: a coordinate exceeds the mean by at most one node's cost.
  double mine = 0;
  {
    at::Tensor w_moved = st::rebalance({sw}, sw)[0];
    mine = st::ShardTensor(w_moved).local().sum().item<double>();
  }
  auto w_after = per_coordinate(mesh, mine);
  const double mean = deg.sum().item<double>() / P;
  EXPECT_LE(*std::max_element(w_after.begin(), w_after.end()),
            mean + deg.max().item<double>() + 1e-9);
  // Message passing on the moved graph: out[v] = sum_{e: dst=v} x[src] * ef[e, 0].
  at::Tensor l_ei = st::ShardTensor(g.edge_index).local();
  at::Tensor x_ext = st::extend_rows(g.nodes[0], g.plan);
  at::Tensor m = st::gather_rows(x_ext, g.plan.local_index(l_ei.select(1, 0))) *
                 st::ShardTensor(g.edges[0]).local().narrow(1, 0, 1);
  at::Tensor out = st::scatter_rows(m, g.plan.local_index(l_ei.select(1, 1)), g.plan);
  at::Tensor xr = x.clone().requires_grad_(true), efr = ef.clone().requires_grad_(true);
  at::Tensor ref = at::zeros({n, 3}, at::kDouble)
                       .index_add(0, dst, xr.index_select(0, src) * efr.narrow(1, 0, 1));
  EXPECT_TRUE(all_close(gathered(out), ref, 1e-12, 1e-12));
  at::Tensor cot = rnd({n, 3}, 34).to(at::kDouble);
  (ref * cot).sum().backward();
  auto scot = st::distribute_tensor(cot, mesh, pl, false,
                                    st::ShardTensor(g.nodes[0]).spec().all_shard_sizes());
  (out * scot).sum().backward();
  EXPECT_TRUE(all_close(st::ShardTensor(sx).grad().full_tensor(), xr.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(st::ShardTensor(sef).grad().full_tensor(), efr.grad(), 1e-12, 1e-12));
}

}  // namespace
