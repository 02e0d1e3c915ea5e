// Message passing as users write it (Note [graph op rules], src/ops/graph_ops.cpp):
// plain aten ops -- index_select, gather, index_add, scatter_add, scatter_reduce
// (sum, mean, amax, amin, prod; include_self true and false) and their in-place
// forms -- on row-sharded nodes and edges, against single-process libtorch on
// the whole graph, forward and backward; a 2-layer message-passing network
// written with plain ops; the traffic (only ghost rows move); the plan cache
// (Note [index plan cache]); bad input; layouts that keep the generic fallback.
//
// Nodes and edges are sharded Shard(0) along mesh dim 0 (Replicate along
// mesh dim 1 on the 2x2 mesh), unevenly, with an empty first node piece or an
// empty first edge piece.
#include <ATen/CPUGeneratorImpl.h>
#include <shardtensor/dispatch/stats.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "ops/graph_ops.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

const st::Placements kRows = {S0, R};

at::Tensor randint(int64_t hi, c10::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(hi, shape, gen, at::kLong);
}

/// Values on a coarse grid (multiples of 0.5 in [-2, 2]): many ties for
/// amax/amin, exact zeros for prod.
at::Tensor coarse(c10::IntArrayRef shape, uint64_t seed, at::ScalarType dt) {
  return (at::round(rnd(shape, seed) * 2).clamp(-4, 4) / 2).to(dt);
}

/// Nodes or edges sharded by rows, balanced or with an empty first piece.
RefInput nodes(const st::DeviceMesh& mesh, const at::Tensor& full, bool empty, bool rg = true) {
  return empty ? empty_first_input(mesh, full, kRows, rg) : sharded_input(mesh, full, kRows, rg);
}
RefInput edges(const st::DeviceMesh& mesh, const at::Tensor& full, bool empty, bool rg = true) {
  return empty ? empty_first_input(mesh, full, kRows, rg) : sharded_input(mesh, full, kRows, rg);
}

/// Collective. dispatch_stats().fallbacks and comm_stats().gathered_bytes of `fn`.
std::pair<int64_t, int64_t> fallbacks_of(const std::function<void()>& fn) {
  st::reset_dispatch_stats();
  st::reset_comm_stats();
  fn();
  return {st::dispatch_stats().fallbacks, st::comm_stats().gathered_bytes};
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble};

double rtol_of(at::ScalarType dt) { return dt == at::kDouble ? 1e-12 : 1e-5; }
double atol_of(at::ScalarType dt) { return dt == at::kDouble ? 1e-12 : 1e-5; }

// ---- selection ----------------------------------------------------------------

TEST(GraphOps, IndexSelectAndGatherEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t N = 23, E = 41, F = 3;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({N, F}, 1).to(dt);
    at::Tensor idx = randint(N, {E}, 2);
    at::Tensor idx2 = randint(N, {E, 2}, 3);  // gather reads columns 0 and 1 of 3
    for (bool empty_nodes : {true, false}) {
      auto sel = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return in[0].index_select(0, in[1]);
      };
      auto gat = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return in[0].gather(0, in[1]);
      };
      std::pair<int64_t, int64_t> fb;
      fb = fallbacks_of([&] {
        EXPECT_TRUE(reference_check(
            sel, {nodes(mesh, x, empty_nodes), edges(mesh, idx, !empty_nodes, false)}, mesh, {},
            rtol_of(dt), atol_of(dt)))
            << "index_select " << dt << " empty nodes " << empty_nodes;
        EXPECT_TRUE(reference_check(
            gat, {nodes(mesh, x, empty_nodes), edges(mesh, idx2, !empty_nodes, false)}, mesh, {},
            rtol_of(dt), atol_of(dt)))
            << "gather " << dt << " empty nodes " << empty_nodes;
      });
      EXPECT_EQ(fb.first, 0);
      EXPECT_EQ(fb.second, 0);
    }
  }
  // 1-D nodes and int32 indices.
  at::Tensor x1 = rnd({N}, 4);
  at::Tensor idx32 = randint(N, {E}, 5).to(at::kInt);
  EXPECT_TRUE(
      reference_check([](const std::vector<at::Tensor>& in,
                         const std::vector<at::Tensor>&) { return in[0].index_select(0, in[1]); },
                      {nodes(mesh, x1, true), edges(mesh, idx32, false, false)}, mesh));
}

