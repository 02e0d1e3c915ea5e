// Index ops along any dim of an N-d ShardTensor (Note [index ops along any
// dim], src/ops/graph_ops.cpp): index_select, gather, index_add, scatter_add,
// scatter_reduce, index_copy, index_fill, index_reduce and scatter(...,
// reduce=), and x[i, j] / index_put_ with several indices (Note [several
// indices], src/ops/index_ops.cpp), along the sharded dim H of a [B, C, H, W]
// field (with a replicated index and with an index sharded along the
// result's dim) and along the unsharded dim C (local, no communication),
// against single-process libtorch on the gathered tensors, forward and
// backward; the traffic (only the rows a rank lacks move; nothing along C);
// bad input.
//
// The field is sharded Shard(2) along mesh dim 0 (and Shard(3) along mesh
// dim 1 on the 2x2 mesh), balanced or with an empty first piece.
#include <ATen/CPUGeneratorImpl.h>
#include <shardtensor/dispatch/stats.h>
#include <torch/torch.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

const int64_t B = 2, C = 3, H = 11, W = 5;
const st::Placements kField = {S2, S3};  // fitted to the mesh
const st::Placements kEntries = {S0, R};

at::Tensor randint(int64_t hi, c10::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(hi, shape, gen, at::kLong);
}

/// `n` distinct ids in [0, hi) (index_copy: libtorch leaves duplicates undefined).
at::Tensor distinct(int64_t hi, int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randperm(hi, gen, at::kLong).narrow(0, 0, n);
}

RefInput field(const st::DeviceMesh& mesh, const at::Tensor& full, bool empty, bool rg = true) {
  return empty ? empty_first_input(mesh, full, kField, rg) : sharded_input(mesh, full, kField, rg);
}
/// A 1-D index (or a tensor of entries) sharded along dim 0 over mesh dim 0.
RefInput entries(const st::DeviceMesh& mesh, const at::Tensor& full, bool empty, bool rg = false) {
  const st::Placements p = fit_placements(mesh, kEntries);
  return empty ? empty_first_input(mesh, full, p, rg) : sharded_input(mesh, full, p, rg);
}
RefInput plain(const at::Tensor& full, bool rg = false) { return RefInput{full, std::nullopt, rg}; }

/// Collective. dispatch_stats().fallbacks and comm_stats().gathered_bytes of `fn`.
std::pair<int64_t, int64_t> fallbacks_of(const std::function<void()>& fn) {
  st::reset_dispatch_stats();
  st::reset_comm_stats();
  fn();
  return {st::dispatch_stats().fallbacks, st::comm_stats().gathered_bytes};
}

struct StrictOn {
  bool was = st::strict();
  StrictOn() { st::set_strict(true); }
  ~StrictOn() { st::set_strict(was); }
};

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble};
double tol(at::ScalarType dt) { return dt == at::kDouble ? 1e-12 : 1e-5; }

using Fn = RefFn;
Fn op(std::function<at::Tensor(const std::vector<at::Tensor>&)> f) {
  return [f](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) { return f(in); };
}

/// Runs reference_check in strict mode (a gather anywhere throws) and checks
/// that nothing fell back.
void check(const std::string& what, const Fn& fn, const std::vector<RefInput>& in,
           const st::DeviceMesh& mesh, double t) {
  auto fb = fallbacks_of([&] {
    StrictOn strict;
    EXPECT_TRUE(reference_check(fn, in, mesh, {}, t, t)) << what;
  });
  EXPECT_EQ(fb.first, 0) << what;
  EXPECT_EQ(fb.second, 0) << what;
}

// ---- along the sharded dim ------------------------------------------------------

TEST(IndexOps, SelectionsAlongTheShardedDimEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t E = 9;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 1).to(dt);
    at::Tensor idx = randint(H, {E}, 2);            // duplicates
    at::Tensor idx4 = randint(H, {B, C, E, W}, 3);  // gather
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      auto sel = op([](auto& in) { return in[0].index_select(2, in[1]); });
      auto gat = op([](auto& in) { return in[0].gather(-2, in[1]); });
      check("index_select, replicated index" + tag, sel, {field(mesh, x, empty), plain(idx)}, mesh,
            tol(dt));
      check("index_select, sharded index" + tag, sel,
            {field(mesh, x, empty), entries(mesh, idx, !empty)}, mesh, tol(dt));
      check("gather, replicated index" + tag, gat, {field(mesh, x, empty), plain(idx4)}, mesh,
            tol(dt));
      check("gather, sharded index" + tag, gat,
            {field(mesh, x, empty), field(mesh, idx4, !empty, false)}, mesh, tol(dt));
    }
  }
}

