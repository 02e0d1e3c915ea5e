// Index halos (GhostPlan, ghost_exchange, ghost_accumulate) and message
// passing through them (shardtensor/ops/graph.h): values against the full
// tensor, dot-product adjoint tests, double backward, float64 accumulation,
// and a message-passing layer (gather, edge MLP, scatter sum/mean/amax)
// against single-process libtorch on the whole graph. Nodes are sharded
// unevenly with an empty first piece; on the 2x2 mesh rows are sharded along
// mesh dim 0 and replicated along mesh dim 1.
#include <ATen/CPUGeneratorImpl.h>
#include <shardtensor/comm/ghost.h>
#include <shardtensor/ops/graph.h>
#include <torch/torch.h>

#include <vector>

#include "comm/agree.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

at::Tensor randn64(c10::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

at::Tensor randint(int64_t hi, c10::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(hi, shape, gen, at::kLong);
}

/// Rows per coordinate of mesh dim 0: the first empty, the rest balanced.
std::vector<int64_t> empty_first(int64_t n, int64_t P) {
  std::vector<int64_t> s(P, 0);
  if (P == 1) return {n};
  for (int64_t i = 1; i < P; ++i) s[i] = n / (P - 1) + (i - 1 < n % (P - 1) ? 1 : 0);
  return s;
}

int64_t offset_of(const std::vector<int64_t>& s, int64_t c) {
  int64_t o = 0;
  for (int64_t i = 0; i < c; ++i) o += s[i];
  return o;
}

/// A plan over mesh dim 0 with random needs that differ per rank.
struct Fixture {
  st::DeviceMesh mesh = test_mesh();
  int64_t N = 37;
  std::vector<int64_t> sizes = empty_first(N, mesh.size(0));
  int64_t me = mesh.coordinate()[0];
  int64_t off = offset_of(sizes, me);
  at::Tensor needed = randint(N, {15}, 100 + me);
  st::GhostPlan plan = st::GhostPlan::build(mesh, 0, sizes, needed);
};

double global_dot(const st::DeviceMesh& mesh, const at::Tensor& a, const at::Tensor& b) {
  // Sum of local dots over mesh dim 0 (rows are replicated along dim 1).
  at::Tensor d = (a * b).sum().reshape({1}).to(at::kDouble);
  return st::comm::all_reduce(d, mesh, {0}).item<double>();
}

TEST(Ghost, ExchangeGivesOwnedThenSortedGhostRows) {
  Fixture f;
  at::Tensor full = randn64({f.N, 3}, 7);
  at::Tensor owned = full.narrow(0, f.off, f.sizes[f.me]);
  at::Tensor ext = st::ghost_exchange(owned, f.plan);
  // Expected ghosts: the unique needed ids not owned here, sorted.
  auto u = std::get<0>(at::_unique(f.needed, /*sorted=*/true));
  auto mask = u.lt(f.off).logical_or(u.ge(f.off + f.sizes[f.me]));
  at::Tensor ghost_ids = u.masked_select(mask);
  EXPECT_TRUE(all_ranks(at::equal(f.plan.ghost_ids(), ghost_ids)));
  at::Tensor expect = at::cat({owned, full.index_select(0, ghost_ids)});
  EXPECT_TRUE(all_close(ext, expect, 0, 0));
  // local_index maps every needed id to its row.
  at::Tensor rows = f.plan.local_index(f.needed);
  EXPECT_TRUE(all_close(ext.index_select(0, rows), full.index_select(0, f.needed), 0, 0));
}

TEST(Ghost, AdjointDotProduct) {
  Fixture f;
  const int64_t n = f.plan.num_owned(), ne = f.plan.num_extended();
  at::Tensor x = randn64({n, 2}, 11 + f.me), y = randn64({ne, 2}, 21 + f.me);
  const double lhs = global_dot(f.mesh, st::ghost_exchange(x, f.plan), y);
  const double rhs = global_dot(f.mesh, x, st::ghost_accumulate(y, f.plan));
  EXPECT_TRUE(all_ranks(std::abs(lhs - rhs) <= 1e-10 * (1 + std::abs(lhs))))
      << lhs << " vs " << rhs;
  // Each is the other's backward, and double backward works.
  at::Tensor xs = x.clone().requires_grad_(true);
  at::Tensor g = torch::autograd::grad({st::ghost_exchange(xs, f.plan)}, {xs}, {y},
                                       /*retain_graph=*/true, /*create_graph=*/true)[0];
  EXPECT_TRUE(all_close(g, st::ghost_accumulate(y, f.plan), 0, 0));
  at::Tensor ys = y.clone().requires_grad_(true);
  at::Tensor ga = torch::autograd::grad({st::ghost_accumulate(ys, f.plan)}, {ys}, {x},
                                        /*retain_graph=*/true, /*create_graph=*/true)[0];
  EXPECT_TRUE(all_close(ga, st::ghost_exchange(x, f.plan), 0, 0));
  // d/dy <accumulate(y), x> = exchange(x) is itself differentiable in x.
  at::Tensor x2 = x.clone().requires_grad_(true);
  at::Tensor ys2 = y.clone().requires_grad_(true);
  at::Tensor gy = torch::autograd::grad({(st::ghost_accumulate(ys2, f.plan) * x2).sum()}, {ys2}, {},
                                        true, true)[0];
  at::Tensor z = randn64({ne, 2}, 31 + f.me);
  at::Tensor gx = torch::autograd::grad({(gy * z).sum()}, {x2})[0];
  EXPECT_TRUE(all_close(gx, st::ghost_accumulate(z, f.plan), 1e-12, 1e-12));
}

TEST(Ghost, Float64AccumulationOfFloat32) {
  Fixture f;
  const int64_t ne = f.plan.num_extended();
  at::Tensor y = (randn64({ne, 4}, 41 + f.me) * 1e3 + 1e7).to(at::kFloat);
  at::Tensor wide = st::ghost_accumulate(y.to(at::kDouble), f.plan);
  at::Tensor acc =
      st::ghost_accumulate(y, f.plan, st::GhostOptions().accumulate_dtype(at::kDouble));
  EXPECT_EQ(acc.scalar_type(), at::kFloat);
  EXPECT_TRUE(all_close(acc.to(at::kDouble), wide.to(at::kFloat).to(at::kDouble), 0, 0));
}

TEST(Ghost, BadInputThrowsEverywhere) {
  st::DeviceMesh mesh = test_mesh();
  const int64_t P = mesh.size(0);
  std::vector<int64_t> sizes(P, 3);
  const bool bad = mesh.rank() == mesh.size() - 1;
  at::Tensor ids = bad ? at::tensor(std::vector<int64_t>{0, 3 * P}, at::kLong)
                       : at::tensor(std::vector<int64_t>{0}, at::kLong);
  EXPECT_TRUE(throws_everywhere([&] { st::GhostPlan::build(mesh, 0, sizes, ids); },
                                {"GhostPlan::build", "needed_ids"}));
  EXPECT_TRUE(throws_everywhere(
      [&] { st::GhostPlan::build(mesh, 0, std::vector<int64_t>(P + 1, 1), ids); }, {"sizes"}));
}

// ---- message passing against single-process -------------------------------------

/// One message-passing layer: edge MLP on [x_src, x_dst, e], reduced into the
/// destination nodes, then a node update.
at::Tensor mp_layer(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p,
                    st::ScatterReduce reduce) {
  const at::Tensor &x = in[0], &ei = in[1], &e = in[2];
  auto edge_mlp = [&](const at::Tensor& m) {
    return at::linear(at::tanh(at::linear(m, p[0], p[1])), p[2], p[3]);
  };
  if (!st::ShardTensor::is_shard_tensor(x)) {
    at::Tensor m =
        at::cat({x.index_select(0, ei.select(1, 0)), x.index_select(0, ei.select(1, 1)), e}, 1);
    at::Tensor h = edge_mlp(m);
    const char* r = reduce == st::ScatterReduce::Sum    ? "sum"
                    : reduce == st::ScatterReduce::Mean ? "mean"
                                                        : "amax";
    at::Tensor base = at::zeros({x.size(0), h.size(1)}, h.options());
    at::Tensor agg = reduce == st::ScatterReduce::Sum
                         ? base.index_add(0, ei.select(1, 1), h)
                         : base.index_reduce(0, ei.select(1, 1), h, r, /*include_self=*/false);
    return at::linear(at::cat({x, agg}, 1), p[4]);
  }
  at::Tensor eil = st::ShardTensor(ei).local();
  st::GhostPlan plan = st::ghost_plan(x, eil.flatten());
  at::Tensor src = plan.local_index(eil.select(1, 0)), dst = plan.local_index(eil.select(1, 1));
  at::Tensor x_ext = st::extend_rows(x, plan);
  at::Tensor m = at::cat(
      {st::gather_rows(x_ext, src), st::gather_rows(x_ext, dst), st::ShardTensor(e).local()}, 1);
  at::Tensor h = edge_mlp(st::rows_like(m, e));
  at::Tensor agg = st::scatter_rows(h, dst, plan, st::ScatterOptions().reduce(reduce));
  return at::linear(at::cat({x, agg}, 1), p[4]);
}

void check_layer(st::ScatterReduce reduce) {
  st::DeviceMesh mesh = test_mesh();
  const int64_t N = 29, E = 71, F = 3, Fe = 2, H = 5;
  at::Tensor x = rnd({N, F}, 1);
  at::Tensor ei = randint(N, {E, 2}, 2);
  at::Tensor e = rnd({E, Fe}, 3);
  std::vector<at::Tensor> params = {rnd({8, 2 * F + Fe}, 4, 0.5), rnd({8}, 5, 0.1),
                                    rnd({H, 8}, 6, 0.5), rnd({H}, 7, 0.1), rnd({4, F + H}, 8, 0.5)};
  auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return mp_layer(in, p, reduce);
  };
  const st::Placements rows = {S0, R};
  EXPECT_TRUE(reference_check(fn,
                              {empty_first_input(mesh, x, rows),
                               sharded_input(mesh, ei, rows, false), sharded_input(mesh, e, rows)},
                              mesh, params, 1e-5, 1e-5));
  // Edges with an empty first piece too.
  EXPECT_TRUE(
      reference_check(fn,
                      {sharded_input(mesh, x, rows), empty_first_input(mesh, ei, rows, false),
                       empty_first_input(mesh, e, rows)},
                      mesh, params, 1e-5, 1e-5));
}