// ---- sums ---------------------------------------------------------------------

TEST(GraphOps, IndexAddAndScatterAddEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t N = 19, E = 47, F = 3;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({N, F}, 6).to(dt);
    at::Tensor idx = randint(N, {E}, 7);
    at::Tensor idx2 = randint(N, {E, F}, 8);
    at::Tensor src = rnd({E, F}, 9).to(dt);
    for (bool empty_nodes : {true, false}) {
      auto fb = fallbacks_of([&] {
        EXPECT_TRUE(reference_check(
            [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
              return in[0].index_add(0, in[1], in[2], /*alpha=*/0.5);
            },
            {nodes(mesh, x, empty_nodes), edges(mesh, idx, !empty_nodes, false),
             edges(mesh, src, !empty_nodes)},
            mesh, {}, rtol_of(dt), atol_of(dt)))
            << "index_add " << dt;
        EXPECT_TRUE(reference_check(
            [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
              return in[0].scatter_add(0, in[1], in[2]);
            },
            {nodes(mesh, x, empty_nodes), edges(mesh, idx2, !empty_nodes, false),
             edges(mesh, src, !empty_nodes)},
            mesh, {}, rtol_of(dt), atol_of(dt)))
            << "scatter_add " << dt;
        // In place, on a non-leaf copy of the nodes.
        EXPECT_TRUE(reference_check(
            [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
              at::Tensor y = in[0] * 2;
              y.index_add_(0, in[1], in[2], -1.5);
              return y.scatter_add_(0, in[3], in[2]);
            },
            {nodes(mesh, x, empty_nodes), edges(mesh, idx, !empty_nodes, false),
             edges(mesh, src, !empty_nodes), edges(mesh, idx2, !empty_nodes, false)},
            mesh, {}, rtol_of(dt), atol_of(dt)))
            << "index_add_ / scatter_add_ " << dt;
      });
      EXPECT_EQ(fb.first, 0);
      EXPECT_EQ(fb.second, 0);
    }
  }
}

// ---- scatter_reduce -----------------------------------------------------------

TEST(GraphOps, ScatterReduceEqualsSingleProcess) {
  auto mesh = test_mesh();
  const int64_t N = 17, E = 43, F = 2;
  for (auto dt : kDtypes) {
    // Coarse values: ties among messages and with self (amax/amin), zeros
    // (prod: single and repeated zeros per row, zeros in self).
    at::Tensor x = coarse({N, F}, 10, dt);
    at::Tensor idx2 = randint(N, {E, F}, 11);
    at::Tensor src = coarse({E, F}, 12, dt);
    for (const char* reduce : {"sum", "mean", "amax", "amin", "prod"}) {
      for (bool include_self : {true, false}) {
        for (bool empty_nodes : {true, false}) {
          auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
            return in[0].scatter_reduce(0, in[1], in[2], reduce, include_self);
          };
          auto fb = fallbacks_of([&] {
            EXPECT_TRUE(reference_check(
                fn,
                {nodes(mesh, x, empty_nodes), edges(mesh, idx2, !empty_nodes, false),
                 edges(mesh, src, !empty_nodes)},
                mesh, {}, rtol_of(dt), atol_of(dt)))
                << reduce << " include_self=" << include_self << " " << dt
                << " empty nodes=" << empty_nodes;
          });
          EXPECT_EQ(fb.first, 0) << reduce;
          EXPECT_EQ(fb.second, 0) << reduce;
        }
      }
    }
  }
}