TEST(IndexOps, EmptyIndexAndOneDimensionalSelf) {
  auto mesh = test_mesh();
  at::Tensor x = rnd({B, C, H, W}, 95);
  at::Tensor none = at::zeros({0}, at::kLong);
  check("index_select by an empty index", op([](auto& in) { return in[0].index_select(2, in[1]); }),
        {field(mesh, x, true), plain(none)}, mesh, 1e-6);
  check("index_add of nothing", op([](auto& in) { return in[0].index_add(2, in[1], in[2]); }),
        {field(mesh, x, false), plain(none), plain(rnd({B, C, 0, W}, 96), true)}, mesh, 1e-6);
  at::Tensor v = rnd({H}, 97);
  at::Tensor ids = randint(H, {15}, 98);
  check("1-D self, replicated index", op([](auto& in) { return in[0].index_select(0, in[1]); }),
        {RefInput{v, fit_placements(mesh, {S0, R}), true}, plain(ids)}, mesh, 1e-6);
  check("1-D self, gather by a sharded index", op([](auto& in) { return in[0].gather(0, in[1]); }),
        {RefInput{v, fit_placements(mesh, {S0, R}), true}, entries(mesh, ids, true)}, mesh, 1e-6);
}

TEST(IndexOps, ReductionsAlongTheShardedDimEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t E = 13;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 4).to(dt);
    at::Tensor idx = randint(H, {E}, 5);  // duplicates: sums across ranks
    at::Tensor idx4 = randint(H, {B, C, E, W}, 6);
    at::Tensor src = rnd({B, C, E, W}, 7).to(dt);
    at::Tensor ids = distinct(H, 7, 8);
    at::Tensor src7 = rnd({B, C, 7, W}, 9).to(dt);
    // 7 distinct rows of H per (b, c, w) column.
    at::Tensor perm4 =
        at::argsort(rnd({B, C, H, W}, 90), int64_t{2}, false).narrow(2, 0, 7).contiguous();
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      auto iadd = op([](auto& in) { return in[0].index_add(2, in[1], in[2], 0.5); });
      auto sadd = op([](auto& in) { return in[0].scatter_add(2, in[1], in[2]); });
      auto icopy = op([](auto& in) { return in[0].index_copy(2, in[1], in[2]); });
      check("index_add, replicated index and src" + tag, iadd,
            {field(mesh, x, empty), plain(idx), plain(src, true)}, mesh, tol(dt));
      check("index_add, sharded index and src" + tag, iadd,
            {field(mesh, x, empty), entries(mesh, idx, !empty), field(mesh, src, !empty)}, mesh,
            tol(dt));
      check("index_add, replicated index, sharded src" + tag, iadd,
            {field(mesh, x, empty), plain(idx), field(mesh, src, !empty)}, mesh, tol(dt));
      check("scatter_add, replicated index and src" + tag, sadd,
            {field(mesh, x, empty), plain(idx4), plain(src, true)}, mesh, tol(dt));
      check("scatter_add, sharded index and src" + tag, sadd,
            {field(mesh, x, empty), field(mesh, idx4, !empty, false), field(mesh, src, !empty)},
            mesh, tol(dt));
      for (const char* reduce : {"sum", "mean", "amax", "prod"}) {
        for (bool include_self : {true, false}) {
          auto sred = op([reduce, include_self](auto& in) {
            return in[0].scatter_reduce(2, in[1], in[2], reduce, include_self);
          });
          check(std::string("scatter_reduce ") + reduce +
                    " include_self=" + std::to_string(include_self) + tag,
                sred,
                {field(mesh, x, empty), field(mesh, idx4, !empty, false), field(mesh, src, !empty)},
                mesh, tol(dt));
        }
      }
      check("index_copy, replicated index and src" + tag, icopy,
            {field(mesh, x, empty), plain(ids), plain(src7, true)}, mesh, tol(dt));
      check("index_copy, sharded index and src" + tag, icopy,
            {field(mesh, x, empty), entries(mesh, ids, !empty), field(mesh, src7, !empty)}, mesh,
            tol(dt));
      // scatter: distinct positions per column (libtorch leaves duplicates undefined).
      auto scat = op([](auto& in) { return in[0].scatter(2, in[1], in[2]); });
      check("scatter, replicated index and src" + tag, scat,
            {field(mesh, x, empty), plain(perm4), plain(src7, true)}, mesh, tol(dt));
      check("scatter, sharded index and src" + tag, scat,
            {field(mesh, x, empty), field(mesh, perm4, !empty, false), field(mesh, src7, !empty)},
            mesh, tol(dt));
      check("scatter value, sharded index" + tag,
            op([](auto& in) { return in[0].scatter(-2, in[1], 1.25); }),
            {field(mesh, x, empty), field(mesh, perm4, empty, false)}, mesh, tol(dt));
      check("scatter_ (in place)" + tag, op([](auto& in) {
              at::Tensor y = in[0] - 1;
              return y.scatter_(2, in[1], in[2]);
            }),
            {field(mesh, x, empty), plain(perm4), field(mesh, src7, empty)}, mesh, tol(dt));
      auto fill = op([](auto& in) { return in[0].index_fill(2, in[1], -3.5); });
      check("index_fill, replicated index" + tag, fill, {field(mesh, x, empty), plain(idx)}, mesh,
            tol(dt));
      check("index_fill, sharded index" + tag, fill,
            {field(mesh, x, empty), entries(mesh, idx, !empty)}, mesh, tol(dt));
      // In place, on a non-leaf copy.
      auto inplace = op([](auto& in) {
        at::Tensor y = in[0] * 2;
        y.index_add_(2, in[1], in[2], -1.5);
        y.index_fill_(2, in[1].narrow(0, 0, 2), 0.25);
        return y.scatter_add_(2, in[3], in[4]);
      });
      check("index_add_ / index_fill_ / scatter_add_" + tag, inplace,
            {field(mesh, x, empty), plain(idx), plain(src, true), plain(idx4), plain(src, true)},
            mesh, tol(dt));
      auto copy_ = op([](auto& in) {
        at::Tensor y = in[0] + 1;
        return y.index_copy_(2, in[1], in[2]);
      });
      check("index_copy_" + tag, copy_,
            {field(mesh, x, empty), entries(mesh, ids, empty), field(mesh, src7, empty)}, mesh,
            tol(dt));
    }
  }
}

