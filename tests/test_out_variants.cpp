// The generic adapter of out= overloads (Note [out variants],
// src/ops/out_variants.cpp): add_out, sum_out, cumsum_out, matmul_out and
// sort_out (values and indices), and cat_out, kthvalue_out, max_out,
// index_select_out, var_out, clone_out on sharded inputs, balanced and with empty
// pieces, into out= tensors laid out like the result, laid out otherwise, and
// empty ones that are resized, against single-process libtorch on the
// gathered tensors; strict mode takes them (no fallback, no gather); the
// refusals (a plain out= tensor, autograd, a dtype that cannot hold the
// result) raise on every rank naming the op; op_coverage() reports them.
#include <shardtensor/dispatch/coverage.h>
#include <shardtensor/dispatch/stats.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

struct StrictOn {
  bool was = st::strict();
  StrictOn() { st::set_strict(true); }
  ~StrictOn() { st::set_strict(was); }
};

RefInput sh(const st::DeviceMesh& mesh, const at::Tensor& full, const st::Placements& p,
            bool empty = false) {
  return empty ? empty_first_input(mesh, full, p, false) : sharded_input(mesh, full, p, false);
}
RefInput plain(const at::Tensor& full) { return RefInput{full, std::nullopt, false}; }

/// An out= buffer with no elements: resized by the op, as libtorch does.
RefInput empty_out(const st::DeviceMesh& mesh, at::ScalarType dt = at::kFloat) {
  return sharded_input(mesh, at::empty({0}, dt), fit_placements(mesh, {R, R}), false);
}

/// Collective. Values only (out= has no autograd): strict mode must take the
/// call (nothing falls back, nothing is gathered) and the result must equal
/// libtorch's.
void check(const std::string& what, const RefFn& fn, const std::vector<RefInput>& in,
           const st::DeviceMesh& mesh, bool strict = true) {
  st::reset_dispatch_stats();
  st::reset_comm_stats();
  {
    std::optional<StrictOn> s;
    if (strict) s.emplace();
    EXPECT_TRUE(reference_check(fn, in, mesh, {}, 1e-5, 1e-5, /*check_backward=*/false)) << what;
  }
  EXPECT_EQ(st::dispatch_stats().fallbacks, 0) << what;
  if (strict) EXPECT_EQ(st::comm_stats().gathered_bytes, 0) << what;
}

TEST(OutVariants, AddOut) {
  auto mesh = test_mesh();
  const auto x = rnd({7, 6}, 1), y = rnd({7, 6}, 2), z = rnd({6}, 3);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::Tensor& r = at::add_out(out, in[0], in[1], 2.0);
    EXPECT_EQ(r.unsafeGetTensorImpl(), out.unsafeGetTensorImpl());
    return out;
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    check("add_out into the result's layout" + tag, fn,
          {sh(mesh, x, {S0, S1}, empty), sh(mesh, y, {S0, S1}),
           sh(mesh, at::zeros({7, 6}), {S0, S1})},
          mesh);
    check("add_out, plain operand" + tag, fn,
          {sh(mesh, x, {S1, S0}, empty), plain(z), sh(mesh, at::zeros({7, 6}), {S1, S0}, empty)},
          mesh);
    // On the 2x2 mesh the swap of shard dims goes through Replicate, which
    // strict mode refuses (a gather): values only there.
    check("add_out into another layout" + tag, fn,
          {sh(mesh, x, {S0, S1}, empty), plain(y), sh(mesh, at::zeros({7, 6}), {S1, S0})}, mesh,
          !is_mesh_2x2());
    check("add_out into an empty out=, resized" + tag, fn,
          {sh(mesh, x, {S0, S1}, empty), sh(mesh, y, {S0, S1}), empty_out(mesh)}, mesh);
  }
  // Scalar overload, and a double out= for a float result (cast on copy).
  auto fs = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::add_out(out, in[0], at::scalar_tensor(3.0), 1.0);
    return out.to(at::kFloat);
  };
  check("add_out into a double out=", fs,
        {sh(mesh, x, {S0}), sh(mesh, at::zeros({7, 6}, at::kDouble), {S0})}, mesh);
}