TEST(GraphOps, ScatterReduceInPlaceAndWideSrc) {
  auto mesh = test_mesh();
  const int64_t N = 13, E = 31;
  at::Tensor x = coarse({N, 3}, 13, at::kFloat);
  at::Tensor idx2 = randint(N, {E, 2}, 14);  // reaches columns 0-1 of self
  at::Tensor src = coarse({E, 2}, 15, at::kFloat);
  at::Tensor wide = coarse({E, 4}, 16, at::kFloat);
  for (const char* reduce : {"sum", "mean", "amax", "amin", "prod"}) {
    // In place, on a non-leaf copy of the nodes: forward and backward.
    auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      at::Tensor y = in[0] + 0;
      return y.scatter_reduce_(0, in[1], in[2], reduce, /*include_self=*/false);
    };
    EXPECT_TRUE(reference_check(
        fn, {nodes(mesh, x, true), edges(mesh, idx2, false, false), edges(mesh, src, false)}, mesh,
        {}, 1e-5, 1e-5))
        << reduce;
    // A src wider than the index (libtorch reads its first columns): forward
    // only, as libtorch's backward (1.13 and 2.13) returns an index-shaped
    // gradient for src there: 2.13's engine refuses it for sum and mean
    // ("ScatterReduceBackward0 returned an invalid gradient at index 1"), and
    // amax, amin and prod fail inside the backward on the size mismatch.
    EXPECT_TRUE(reference_check(
        fn, {nodes(mesh, x, false), edges(mesh, idx2, true, false), edges(mesh, wide, true)}, mesh,
        {}, 1e-5, 1e-5, /*check_backward=*/false))
        << reduce << " wide src";
  }
}

TEST(GraphOps, IntegerReductionsEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t N = 11, E = 29;
  at::Tensor x = randint(7, {N, 2}, 16) - 3;
  at::Tensor idx2 = randint(N, {E, 2}, 17);
  at::Tensor src = randint(9, {E, 2}, 18) - 4;
  for (const char* reduce : {"sum", "mean", "amax", "amin", "prod"}) {
    for (bool include_self : {true, false}) {
      auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return in[0].scatter_reduce(0, in[1], in[2], reduce, include_self);
      };
      EXPECT_TRUE(reference_check(fn,
                                  {nodes(mesh, x, true, false), edges(mesh, idx2, false, false),
                                   edges(mesh, src, false, false)},
                                  mesh, {}, 0, 0))
          << reduce << " include_self=" << include_self;
    }
  }
}

// ---- a 2-layer message-passing network written with plain ops -----------------

struct Graph {
  int64_t N = 0, E = 0;
  at::Tensor x, ei, e;
};

/// A graph whose edges mostly join nearby node ids (as after a space-filling
/// curve ordering): few ghosts per rank.
Graph local_graph(int64_t N, int64_t fanout, uint64_t seed) {
  Graph g;
  g.N = N;
  g.E = N * fanout;
  at::Tensor dst = at::arange(N).repeat_interleave(fanout);
  at::Tensor off = randint(7, {g.E}, seed) - 3;
  at::Tensor srcn = (dst + off).clamp(0, N - 1);
  g.ei = at::stack({srcn, dst}, 1);
  g.x = rnd({N, 4}, seed + 1);
  g.e = rnd({g.E, 2}, seed + 2);
  return g;
}

/// index_select -> Linear -> index_add and scatter_reduce(mean), twice.
at::Tensor mp_network(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
  const at::Tensor &x = in[0], &ei = in[1], &e = in[2];
  const int64_t N = x.size(0), H = p[1].size(0);
  const at::Tensor src = ei.select(1, 0), dst = ei.select(1, 1);
  const at::Tensor dst_h = dst.unsqueeze(1).expand({ei.size(0), H});  // hoisted: one plan
  at::Tensor h = x;
  for (int layer = 0; layer < 2; ++layer) {
    const at::Tensor &w1 = p[3 * layer], &b1 = p[3 * layer + 1], &w2 = p[3 * layer + 2];
    at::Tensor m = at::cat({h.index_select(0, src), h.index_select(0, dst), e}, 1);
    m = at::relu(at::linear(m, w1, b1));
    at::Tensor sum = h.new_zeros({N, H}).index_add(0, dst, m);
    at::Tensor mean = h.new_zeros({N, H}).scatter_reduce(0, dst_h, m, "mean", false);
    h = at::tanh(at::linear(at::cat({h, sum, mean}, 1), w2));
  }
  return h;
}