// ---- legacy scatter reductions, index_reduce ------------------------------------------

/// Values only (libtorch has no derivative for scatter(..., reduce): 1.13, and
/// 2.13 raises "derivative for aten::scatter is not implemented"):
/// strict, nothing falls back.
void check_values(const std::string& what, const Fn& fn, const std::vector<RefInput>& in,
                  const st::DeviceMesh& mesh, double t) {
  auto fb = fallbacks_of([&] {
    StrictOn strict;
    EXPECT_TRUE(reference_check(fn, in, mesh, {}, t, t, /*check_backward=*/false)) << what;
  });
  EXPECT_EQ(fb.first, 0) << what;
  EXPECT_EQ(fb.second, 0) << what;
}

TEST(IndexOps, LegacyScatterReductionsAndIndexReduceEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t E = 13;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 60, 0.2, 1.0).to(dt);  // near 1: products stay tame
    at::Tensor idx = randint(H, {E}, 61);                   // duplicates
    at::Tensor idx4 = randint(H, {B, C, E, W}, 62);
    at::Tensor src = rnd({B, C, E, W}, 63, 0.2, 1.0).to(dt);
    at::Tensor cidx = randint(C, {5}, 64);
    at::Tensor csrc = rnd({B, 5, H, W}, 65, 0.2, 1.0).to(dt);
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      for (const char* reduce : {"add", "multiply"}) {
        const std::string r = std::string(" ") + reduce + tag;
        auto sred = op([reduce](auto& in) { return in[0].scatter(2, in[1], in[2], reduce); });
        check_values("scatter.reduce, sharded index and src" + r, sred,
                     {field(mesh, x, empty, false), field(mesh, idx4, !empty, false),
                      field(mesh, src, !empty, false)},
                     mesh, tol(dt));
        check_values("scatter.reduce, replicated index and src" + r, sred,
                     {field(mesh, x, empty, false), plain(idx4), plain(src)}, mesh, tol(dt));
        auto vred = op([reduce](auto& in) { return in[0].scatter(-2, in[1], 1.25, reduce); });
        check_values("scatter.value_reduce, sharded index" + r, vred,
                     {field(mesh, x, empty, false), field(mesh, idx4, empty, false)}, mesh,
                     tol(dt));
        check_values("scatter.value_reduce, replicated index" + r, vred,
                     {field(mesh, x, empty, false), plain(idx4)}, mesh, tol(dt));
        check_values("scatter_.reduce and scatter_.value_reduce (in place)" + r,
                     op([reduce](auto& in) {
                       at::Tensor y = in[0] * 1.5;
                       y.scatter_(2, in[1], in[2], reduce);
                       return y.scatter_(2, in[1], 0.75, reduce);
                     }),
                     {field(mesh, x, empty, false), field(mesh, idx4, empty, false),
                      field(mesh, src, empty, false)},
                     mesh, tol(dt));
        check_values(
            "scatter.reduce along the unsharded dim" + r,
            op([reduce](auto& in) { return in[0].scatter(1, in[1], in[2], reduce); }),
            {field(mesh, x, empty, false), field(mesh, randint(C, {B, 2, H, W}, 66), empty, false),
             field(mesh, rnd({B, 2, H, W}, 67, 0.2, 1.0).to(dt), empty, false)},
            mesh, tol(dt));
      }
      for (const char* reduce : {"prod", "mean", "amax", "amin"}) {
        for (bool include_self : {true, false}) {
          const std::string r =
              std::string(" ") + reduce + " include_self=" + std::to_string(include_self) + tag;
          auto ired = op([reduce, include_self](auto& in) {
            return in[0].index_reduce(2, in[1], in[2], reduce, include_self);
          });
          check("index_reduce, replicated index and src" + r, ired,
                {field(mesh, x, empty), plain(idx), plain(src, true)}, mesh, tol(dt));
          check("index_reduce, sharded index and src" + r, ired,
                {field(mesh, x, empty), entries(mesh, idx, !empty), field(mesh, src, !empty)}, mesh,
                tol(dt));
          check("index_reduce_ (in place)" + r, op([reduce, include_self](auto& in) {
                  at::Tensor y = in[0] * 0.5;
                  return y.index_reduce_(2, in[1], in[2], reduce, include_self);
                }),
                {field(mesh, x, empty), plain(idx), field(mesh, src, empty)}, mesh, tol(dt));
          check("index_reduce along the unsharded dim" + r, op([reduce, include_self](auto& in) {
                  return in[0].index_reduce(1, in[1], in[2], reduce, include_self);
                }),
                {field(mesh, x, empty), plain(cidx), field(mesh, csrc, empty)}, mesh, tol(dt));
        }
      }
    }
  }
  // Ties for amax: equal entries and self split the gradient evenly, as in libtorch.
  at::Tensor xt = at::zeros({B, C, H, W});
  at::Tensor st_ = at::zeros({B, C, E, W});
  at::Tensor tidx = randint(H, {E}, 70);  // duplicates
  check("index_reduce amax with ties",
        op([](auto& in) { return in[0].index_reduce(2, in[1], in[2], "amax", true); }),
        {field(mesh, xt, false), entries(mesh, tidx, false), field(mesh, st_, false)}, mesh, 1e-6);
  // Integer mean: floor division, as libtorch.
  at::Tensor xi = randint(100, {B, C, H, W}, 68), si = randint(100, {B, C, E, W}, 69);
  check_values("index_reduce mean on int64",
               op([](auto& in) { return in[0].index_reduce(2, in[1], in[2], "mean", true); }),
               {field(mesh, xi, true, false), plain(tidx), field(mesh, si, false, false)}, mesh, 0);
  // Bad reductions raise on every rank, naming the op.
  at::Tensor x = rnd({B, C, H, W}, 71), src = rnd({B, C, E, W}, 72);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, kField)));
  EXPECT_TRUE(throws_everywhere([&] { (void)sx.index_reduce(2, tidx, src, "sum"); },
                                {"aten::index_reduce", "prod, mean, amax or amin"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (void)sx.scatter(2, randint(H, {B, C, E, W}, 73), src, "max");
      },
      {"aten::scatter.reduce", "add or multiply"}));
}