TEST(MessagePassing, SumEqualsSingleProcess) { check_layer(st::ScatterReduce::Sum); }
TEST(MessagePassing, MeanEqualsSingleProcess) { check_layer(st::ScatterReduce::Mean); }
TEST(MessagePassing, AmaxEqualsSingleProcess) { check_layer(st::ScatterReduce::Amax); }

TEST(MessagePassing, AmaxTiesSplitTheGradientLikeLibtorch) {
  st::DeviceMesh mesh = test_mesh();
  const int64_t N = 11, E = 40;
  at::Tensor x = rnd({N, 1}, 9);
  at::Tensor ei = randint(N, {E, 2}, 10);
  // Few distinct values: many ties. Kept away from 0: libtorch's amax
  // backward (1.13, and 2.13: index_reduce and scatter_reduce alike give two
  // messages of 0 into a zero base 1/3 each) also counts the excluded zero
  // base as a tie when the maximum is exactly 0, which scatter_rows does not.
  at::Tensor e = at::round(rnd({E, 2}, 11)) + 0.5;
  auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    const at::Tensor &x = in[0], &ei = in[1], &e = in[2];
    if (!st::ShardTensor::is_shard_tensor(x)) {
      return at::zeros({N, 2}).index_reduce(0, ei.select(1, 1), e, "amax", false);
    }
    at::Tensor eil = st::ShardTensor(ei).local();
    st::GhostPlan plan = st::ghost_plan(x, eil.flatten());
    return st::scatter_rows(e, plan.local_index(eil.select(1, 1)), plan,
                            st::ScatterOptions().reduce(st::ScatterReduce::Amax));
  };
  const st::Placements rows = {S0, R};
  EXPECT_TRUE(reference_check(fn,
                              {empty_first_input(mesh, x, rows, false),
                               sharded_input(mesh, ei, rows, false), sharded_input(mesh, e, rows)},
                              mesh, {}, 1e-6, 1e-6));
}