std::vector<at::Tensor> mp_params(int64_t F, int64_t Fe, int64_t H) {
  return {rnd({H, 2 * F + Fe}, 20, 0.4), rnd({H}, 21, 0.1), rnd({F, F + 2 * H}, 22, 0.3),
          rnd({H, 2 * F + Fe}, 23, 0.4), rnd({H}, 24, 0.1), rnd({F, F + 2 * H}, 25, 0.3)};
}

TEST(GraphOps, TwoLayerNetworkWithPlainOpsEqualsSingleProcess) {
  auto mesh = test_mesh();
  // A random graph (ghosts from everywhere) and a local one.
  Graph g = local_graph(31, 3, 30);
  at::Tensor random_ei = at::stack({randint(g.N, {g.E}, 31), randint(g.N, {g.E}, 32)}, 1);
  auto params = mp_params(4, 2, 5);
  for (const at::Tensor& ei : {g.ei, random_ei}) {
    for (bool empty_nodes : {true, false}) {
      auto fb = fallbacks_of([&] {
        EXPECT_TRUE(
            reference_check(mp_network,
                            {nodes(mesh, g.x, empty_nodes), edges(mesh, ei, !empty_nodes, false),
                             edges(mesh, g.e, !empty_nodes)},
                            mesh, params, 1e-5, 1e-5))
            << "empty nodes " << empty_nodes;
      });
      EXPECT_EQ(fb.first, 0);
      EXPECT_EQ(fb.second, 0);
    }
  }
}

TEST(GraphOps, OnlyGhostRowsMove) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size(0);
  Graph g = local_graph(4000, 4, 40);
  const int64_t F = g.x.size(1);
  auto sx = st::distribute_tensor(g.x, mesh, fit_placements(mesh, kRows), true);
  auto sei = st::distribute_tensor(g.ei, mesh, fit_placements(mesh, kRows));
  at::Tensor src = sei.select(1, 0);
  sx.index_select(0, src);  // builds the plan
  // The exact ghost traffic of one exchange, from a plan of the same ids.
  st::GhostPlan plan = st::ghost_plan(sx, st::ShardTensor(src).local().flatten());
  const int64_t ghost_bytes = plan.num_send_rows() * F * 4;
  st::reset_comm_stats();
  at::Tensor y = sx.index_select(0, src);
  const auto fwd = st::comm_stats();
  st::backward(y, at::ones(y.sizes()));
  const auto both = st::comm_stats();
  // Forward: the owned rows that peers need, plus the cache agreement (one
  // all-reduce of five int64); backward: the gradients of this rank's ghost
  // rows, back to their owners (ghost_accumulate).
  EXPECT_GE(fwd.bytes_sent, ghost_bytes);
  EXPECT_LE(fwd.bytes_sent, ghost_bytes + 128);
  EXPECT_EQ(both.bytes_sent - fwd.bytes_sent, plan.num_ghost() * F * 4);
  EXPECT_EQ(both.gathered_bytes, 0);
  // An all-gather of x receives (P - 1) / P of it on every rank.
  const int64_t allgather = g.N * F * 4 * (P - 1) / P;
  if (P > 1) {
    EXPECT_LT(fwd.bytes_received * 20, allgather)
        << fwd.bytes_received << " bytes received vs " << allgather << " for an all-gather";
  }
  if (mesh.rank() == 0) {
    std::printf(
        "[ graph ] index_select of %lld x %lld nodes by %lld edges at P = %lld: "
        "%lld bytes sent by rank 0 (ghost rows %lld), an all-gather receives %lld\n",
        static_cast<long long>(g.N), static_cast<long long>(F), static_cast<long long>(g.E),
        static_cast<long long>(P), static_cast<long long>(fwd.bytes_sent),
        static_cast<long long>(ghost_bytes), static_cast<long long>(allgather));
  }
  // The whole network: still no gather, and far less than one all-gather per use.
  auto params = mp_params(F, 2, 5);
  for (auto& p : params) p.requires_grad_(true);
  auto se = st::distribute_tensor(g.e, mesh, fit_placements(mesh, kRows), true);
  mp_network({sx, sei, se}, params);  // warm the plans
  st::reset_comm_stats();
  // Strict mode refuses every gather: the network runs anyway.
  struct StrictOn {
    bool was = st::strict();
    StrictOn() { st::set_strict(true); }
    ~StrictOn() { st::set_strict(was); }
  };
  std::pair<int64_t, int64_t> fb;
  {
    StrictOn strict;
    fb = fallbacks_of([&] { st::backward(mp_network({sx, sei, se}, params).sum()); });
  }
  EXPECT_EQ(fb.first, 0);
  EXPECT_EQ(fb.second, 0);
}