// ---- several indices (Note [several indices], src/ops/index_ops.cpp) -------------------

at::Tensor index_at(const at::Tensor& x, int64_t first, const std::vector<at::Tensor>& ids) {
  c10::List<c10::optional<at::Tensor>> l;
  for (int64_t i = 0; i < first; ++i) l.push_back(c10::nullopt);
  for (const auto& t : ids) l.push_back(t);
  return at::index(x, l);
}

c10::List<c10::optional<at::Tensor>> list_at(int64_t first, const std::vector<at::Tensor>& ids) {
  c10::List<c10::optional<at::Tensor>> l;
  for (int64_t i = 0; i < first; ++i) l.push_back(c10::nullopt);
  for (const auto& t : ids) l.push_back(t);
  return l;
}

TEST(IndexOps, SeveralIndicesEqualSingleProcess) {
  auto mesh = test_mesh();
  const int64_t E = 9;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 80).to(dt);
    at::Tensor i = randint(H, {E}, 81) - 3;  // duplicates and negative ids
    at::Tensor j = randint(W, {E}, 82);
    at::Tensor c = randint(C, {E}, 83);
    at::Tensor ic = randint(H, {4, 1}, 84), jr = randint(W, {1, 3}, 85);  // broadcast to [4, 3]
    at::Tensor v = rnd({B, C, E}, 86).to(dt), v1 = rnd({E}, 87).to(dt);
    at::Tensor ci = rnd({B, E, W}, 88).to(dt);
    at::Tensor di = distinct(H, E, 89);  // distinct (i, j) pairs
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      check("x[:, :, i, j]" + tag, op([](auto& in) {
              return index_at(in[0], 2, {in[1], in[2]});
            }),
            {field(mesh, x, empty), plain(i), plain(j)}, mesh, tol(dt));
      check("x[:, :, i, j], broadcast indices" + tag, op([](auto& in) {
              return index_at(in[0], 2, {in[1], in[2]});
            }),
            {field(mesh, x, empty), plain(ic), plain(jr)}, mesh, tol(dt));
      check("x[:, c, i] (an unsharded and a sharded dim)" + tag, op([](auto& in) {
              return index_at(in[0], 1, {in[1], in[2]}) * 2.0;
            }),
            {field(mesh, x, empty), plain(c), plain(i)}, mesh, tol(dt));
      check("x[:, c, i, j]" + tag, op([](auto& in) {
              return index_at(in[0], 1, {in[1], in[2], in[3]});
            }),
            {field(mesh, x, empty), plain(c), plain(i), plain(j)}, mesh, tol(dt));
      for (bool acc : {true, false}) {
        const at::Tensor& ii = acc ? i : di;
        const std::string a = std::string(acc ? " accumulate" : "") + tag;
        check("index_put(x, [:, :, i, j], v)" + a, op([acc](auto& in) {
                return at::index_put(in[0], list_at(2, {in[1], in[2]}), in[3], acc);
              }),
              {field(mesh, x, empty), plain(ii), plain(j), plain(v, true)}, mesh, tol(dt));
        check("index_put_ (in place), broadcast values" + a, op([acc](auto& in) {
                at::Tensor y = in[0] * 1.5;
                return y.index_put_(list_at(2, {in[1], in[2]}), in[3], acc);
              }),
              {field(mesh, x, empty), plain(ii), plain(j), plain(v1, true)}, mesh, tol(dt));
        check("index_put(x, [:, c, i], v)" + a, op([acc](auto& in) {
                return at::index_put(in[0], list_at(1, {in[1], in[2]}), in[3], acc);
              }),
              {field(mesh, x, empty), plain(acc ? c : distinct(C, 2, 90)),
               plain(acc ? ii : di.narrow(0, 0, 2)), plain(acc ? ci : ci.narrow(1, 0, 2), true)},
              mesh, tol(dt));
      }
    }
  }
  // An id out of range raises on every rank, naming the op.
  st::ShardTensor sx(
      st::distribute_tensor(rnd({B, C, H, W}, 91), mesh, fit_placements(mesh, kField)));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (void)index_at(sx, 2, {at::full({2}, H, at::kLong), at::zeros({2}, at::kLong)});
      },
      {"aten::index.Tensor", "out of bounds"}));
}