TEST(OutVariants, SumOut) {
  auto mesh = test_mesh();
  const auto x = rnd({5, 9, 4}, 4);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::sum_out(out, in[0], at::IntArrayRef{1});
    return out;
  };
  auto fk = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::sum_out(out, in[0], at::IntArrayRef{0, 2}, /*keepdim=*/true);
    return out;
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    // Along the sharded dim: the functional result is Partial, summed into out=.
    check("sum_out along a sharded dim" + tag, fn,
          {sh(mesh, x, {S1, S0}, empty), sh(mesh, at::zeros({5, 4}), {S0, S1})}, mesh);
    check("sum_out into an empty out=" + tag, fn, {sh(mesh, x, {S1, S2}, empty), empty_out(mesh)},
          mesh);
    // An out= of another shape that holds elements is resized too (libtorch warns).
    check("sum_out into a non-empty out= of another shape" + tag, fn,
          {sh(mesh, x, {S1, S0}, empty), sh(mesh, at::zeros({3, 2}), {S1, S0})}, mesh);
    // No dtype given: computed in the out= tensor's dtype (here from int64).
    check("sum_out of int64 into a float out=" + tag, fn,
          {sh(mesh, at::round(x * 10).to(at::kLong), {S1, S0}, empty), empty_out(mesh)}, mesh);
    check("sum_out keepdim" + tag, fk,
          {sh(mesh, x, {S1, S0}, empty), sh(mesh, at::zeros({1, 9, 1}), {S1, R})}, mesh);
  }
}

TEST(OutVariants, CumsumOut) {
  auto mesh = test_mesh();
  const auto x = rnd({9, 5}, 5);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::cumsum_out(out, in[0], 0);
    return out;
  };
  auto fd = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::cumsum_out(out, in[0], -1, at::kDouble);
    return out.to(at::kFloat);
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    check("cumsum_out along the sharded dim" + tag, fn,
          {sh(mesh, x, {S0, S1}, empty), sh(mesh, at::zeros({9, 5}), {S0, S1}, empty)}, mesh);
    check("cumsum_out into an empty out=" + tag, fn,
          {sh(mesh, x, {S0, S1}, empty), empty_out(mesh)}, mesh);
    check("cumsum_out with a dtype" + tag, fd,
          {sh(mesh, x, {S1, S0}, empty), empty_out(mesh, at::kDouble)}, mesh);
  }
}

TEST(OutVariants, MatmulOut) {
  auto mesh = test_mesh();
  const auto a = rnd({7, 6}, 6), b = rnd({6, 5}, 7), a3 = rnd({3, 7, 6}, 8);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::matmul_out(out, in[0], in[1]);
    return out;
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    check("matmul_out, rows sharded" + tag, fn,
          {sh(mesh, a, {S0, R}, empty), plain(b), sh(mesh, at::zeros({7, 5}), {S0, S1})}, mesh);
    check("matmul_out, batched, into an empty out=" + tag, fn,
          {sh(mesh, a3, {S0, S1}, empty), plain(b), empty_out(mesh)}, mesh);
  }
  // The contraction dim sharded: a Partial result, summed into out= (not strict:
  // whether the rule gathers is its own business).
  check("matmul_out, contraction sharded", fn,
        {sh(mesh, a, {S1}), sh(mesh, b, {S0}), sh(mesh, at::zeros({7, 5}), {S0})}, mesh, false);
}

TEST(OutVariants, SortOutValuesAndIndices) {
  auto mesh = test_mesh();
  const auto x = rnd({7, 9}, 9);  // no ties
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor v = in[1], i = in[2];
    auto r = at::sort_out(v, i, in[0], 1, /*descending=*/true);
    EXPECT_EQ(std::get<0>(r).unsafeGetTensorImpl(), v.unsafeGetTensorImpl());
    EXPECT_EQ(std::get<1>(r).unsafeGetTensorImpl(), i.unsafeGetTensorImpl());
    return at::cat({v, i.to(at::kFloat)}, 1);
  };
  auto fs = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor v = in[1], i = in[2];
    at::sort_out(v, i, in[0], /*stable=*/true, 0, /*descending=*/false);  // sort.values_stable
    return at::cat({v, i.to(at::kFloat)}, 1);
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    check("sort_out along an unsharded dim" + tag, fn,
          {sh(mesh, x, {S0}, empty), sh(mesh, at::zeros({7, 9}), {S0}, empty),
           sh(mesh, at::zeros({7, 9}, at::kLong), {S0}, empty)},
          mesh);
    check("sort_out into empty out= tensors" + tag, fn,
          {sh(mesh, x, {S0}, empty), empty_out(mesh), empty_out(mesh, at::kLong)}, mesh);
    // Along the sharded dim the sort rule gathers it (Note [sort gather]).
    check("sort_out (stable) along the sharded dim" + tag, fs,
          {sh(mesh, x, {S0, S1}, empty), empty_out(mesh), empty_out(mesh, at::kLong)}, mesh, false);
  }
}