// ---- the plan cache -------------------------------------------------------------

TEST(GraphOps, PlanCacheReusesAndRebuilds) {
  auto mesh = test_mesh();
  const int64_t N = 21, E = 33;
  at::Tensor x = rnd({N, 2}, 50);
  at::Tensor ids = randint(N, {E}, 51);
  auto sx =
      st::distribute_tensor(x, mesh, fit_placements(mesh, kRows), false,
                            sizes_with_empty_first(mesh, fit_placements(mesh, kRows), x.sizes()));
  auto sidx = st::distribute_tensor(ids, mesh, fit_placements(mesh, kRows));
  st::ops::clear_index_plan_cache();
  auto check = [&](const at::Tensor& full_ids) {
    return all_close(gathered(sx.index_select(0, sidx)), x.index_select(0, full_ids), 0, 0);
  };
  EXPECT_TRUE(check(ids));
  EXPECT_TRUE(check(ids));
  auto s = st::ops::index_plan_cache_stats();
  EXPECT_EQ(s.builds, 1);
  EXPECT_EQ(s.reuses, 1);
  // An in-place write bumps the version counter: rebuilt.
  at::Tensor ids2 = randint(N, {E}, 52);
  sidx.copy_(st::distribute_tensor(ids2, mesh, fit_placements(mesh, kRows)));
  EXPECT_TRUE(check(ids2));
  EXPECT_EQ(st::ops::index_plan_cache_stats().builds, 2);
  // One rank's piece changes, the others' do not: every rank rebuilds.
  if (mesh.rank() == mesh.size() - 1) st::ShardTensor(sidx).local().add_(0);
  EXPECT_TRUE(check(ids2));
  s = st::ops::index_plan_cache_stats();
  EXPECT_EQ(s.builds, 3);
  EXPECT_EQ(s.reuses, 1);
  // A new tensor with the same ids: a new plan; the dead one's entry goes.
  sidx = st::distribute_tensor(ids2, mesh, fit_placements(mesh, kRows));
  EXPECT_TRUE(check(ids2));
  s = st::ops::index_plan_cache_stats();
  EXPECT_EQ(s.builds, 4);
  EXPECT_EQ(s.entries, 1u);
  // Bounded.
  std::vector<at::Tensor> keep;
  for (size_t i = 0; i < st::ops::kMaxIndexPlans + 3; ++i) {
    keep.push_back(st::distribute_tensor(ids, mesh, fit_placements(mesh, kRows)));
    sx.index_select(0, keep.back());
  }
  EXPECT_EQ(st::ops::index_plan_cache_stats().entries, st::ops::kMaxIndexPlans);
  // Inference tensors have no version counter: used, never cached.
  const int64_t before = st::ops::index_plan_cache_stats().builds;
  at::Tensor y1, y2;
  {
    c10::InferenceMode guard;
    auto sinf = st::distribute_tensor(ids, mesh, fit_placements(mesh, kRows));
    y1 = sx.index_select(0, sinf);
    y2 = sx.index_select(0, sinf);
  }
  EXPECT_TRUE(all_close(gathered(y1), x.index_select(0, ids), 0, 0));
  EXPECT_TRUE(all_close(gathered(y2), x.index_select(0, ids), 0, 0));
  EXPECT_EQ(st::ops::index_plan_cache_stats().builds, before + 2);
  st::ops::clear_index_plan_cache();
}