// ---- along an unsharded dim ---------------------------------------------------------

TEST(IndexOps, AlongAnUnshardedDimEqualsSingleProcess) {
  auto mesh = test_mesh();
  const int64_t E = 5;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 10).to(dt);
    at::Tensor idx = randint(C, {E}, 11);
    at::Tensor idx4 = randint(C, {B, E, H, W}, 12);
    at::Tensor src = rnd({B, E, H, W}, 13).to(dt);
    at::Tensor ids = distinct(C, 2, 14);
    at::Tensor src2 = rnd({B, 2, H, W}, 15).to(dt);
    const bool empty = dt == at::kDouble;
    const std::string tag = std::string(" ") + c10::toString(dt);
    check("index_select" + tag, op([](auto& in) { return in[0].index_select(1, in[1]); }),
          {field(mesh, x, empty), plain(idx)}, mesh, tol(dt));
    check("gather, index sharded like self" + tag,
          op([](auto& in) { return in[0].gather(1, in[1]); }),
          {field(mesh, x, empty), field(mesh, idx4, empty, false)}, mesh, tol(dt));
    check("gather, replicated index" + tag, op([](auto& in) { return in[0].gather(1, in[1]); }),
          {field(mesh, x, empty), plain(idx4)}, mesh, tol(dt));
    check("index_add, replicated src" + tag,
          op([](auto& in) { return in[0].index_add(1, in[1], in[2]); }),
          {field(mesh, x, empty), plain(idx), plain(src, true)}, mesh, tol(dt));
    check("scatter_reduce mean, sharded index and src" + tag,
          op([](auto& in) { return in[0].scatter_reduce(1, in[1], in[2], "mean", false); }),
          {field(mesh, x, empty), field(mesh, idx4, empty, false), field(mesh, src, empty)}, mesh,
          tol(dt));
    check("scatter_add, sharded index and src" + tag,
          op([](auto& in) { return in[0].scatter_add(1, in[1], in[2]); }),
          {field(mesh, x, empty), field(mesh, idx4, empty, false), field(mesh, src, empty)}, mesh,
          tol(dt));
    check("index_copy" + tag, op([](auto& in) { return in[0].index_copy(1, in[1], in[2]); }),
          {field(mesh, x, empty), plain(ids), field(mesh, src2, empty)}, mesh, tol(dt));
    check("scatter, index sharded like self" + tag,
          op([](auto& in) { return in[0].scatter(1, in[1], in[2]); }),
          {field(mesh, x, empty),
           field(mesh,
                 at::argsort(rnd({B, C, H, W}, 91), int64_t{1}, false).narrow(1, 0, 2).contiguous(),
                 empty, false),
           field(mesh, src2, empty)},
          mesh, tol(dt));
    check("index_fill" + tag, op([](auto& in) { return in[0].index_fill(-3, in[1], 2.0); }),
          {field(mesh, x, empty), plain(idx)}, mesh, tol(dt));
  }
  // A replicated self with a sharded index: the result is sharded like the index.
  at::Tensor x2 = rnd({H, W}, 16);
  at::Tensor ids = randint(H, {17}, 17);
  check("index_select of a replicated self by a sharded index",
        op([](auto& in) { return in[0].index_select(0, in[1]); }),
        {plain(x2, true), entries(mesh, ids, true)}, mesh, 1e-6);
}

// ---- index ops in disguise (Note [index disguises], src/ops/index_ops.cpp) -------------

TEST(IndexOps, RepeatTileAndRepeatInterleaveEqualSingleProcess) {
  auto mesh = test_mesh();
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 40).to(dt);
    at::Tensor reps = randint(3, {H}, 41);  // zeros included
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      check("repeat" + tag, op([](auto& in) {
              return in[0].repeat({2, 1, 2, 3, 2});
            }),
            {field(mesh, x, empty)}, mesh, tol(dt));
      check("repeat, zero along H" + tag, op([](auto& in) {
              return in[0].repeat({1, 2, 0, 1});
            }),
            {field(mesh, x, empty)}, mesh, tol(dt));
      check("tile" + tag, op([](auto& in) {
              return in[0].tile({3, 1});
            }),
            {field(mesh, x, empty)}, mesh, tol(dt));
      check("repeat_interleave int along H" + tag,
            op([](auto& in) { return in[0].repeat_interleave(3, 2); }), {field(mesh, x, empty)},
            mesh, tol(dt));
      check("repeat_interleave tensor along H" + tag,
            op([](auto& in) { return in[0].repeat_interleave(in[1], -2); }),
            {field(mesh, x, empty), plain(reps)}, mesh, tol(dt));
      check("repeat_interleave along C" + tag,
            op([](auto& in) { return in[0].repeat_interleave(2, 1); }), {field(mesh, x, empty)},
            mesh, tol(dt));
    }
  }
}