TEST(OutVariants, MoreOverloadsThroughTheirFunctionalRules) {
  auto mesh = test_mesh();
  const auto x = rnd({9, 6}, 20), y = rnd({4, 6}, 21);
  const auto idx = at::tensor({8, 0, 3, 3, 5}, at::kLong);
  auto cat = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::cat_out(out, {in[0], in[1]}, 0);  // a tensor-list argument
    return out;
  };
  auto kth = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor v = in[1], i = in[2];
    at::kthvalue_out(v, i, in[0], 3, 0);  // two out= tensors, a sharded dim
    return at::cat({v, i.to(at::kFloat)});
  };
  auto max = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor v = in[1], i = in[2];
    at::max_out(v, i, in[0], 1, /*keepdim=*/true);
    return at::cat({v, i.to(at::kFloat)}, 1);
  };
  auto sel = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::index_select_out(out, in[0], 0, in[1]);
    return out;
  };
  auto var = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::var_out(out, in[0], at::IntArrayRef{0}, /*correction=*/1, /*keepdim=*/false);
    return out;
  };
  auto clone = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[1];
    at::clone_out(out, in[0]);
    return out;
  };
  for (bool empty : {false, true}) {
    const std::string tag = empty ? " (empty pieces)" : "";
    check("cat_out" + tag, cat,
          {sh(mesh, x, {S1, S0}, empty), sh(mesh, y, {S1, S0}), empty_out(mesh)}, mesh);
    check("kthvalue_out along the sharded dim" + tag, kth,
          {sh(mesh, x, {S0, S1}, empty), empty_out(mesh), empty_out(mesh, at::kLong)}, mesh);
    check("max_out (values, indices)" + tag, max,
          {sh(mesh, x, {S0}, empty), empty_out(mesh), empty_out(mesh, at::kLong)}, mesh);
    check("index_select_out along the sharded dim" + tag, sel,
          {sh(mesh, x, {S0, S1}, empty), plain(idx), empty_out(mesh)}, mesh);
    check("var_out along the sharded dim" + tag, var,
          {sh(mesh, x, {S0, S1}, empty), empty_out(mesh)}, mesh);
    check("clone_out into another split" + tag, clone,
          {sh(mesh, x, {S0, S1}, empty), sh(mesh, at::zeros({9, 6}), {S0, S1}, !empty)}, mesh);
  }
}

TEST(OutVariants, RefusalsRaiseOnEveryRankNamingTheOp) {
  auto mesh = test_mesh();
  const auto x = rnd({7, 6}, 10);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1})));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::Tensor out = at::empty({7, 6});
        at::add_out(out, sx, sx);
      },
      {"aten::add.out", "must be a ShardTensor"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::Tensor out = st::distribute_tensor(at::zeros({7, 6}, at::kLong), mesh,
                                               fit_placements(mesh, {S0, S1}));
        at::add_out(out, sx, sx);
      },
      {"aten::add.out", "can't be cast to the desired output type Long"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::Tensor g = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1}));
        g.requires_grad_(true);
        at::Tensor out = st::distribute_tensor(at::zeros({7, 6}), mesh, fit_placements(mesh, {S0}));
        at::mul_out(out, g, sx);
      },
      {"aten::mul.out", "don't support automatic differentiation"}));
  // A view that writes back into its source cannot be resized.
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::Tensor base =
            st::distribute_tensor(at::zeros({3, 7}), mesh, fit_placements(mesh, {S1}));
        at::Tensor row = base.select(1, 0);  // a copy that writes back (Note [view write-back])
        at::cumsum_out(row, sx, 0);
      },
      {"aten::cumsum.out", "cannot be resized"}));
}

TEST(OutVariants, CoverageReportsTheAdapter) {
  std::map<std::string, st::OpHandling> h;
  for (const auto& c : st::op_coverage()) h[c.name] = c.handling;
  for (const char* n : {"aten::add.out", "aten::sum.IntList_out", "aten::cumsum.out",
                        "aten::matmul.out", "aten::sort.values", "aten::sort.values_stable"}) {
    EXPECT_EQ(h.at(n), st::OpHandling::OutAdapter) << n;
  }
  EXPECT_EQ(st::to_string(st::OpHandling::OutAdapter), "out-adapter");
  EXPECT_EQ(h.at("aten::where.self_out"), st::OpHandling::Rule);  // its own rule
  EXPECT_EQ(h.at("aten::add.Tensor"), st::OpHandling::Rule);
}

}  // namespace