TEST(MessagePassing, Float64AccumulationMatchesDoubleReference) {
  st::DeviceMesh mesh = test_mesh();
  const int64_t N = 13, E = 200;
  at::Tensor x = rnd({N, 1}, 12);
  at::Tensor ei = randint(N, {E, 2}, 13);
  at::Tensor e = rnd({E, 3}, 14, 1.0, 1e6);
  at::Tensor ref = at::zeros({N, 3}, at::kDouble).index_add(0, ei.select(1, 1), e.to(at::kDouble));
  auto sx =
      st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, R}), false,
                            sizes_with_empty_first(mesh, fit_placements(mesh, {S0, R}), x.sizes()));
  auto sei = st::distribute_tensor(ei, mesh, fit_placements(mesh, {S0, R}));
  auto se = st::distribute_tensor(e, mesh, fit_placements(mesh, {S0, R}));
  at::Tensor eil = st::ShardTensor(sei).local();
  st::GhostPlan plan = st::ghost_plan(sx, eil.flatten());
  at::Tensor out = st::scatter_rows(se, plan.local_index(eil.select(1, 1)), plan,
                                    st::ScatterOptions().accumulate_dtype(at::kDouble));
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_TRUE(all_close(gathered(out), ref.to(at::kFloat), 0, 0));
}

}  // namespace