TEST(IndexOps, EmbeddingEqualsSingleProcess) {
  auto mesh = test_mesh();
  const int64_t V = 13, D = 4, T = 10;
  for (auto dt : kDtypes) {
    at::Tensor w = rnd({V, D}, 50).to(dt);
    at::Tensor tok = randint(V, {2, T}, 51);  // duplicates
    const st::Placements tokens = fit_placements(mesh, {S1, S0});
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      auto emb = op([](auto& in) { return at::embedding(in[0], in[1]); });
      auto emb_pad = op([](auto& in) { return at::embedding(in[0], in[1], /*padding_idx=*/3); });
      RefInput stok = empty ? empty_first_input(mesh, tok, tokens, false)
                            : sharded_input(mesh, tok, tokens, false);
      // Replicated weight, sharded tokens: local; the weight's gradient is summed.
      check("embedding, replicated weight" + tag, emb, {plain(w, true), stok}, mesh, tol(dt));
      check("embedding, replicated weight, padding_idx" + tag, emb_pad, {plain(w, true), stok},
            mesh, tol(dt));
      // Vocabulary-sharded weight, sharded or replicated tokens: a GhostPlan.
      RefInput sw =
          empty ? empty_first_input(mesh, w, {S0, R}, true) : sharded_input(mesh, w, {S0, R}, true);
      check("embedding, row-sharded weight, sharded tokens" + tag, emb, {sw, stok}, mesh, tol(dt));
      check("embedding, row-sharded weight, replicated tokens" + tag, emb, {sw, plain(tok)}, mesh,
            tol(dt));
      check("embedding, row-sharded weight, padding_idx" + tag, emb_pad, {sw, stok}, mesh, tol(dt));
    }
  }
  // nn::Embedding, its weight distributed by distribute_module.
  torch::nn::Embedding e(torch::nn::EmbeddingOptions(V, D));
  auto tok = randint(V, {3, T}, 52);
  st::distribute_module(*e, mesh);
  auto stok = st::distribute_tensor(tok, mesh, fit_placements(mesh, {S1, S0}));
  at::Tensor y = e(stok);
  EXPECT_TRUE(all_close(gathered(y), at::embedding(e->weight.detach(), tok), 0, 0));
}

TEST(IndexOps, AdvancedIndexingAndTakeAlongDimEqualSingleProcess) {
  using namespace torch::indexing;
  auto mesh = test_mesh();
  const int64_t E = 8;
  for (auto dt : kDtypes) {
    at::Tensor x = rnd({B, C, H, W}, 60).to(dt);
    at::Tensor idx = randint(H, {E}, 61) - 3;  // negative ids wrap
    at::Tensor ids = distinct(H, 6, 62);
    at::Tensor v = rnd({B, C, 6, W}, 63).to(dt);
    at::Tensor mask = rnd({H}, 64).gt(0);
    at::Tensor i4 = randint(H, {B, C, E, W}, 65);
    for (bool empty : {false, true}) {
      const std::string tag = std::string(" ") + c10::toString(dt) + (empty ? " empty" : "");
      auto get = op([](auto& in) { return in[0].index({Slice(), Slice(), in[1]}); });
      check("x[:, :, idx]" + tag, get, {field(mesh, x, empty), plain(idx)}, mesh, tol(dt));
      check("x[:, :, sharded idx]" + tag, get, {field(mesh, x, empty), entries(mesh, idx, !empty)},
            mesh, tol(dt));
      check("x[:, :, mask]" + tag, get, {field(mesh, x, empty), plain(mask)}, mesh, tol(dt));
      check("x[:, idx]" + tag, op([](auto& in) {
              return in[0].index({Slice(), in[1]});
            }),
            {field(mesh, x, empty), plain(randint(C, {4}, 66))}, mesh, tol(dt));
      check("x[:, :, ids] = v" + tag, op([](auto& in) {
              at::Tensor y = in[0] * 1;
              y.index_put_({Slice(), Slice(), in[1]}, in[2]);
              return y;
            }),
            {field(mesh, x, empty), plain(ids), field(mesh, v, !empty)}, mesh, tol(dt));
      check("x[:, :, idx] += v (accumulate)" + tag, op([](auto& in) {
              at::Tensor y = in[0] * 1;
              c10::List<c10::optional<at::Tensor>> list;
              list.push_back(c10::nullopt);
              list.push_back(c10::nullopt);
              list.push_back(in[1]);
              return y.index_put_(list, in[2], /*accumulate=*/true);
            }),
            {field(mesh, x, empty), entries(mesh, idx, empty),
             plain(rnd({B, C, E, 1}, 67).to(dt), true)},
            mesh, tol(dt));
      check("x[:, :, mask] = 2" + tag, op([](auto& in) {
              at::Tensor y = in[0] + 0;
              y.index_put_({Slice(), Slice(), in[1]}, at::scalar_tensor(2.0, y.options()));
              return y;
            }),
            {field(mesh, x, empty), plain(mask)}, mesh, tol(dt));
      check("take_along_dim" + tag,
            op([](auto& in) { return at::take_along_dim(in[0], in[1], 2); }),
            {field(mesh, x, empty), field(mesh, i4, !empty, false)}, mesh, tol(dt));
    }
  }
}