// ---- errors and fallbacks -------------------------------------------------------

TEST(GraphOps, BadInputThrowsEverywhere) {
  auto mesh = test_mesh();
  const int64_t N = 10, E = 12;
  const P rows = fit_placements(mesh, kRows);
  auto sx = st::distribute_tensor(rnd({N, 2}, 60), mesh, rows, true);
  at::Tensor ids = randint(N, {E}, 61);
  for (int64_t bad : {N, int64_t{-1}}) {
    at::Tensor b = ids.clone();
    b[E - 1] = bad;  // on the last coordinate's piece only
    auto sb = st::distribute_tensor(b, mesh, rows);
    EXPECT_TRUE(throws_everywhere([&] { sx.index_select(0, sb); },
                                  {"aten::index_select", "index out of range", "Shard(0)"}));
  }
  auto sidx2 = st::distribute_tensor(randint(N, {E, 2}, 62), mesh, rows);
  auto src_even = st::distribute_tensor(rnd({E, 2}, 63), mesh, rows);
  auto src_empty = st::distribute_tensor(rnd({E, 2}, 63), mesh, rows, false,
                                         sizes_with_empty_first(mesh, rows, {E, 2}));
  at::Tensor y = sx * 1;
  // src sharded like the index but with other sizes: repartitioned to the
  // index's rows (Note [index ops along any dim]), exact.
  EXPECT_TRUE(all_close(gathered(y.scatter_add(0, sidx2, src_empty)),
                        gathered(y).scatter_add(0, gathered(sidx2), gathered(src_empty)), 1e-6,
                        1e-6));
  EXPECT_TRUE(throws_everywhere([&] { y.scatter_add(0, sidx2, src_even.to(at::kDouble)); },
                                {"aten::scatter_add", "same dtype"}));
  EXPECT_TRUE(throws_everywhere([&] { y.scatter_reduce(0, sidx2, src_even, "median"); },
                                {"aten::scatter_reduce", "median"}));
  EXPECT_TRUE(throws_everywhere([&] { sx.index_add_(0, sidx2.select(1, 0), src_even); },
                                {"aten::index_add_", "leaf"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        sx.gather(0, st::distribute_tensor(randint(N, {E, 3}, 64), mesh, rows));
      },
      {"aten::gather", "index.size(1)"}));
}

TEST(GraphOps, OtherLayoutsKeepTheExactFallback) {
  auto mesh = test_mesh();
  const int64_t N = 12, E = 9;
  const P rows = fit_placements(mesh, kRows);
  at::Tensor x = rnd({N, N}, 70);
  at::Tensor ids = randint(N, {E}, 71);
  auto sx = st::distribute_tensor(x, mesh, rows);
  // sparse_grad, and dim 1 by an index sharded along the mesh dim that
  // shards the nodes (the result cannot be sharded twice along one mesh dim).
  // A plain (replicated) index and other dims are rules now (test_index_ops).
  at::Tensor ids2 = randint(N, {E, N}, 72);
  auto fb = fallbacks_of([&] {
    EXPECT_TRUE(all_close(gathered(sx.gather(0, st::distribute_tensor(ids2, mesh, rows), true)),
                          x.gather(0, ids2), 0, 0));
    EXPECT_TRUE(all_close(gathered(sx.index_select(1, st::distribute_tensor(ids, mesh, rows))),
                          x.index_select(1, ids), 0, 0));
  });
  EXPECT_EQ(fb.first, 2);
  if (mesh.size(0) > 1) EXPECT_GT(fb.second, 0);  // the fallback's gather, counted
}

}  // namespace