// ---- traffic ----------------------------------------------------------------------

/// The bytes of the rows along H that this rank lacks for the ids `mine`
/// (distinct ids outside its owned range), one row = B*C*(local W) elements.
int64_t foreign_row_bytes(const at::Tensor& mine, int64_t lo, int64_t hi, int64_t row_bytes) {
  std::set<int64_t> s;
  auto a = mine.accessor<int64_t, 1>();
  for (int64_t i = 0; i < mine.size(0); ++i) {
    if (a[i] < lo || a[i] >= hi) s.insert(a[i]);
  }
  return static_cast<int64_t>(s.size()) * row_bytes;
}

TEST(IndexOps, OnlyNeededRowsMoveAndNothingAlongUnshardedDims) {
  auto mesh = test_mesh();
  const int64_t Hb = 64, E = 12;
  at::Tensor x = rnd({B, C, Hb, W}, 20);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, kField), true);
  const st::ShardSpec& spec = st::ShardTensor(sx).spec();
  const int64_t lo = spec.local_offsets()[2], hi = lo + spec.local_shape()[2];
  const int64_t row_bytes = B * C * spec.local_shape()[3] * 4;
  at::Tensor idx = randint(Hb, {E}, 21);  // replicated: this rank takes its balanced entries
  const int64_t P0 = mesh.size(0), c0 = mesh.coordinate()[0];
  const auto es = st::balanced_sizes(E, P0);
  const int64_t e0 = st::offsets_of(es)[c0];
  const int64_t need = foreign_row_bytes(idx.narrow(0, e0, es[c0]), lo, hi, row_bytes);
  StrictOn strict;
  sx.index_select(2, idx);  // builds the plan
  st::reset_comm_stats();
  at::Tensor y = sx.index_select(2, idx);
  const auto fwd = st::comm_stats();
  // The rows this rank lacks, plus the cache agreement (one all-reduce of five int64).
  EXPECT_GE(fwd.bytes_received, need);
  EXPECT_LE(fwd.bytes_received, need + 128);
  EXPECT_EQ(fwd.gathered_bytes, 0);
  // An all-gather of x along H receives (P0 - 1) / P0 of the local columns.
  const int64_t allgather = Hb * row_bytes * (P0 - 1) / P0;
  if (P0 > 1) EXPECT_LT(fwd.bytes_received * 4, allgather);
  if (mesh.rank() == 0) {
    std::printf(
        "[ index ] index_select of %lld of %lld rows along H at %s: rank 0 received %lld "
        "bytes (rows it lacks: %lld), an all-gather receives %lld\n",
        static_cast<long long>(E), static_cast<long long>(Hb),
        is_mesh_2x2() ? "2x2" : std::to_string(mesh.size()).c_str(),
        static_cast<long long>(fwd.bytes_received), static_cast<long long>(need),
        static_cast<long long>(allgather));
  }
  // Along C: no communication at all, forward and backward, with a replicated index.
  at::Tensor cidx = randint(C, {4}, 22);
  st::reset_comm_stats();
  at::Tensor z = sx.index_select(1, cidx)
                     .index_add(1, cidx, sx.index_select(1, cidx))
                     .index_fill(1, cidx.narrow(0, 0, 1), 1.0);
  at::Tensor g = sx.gather(1, cidx.view({1, 4, 1, 1}).expand({B, 4, Hb, W}).contiguous());
  st::backward(z.sum() + g.sum());
  const auto local = st::comm_stats();
  // The two scalar sums are full reductions (an all-reduce each, forward and backward are 8 bytes).
  EXPECT_LE(local.bytes_sent, 64);
  EXPECT_EQ(local.gathered_bytes, 0);
}

// ---- errors -----------------------------------------------------------------------

TEST(IndexOps, BadInputThrowsEverywhere) {
  auto mesh = test_mesh();
  auto sx = st::distribute_tensor(rnd({B, C, H, W}, 30), mesh, fit_placements(mesh, kField), true);
  at::Tensor ids = randint(H, {9}, 31);
  for (int64_t bad : {H, int64_t{-1}}) {
    at::Tensor b = ids.clone();
    b[8] = bad;  // on the last coordinate's piece only
    auto sb = st::distribute_tensor(b, mesh, fit_placements(mesh, kEntries));
    EXPECT_TRUE(throws_everywhere([&] { sx.index_select(2, sb); },
                                  {"aten::index_select", "index out of range", "Shard(2)"}));
    EXPECT_TRUE(throws_everywhere([&] { sx.index_select(2, b); },
                                  {"aten::index_select", "index out of range"}));
  }
  // Along C, an index sharded like self holding a bad id on one piece only.
  at::Tensor i4 = randint(C, {B, 2, H, W}, 32);
  i4.select(2, H - 1).fill_(C);
  auto si4 = st::distribute_tensor(i4, mesh, fit_placements(mesh, kField));
  EXPECT_TRUE(
      throws_everywhere([&] { sx.gather(1, si4); }, {"aten::gather", "index out of range"}));
  at::Tensor y = sx * 1;
  EXPECT_TRUE(throws_everywhere(
      [&] {
        y.index_fill(2, at::tensor(std::vector<int64_t>{0, H}), 1.0);
      },
      {"aten::index_fill", "index out of range"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        y.index_copy(2, at::tensor(std::vector<int64_t>{0, 1}),
                     rnd({B, C, 2, W}, 33).to(at::kDouble));
      },
      {"aten::index_copy", "same dtype"}));
  EXPECT_TRUE(
      throws_everywhere([&] { sx.index_fill_(2, at::tensor(std::vector<int64_t>{0}), 1.0); },
                        {"aten::index_fill_", "leaf"}));
}

TEST(IndexOps, BadInputOfIndexDisguisesThrowsEverywhere) {
  using namespace torch::indexing;
  auto mesh = test_mesh();
  const int64_t V = 9;
  auto sw = st::distribute_tensor(rnd({V, 3}, 34), mesh, fit_placements(mesh, {S0, R}), true);
  at::Tensor w = rnd({V, 3}, 35).requires_grad_();
  at::Tensor tok = randint(V, {2, 8}, 36);
  tok[1][7] = V;  // on the last piece only
  auto stok = st::distribute_tensor(tok, mesh, fit_placements(mesh, {S1, S0}));
  EXPECT_TRUE(throws_everywhere([&] { at::embedding(sw, stok); },
                                {"aten::embedding", "index out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { at::embedding(w, stok); },
                                {"aten::embedding", "index out of range"}));
  auto sx = st::distribute_tensor(rnd({B, C, H, W}, 37), mesh, fit_placements(mesh, kField));
  at::Tensor bad = randint(H, {9}, 38);
  bad[8] = H + 2;
  auto sbad = st::distribute_tensor(bad, mesh, fit_placements(mesh, kEntries));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        sx.index({Slice(), Slice(), sbad});
      },
      {"aten::index", "index out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { sx.repeat({2, 2}); }, {"aten::repeat", "smaller"}));
}

TEST(IndexOps, RepeatAndVocabularyShardedEmbeddingMoveOnlyNeededRows) {
  auto mesh = test_mesh();
  const int64_t Hb = 40;
  auto sx = st::distribute_tensor(rnd({1, 2, Hb, W}, 80), mesh, fit_placements(mesh, kField));
  const st::ShardSpec& spec = st::ShardTensor(sx).spec();
  const int64_t P0 = mesh.size(0), c0 = mesh.coordinate()[0];
  const int64_t row_bytes = 2 * spec.local_shape()[3] * 4;
  const int64_t lo = spec.local_offsets()[2], hi = lo + spec.local_shape()[2];
  // repeat(1, 1, 2, 1): output rows [o, o + len) are input rows i % Hb.
  const auto out = st::balanced_sizes(2 * Hb, P0);
  const int64_t o = st::offsets_of(out)[c0];
  at::Tensor ids = at::arange(o, o + out[c0], at::kLong).remainder(Hb);
  const int64_t need = foreign_row_bytes(ids, lo, hi, row_bytes);
  StrictOn strict;
  st::reset_comm_stats();
  at::Tensor y = sx.repeat({1, 1, 2, 1});
  const auto s = st::comm_stats();
  // The rows it lacks; the plan's build (counts, ids, the argument check) and
  // the cache agreement add at most a few hundred bytes.
  EXPECT_GE(s.bytes_received, need);
  EXPECT_LE(s.bytes_received, need + need / row_bytes * 8 + 64 * P0 + 256);
  EXPECT_EQ(s.gathered_bytes, 0);
  EXPECT_TRUE(all_close(gathered(y), gathered(sx).repeat({1, 1, 2, 1}), 0, 0));
  // A vocabulary-sharded embedding: the weight rows this rank's tokens need.
  const int64_t V = 50, D = 8;
  auto sw = st::distribute_tensor(rnd({V, D}, 81), mesh, fit_placements(mesh, {S0, R}));
  at::Tensor tok = randint(V, {1, 24}, 82);
  auto stok = st::distribute_tensor(tok, mesh, fit_placements(mesh, {S1, R}));
  at::Tensor mine = st::ShardTensor(stok).local().reshape({-1});
  const st::ShardSpec& wspec = st::ShardTensor(sw).spec();
  const int64_t wlo = wspec.local_offsets()[0], whi = wlo + wspec.local_shape()[0];
  const int64_t wneed = foreign_row_bytes(mine, wlo, whi, D * 4);
  at::embedding(sw, stok);  // builds the plan
  st::reset_comm_stats();
  at::Tensor e = at::embedding(sw, stok);
  const auto es = st::comm_stats();
  EXPECT_GE(es.bytes_received, wneed);
  EXPECT_LE(es.bytes_received, wneed + 128);
  EXPECT_TRUE(all_close(gathered(e), at::embedding(gathered(sw), tok), 0, 0));
  if (mesh.rank() == 0) {
    std::printf(
        "[ index ] repeat x2 along H (%lld rows): rank 0 received %lld bytes (rows it "
        "lacks: %lld); embedding of 24 tokens, 50 x 8 vocabulary-sharded weight: %lld "
        "bytes (rows it lacks: %lld)\n",
        static_cast<long long>(Hb), static_cast<long long>(s.bytes_received),
        static_cast<long long>(need), static_cast<long long>(es.bytes_received),
        static_cast<long long>(wneed));
  }
}

}  // namespace
