// Shape ops (view/reshape family, squeeze/unsqueeze, permute/transpose,
// narrow/slice/select, expand, split/unbind) and cat/stack, each compared with
// plain libtorch on the full tensors: forward, input gradients, balanced and
// uneven shards, an empty shard, 1-D and 2x2 meshes.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
using torch::indexing::None;
using torch::indexing::Slice;

namespace {

at::Tensor seeded_randn(c10::IntArrayRef shape, uint64_t seed = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

using Fn1 = std::function<at::Tensor(const at::Tensor&)>;

// Collective. Runs `fn` on x laid out by each of `wanted` (fitted to the
// mesh), once balanced and once with an empty first shard.
::testing::AssertionResult check_layouts(const Fn1& fn, const at::Tensor& x,
                                         const std::vector<st::Placements>& wanted,
                                         const st::DeviceMesh& mesh, bool with_empty = true) {
  bool ok = true;
  std::ostringstream msg;
  for (const auto& w : wanted) {
    const auto p = fit_placements(mesh, w);
    auto run = [&](std::optional<st::ShardSizes> sizes, const char* what) {
      auto r = reference_check([&](const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&) { return fn(in[0]); },
                               {RefInput{x, p, true, sizes}}, mesh);
      if (!r) {
        ok = false;
        msg << "\n" << st::to_string(p) << " " << what << ":" << r.message();
      }
    };
    run(std::nullopt, "balanced");
    if (with_empty) run(sizes_with_empty_first(mesh, p, x.sizes()), "empty first shard");
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

// Collective. Expects `fn` to throw a c10::Error on every rank whose message
// names every one of `needles`; then checks that a collective still works.
void expect_error_everywhere(const std::function<void()>& fn,
                             const std::vector<std::string>& needles) {
  bool threw = false;
  std::string msg;
  try {
    fn();
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what_without_backtrace();
  }
  EXPECT_TRUE(threw);
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << n << " in: " << msg;
  EXPECT_TRUE(all_ranks(threw));
  // Nothing is left half-way through a collective.
  auto mesh = test_mesh();
  auto y = seeded_randn({5, 3}, 7);
  auto sy = st::distribute_tensor(y, mesh, fit_placements(mesh, {st::Shard{0}, st::Shard{1}}));
  EXPECT_TRUE(all_close(st::ShardTensor(sy).full_tensor(), y));
}

st::ShardSizes sizes_for(const st::DeviceMesh& mesh, int64_t mesh_dim, std::vector<int64_t> s) {
  st::ShardSizes out(mesh.ndim());
  out[mesh_dim] = std::move(s);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- view / reshape

TEST(ShapeView, MergeKeepsTheOuterShard) {
  auto mesh = test_mesh();
  auto x = seeded_randn({6, 4, 5});
  // {6, 4} -> {24} with dim 0 sharded (outermost), {5} -> {5} with dim 2 sharded.
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({24, 5});
      },
      x, {{S0, S2}, {S2, S0}, {R, S0}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({-1, 5});
      },
      x, {{S0, S2}}, mesh));
  // {4, 5} -> {20} with dim 1 sharded (outermost of its block).
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({6, -1});
      },
      x, {{S1, S0}, {S0, S1}}, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.reshape({-1}); }, x, {{S0, R}}, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.flatten(0, 1); }, x,
                            {{S0, S2}, {S2, S0}}, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.flatten(1); }, x,
                            {{S1, S0}, {S0, S1}}, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.flatten(); }, x, {{S0, R}}, mesh));
  // The output layout: dim 0 keeps the sizes, scaled by the inner product.
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2})));
  auto v = st::ShardTensor(sx.view({24, 5}));
  EXPECT_EQ(v.spec().placements(), fit_placements(mesh, {S0, S1}));
  std::vector<int64_t> expect;
  for (int64_t n : sx.spec().shard_sizes(0)) expect.push_back(n * 4);
  EXPECT_EQ(v.spec().shard_sizes(0), expect);
}

TEST(ShapeView, SplitKeepsTheOuterShard) {
  auto mesh = test_mesh();
  // 24 rows split into [12, 2]: every piece (balanced or with an empty first
  // piece, at 1 to 4 ranks) holds an even number of rows.
  auto x = seeded_randn({24, 5});
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({12, 2, 5});
      },
      x, {{S0, S1}, {S1, S0}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({-1, 2, 5});
      },
      x, {{S0, S1}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.unflatten(0, {12, 2});
      },
      x, {{S0, S1}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.unflatten(-1, {5, 1});
      },
      x, {{S0, S1}, {S1, S0}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view_as(at::empty({12, 2, 5}));
      },
      x, {{S0, S1}}, mesh));
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  auto v = st::ShardTensor(sx.view({12, 2, 5}));
  std::vector<int64_t> expect;
  for (int64_t n : sx.spec().shard_sizes(0)) expect.push_back(n / 2);
  EXPECT_EQ(v.spec().shard_sizes(0), expect);
}

TEST(ShapeView, SizeOneAndEmptyTensors) {
  auto mesh = test_mesh();
  // Size-1 dims are left out of the blocks; a sharded one is replicated first.
  auto x = seeded_randn({6, 1, 4});
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.view({24}); }, x,
                            {{S0, R}, {S1, S0}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({1, 6, 4, 1});
      },
      x, {{S0, S2}, {S1, S2}, {S2, S1}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape({6, 4});
      },
      x, {{S1, S0}, {S0, S1}}, mesh));
  // No elements: nothing moves, the result is replicated.
  auto e = seeded_randn({0, 4, 3});
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.view({4, 0, 3});
      },
      e, {{S1, S2}, {S0, S1}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape({-1, 12});
      },
      e, {{S1, S2}}, mesh));
}

TEST(ShapeView, ReshapeRepartitionsWhenPiecesDoNotDivide) {
  auto mesh = test_mesh();
  // [24] -> [6, 4]: at 4 ranks the balanced pieces of 6 rows are not multiples
  // of 4; reshape repartitions first.
  auto x = seeded_randn({24, 5});
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape({6, 4, 5});
      },
      x, {{S0, S1}, {S1, S0}}, mesh));
  // A block with several dims on both sides: {6, 10} -> {4, 15} needs
  // multiples of 3 rows of the input's dim 0.
  auto y = seeded_randn({6, 10, 3});
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape({4, 15, 3});
      },
      y, {{S0, S2}, {S2, S0}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape({4, -1, 3});
      },
      y, {{S0, R}}, mesh));
  // Arbitrary explicit sizes.
  const int64_t p = mesh.size(0);
  std::vector<int64_t> sizes{1};
  for (int64_t n : st::balanced_sizes(23, std::max<int64_t>(p - 1, 1))) sizes.push_back(n);
  if (p == 1) sizes = {24};
  auto r = reference_check(
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return in[0].reshape({6, 4, 5}) * 2;
      },
      {RefInput{x, fit_placements(mesh, {S0}), true, sizes_for(mesh, 0, sizes)}}, mesh);
  EXPECT_TRUE(r);
  // Non-contiguous local pieces: reshape copies like libtorch.
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.t().reshape({-1}); },
                            seeded_randn({5, 6}), {{S1, R}}, mesh));
  // The result is balanced multiples of the inner product.
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  auto v = st::ShardTensor(sx.reshape({6, 4, 5}));
  std::vector<int64_t> expect = st::balanced_sizes(6, p);
  EXPECT_EQ(v.spec().shard_sizes(0), expect);
}

TEST(ShapeView, UnsafeViewAliasReshapeAsAndDtype) {
  auto mesh = test_mesh();
  auto x = seeded_randn({6, 4, 5});
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return at::_unsafe_view(t * 1, {24, 5});
      },
      x, {{S0, S2}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return at::_reshape_alias(t, {24, 5}, {5, 1});
      },
      x, {{S0, S2}}, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.reshape_as(at::empty({6, 20}));
      },
      x, {{S1, S0}}, mesh));
  // Reinterpreting the bits (no gradient).
  for (const auto& w : std::vector<st::Placements>{{S0, S2}, {S2, S1}}) {
    const auto p = fit_placements(mesh, w);
    EXPECT_TRUE(reference_check(
        [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
          return in[0].view(at::kInt).bitwise_xor(7).view(at::kFloat);
        },
        {RefInput{x, p, false}}, mesh));
  }
  // To a dtype of another size with the last dim sharded: each piece
  // reinterprets its own bytes (float32 <-> int16 / uint8 / float64).
  auto y = seeded_randn({3, 4, 12});
  for (const auto& w : std::vector<st::Placements>{{S2, S0}, {S0, S2}}) {
    const auto p = fit_placements(mesh, w);
    for (bool empty : {false, true}) {
      RefInput in = empty ? empty_first_input(mesh, y, p, false) : RefInput{y, p, false};
      EXPECT_TRUE(reference_check(
          [](const std::vector<at::Tensor>& v, const std::vector<at::Tensor>&) {
            return v[0].view(at::kShort).bitwise_xor(3).view(at::kFloat);
          },
          {in}, mesh))
          << st::to_string(p);
      EXPECT_TRUE(reference_check(
          [](const std::vector<at::Tensor>& v, const std::vector<at::Tensor>&) {
            return v[0].view(at::kByte).to(at::kFloat);
          },
          {in}, mesh))
          << st::to_string(p);
    }
  }
  // Wider elements: every piece must hold a whole number of them.
  auto sy = st::distribute_tensor(y, mesh, fit_placements(mesh, {S2, S0}),
                                  /*requires_grad=*/false);
  if (st::ShardTensor(sy).spec().shard_sizes(0).size() == 1 ||
      std::all_of(st::ShardTensor(sy).spec().shard_sizes(0).begin(),
                  st::ShardTensor(sy).spec().shard_sizes(0).end(),
                  [](int64_t n) { return n % 2 == 0; })) {
    EXPECT_TRUE(at::equal(gathered(sy.view(at::kDouble)), y.view(at::kDouble)));
  } else {
    EXPECT_TRUE(throws_everywhere([&] { auto z = sy.view(at::kDouble); },
                                  {"view", "whole number", "Shard"}));
  }
}

// Note [view merge]: a merge whose sharded dim is not the block's outermost
// (and a split whose pieces are not multiples) moves data instead of refusing;
// view then writes in-place changes back (tests/test_unfold.cpp has the full
// grid: UnflattenAndMergeRedistribute*).
TEST(ShapeView, UncleanViewMovesData) {
  auto mesh = test_mesh();
  auto x = seeded_randn({6, 4});
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S1}));
  // Dim 1 is the inner dim of the merged block: moved onto dim 0 first.
  EXPECT_TRUE(all_close(st::ShardTensor(sx.view({24})).full_tensor(), x.view({24})));
  EXPECT_TRUE(all_close(st::ShardTensor(sx.reshape({24})).full_tensor(), x.reshape({24})));
  // Pieces that are not multiples of the inner output product: repartitioned.
  const int64_t p = mesh.size(0);
  std::vector<int64_t> sizes{1};
  for (int64_t n : st::balanced_sizes(23, std::max<int64_t>(p - 1, 1))) sizes.push_back(n);
  if (p == 1) sizes = {24};
  auto y = seeded_randn({24, 5});
  auto sy =
      st::distribute_tensor(y, mesh, fit_placements(mesh, {S0}), false, sizes_for(mesh, 0, sizes));
  EXPECT_TRUE(all_close(st::ShardTensor(sy.view({12, 2, 5})).full_tensor(), y.view({12, 2, 5})));
  EXPECT_TRUE(
      all_close(st::ShardTensor(sy.reshape({12, 2, 5})).full_tensor(), y.reshape({12, 2, 5})));
}

TEST(ShapeView, ViewsShareMemoryWithTheSource) {
  auto mesh = test_mesh();
  auto x = seeded_randn({6, 4, 5});
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2})));
  auto alias = [&](const at::Tensor& v) {
    return all_ranks(st::ShardTensor(v).local().is_alias_of(sx.local()));
  };
  EXPECT_TRUE(alias(sx.view({24, 5})));
  EXPECT_TRUE(alias(sx.reshape({24, 5})));
  EXPECT_TRUE(alias(sx.flatten(0, 1)));
  EXPECT_TRUE(alias(sx.permute({2, 0, 1})));
  EXPECT_TRUE(alias(sx.transpose(0, 2)));
  EXPECT_TRUE(alias(sx.unsqueeze(1)));
  EXPECT_TRUE(alias(sx.unsqueeze(1).squeeze()));
  EXPECT_TRUE(alias(sx.narrow(0, 1, 4)));
  EXPECT_TRUE(alias(sx.slice(2, 1, None, 2)));
  EXPECT_TRUE(alias(sx.select(1, 2)));
  EXPECT_TRUE(alias(sx.expand({3, 6, 4, 5})));
  EXPECT_TRUE(alias(sx.split(2, 0)[1]));
  // In-place on a view changes the source, as in libtorch.
  auto v = sx.view({24, 5});
  v.mul_(2);
  EXPECT_TRUE(all_close(sx.full_tensor(), x * 2));
  auto n = sx.narrow(0, 2, 3);  // along the sharded dim
  n.zero_();
  auto expect = x * 2;
  expect.narrow(0, 2, 3).zero_();
  EXPECT_TRUE(all_close(sx.full_tensor(), expect));
  sx.select(1, 3).fill_(7);  // along an unsharded dim
  expect.select(1, 3).fill_(7);
  EXPECT_TRUE(all_close(sx.full_tensor(), expect));
}

// ---------------------------------------------------------------- squeeze / unsqueeze

TEST(ShapeSqueeze, OnlyGlobalSizeOneDims) {
  auto mesh = test_mesh();
  // Dim 0 has 5 elements: at 4 ranks some pieces hold one, and must keep it.
  auto x = seeded_randn({5, 1, 4, 1});
  const std::vector<st::Placements> layouts{{S0, S2}, {S2, S0}, {S1, S0}, {S3, S2}};
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.squeeze(); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.squeeze(1); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.squeeze(-1); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.squeeze(0); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.squeeze(2); }, x, layouts, mesh));
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S2, S0})));
  EXPECT_EQ(st::ShardTensor(sx.squeeze()).spec().placements(), fit_placements(mesh, {S1, S0}));
}

TEST(ShapeSqueeze, Unsqueeze) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 4});
  for (int64_t d : {0, 1, 2, -1, -3}) {
    EXPECT_TRUE(check_layouts([d](const at::Tensor& t) { return t.unsqueeze(d); }, x,
                              {{S0, S1}, {S1, S0}}, mesh))
        << "dim " << d;
  }
}

TEST(ShapeSqueeze, InPlaceViewOps) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 1, 4});
  const std::vector<st::Placements> layouts{{S0, S2}, {S2, S0}};
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        auto y = t * 1;
        y.squeeze_();
        return y;
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        auto y = t * 1;
        y.unsqueeze_(0);
        y.transpose_(1, 3);
        return y;
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        auto y = t * 1;
        y.squeeze_(1);
        y.t_();
        return y;
      },
      x, layouts, mesh));
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S1}));
  expect_error_everywhere([&] { sx.squeeze_(1); }, {"aten::squeeze_", "Shard(1)"});
}

// ---------------------------------------------------------------- permute / transpose

TEST(ShapePermute, PermuteTransposeMovedim) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 4, 3});
  const std::vector<st::Placements> layouts{{S0, S1}, {S2, S0}, {R, S2}};
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.permute({2, 0, 1});
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.permute({-1, 1, 0});
      },
      x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.transpose(0, 2); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.transpose(-1, 1); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.movedim(0, -1); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.swapaxes(0, 1); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.mT(); }, x, layouts, mesh));
  auto y = seeded_randn({5, 4});
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.t(); }, y, {{S0, S1}, {S1, R}}, mesh));
  // A permuted view then a reshape (copies locally), then a view back.
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.permute({1, 0, 2}).reshape({4, 15}).view({4, 5, 3});
      },
      x, {{S1, R}}, mesh));
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2})));
  EXPECT_EQ(st::ShardTensor(sx.permute({2, 0, 1})).spec().placements(),
            fit_placements(mesh, {S1, S0}));
}

// ---------------------------------------------------------------- narrow / slice / select

TEST(ShapeSlice, SliceAlongShardedAndUnshardedDims) {
  auto mesh = test_mesh();
  auto x = seeded_randn({11, 6});
  struct Case {
    c10::optional<int64_t> start, end;
    int64_t step;
  };
  const std::vector<Case> cases{{0, 11, 1},  {2, 9, 1},   {1, c10::nullopt, 2},
                                {-8, -1, 3}, {3, 100, 2}, {-100, 4, 1},
                                {5, 5, 1},   {12, 20, 1}, {c10::nullopt, c10::nullopt, 4},
                                {10, 11, 1}, {7, 3, 1},   {-3, c10::nullopt, 5}};
  const std::vector<st::Placements> layouts{{S0, S1}, {S1, S0}, {R, S0}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check_layouts(
        [c](const at::Tensor& t) { return t.slice(0, c.start, c.end, c.step); }, x, layouts, mesh))
        << "slice(0, " << c.start.value_or(-999) << ", " << c.end.value_or(-999) << ", " << c.step
        << ")";
  }
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.slice(1, 1, -1, 2); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.index({Slice(1, None, 3)}); }, x,
                            layouts, mesh));
  // The result's pieces: per-coordinate counts, summing to the length.
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  auto s = st::ShardTensor(sx.slice(0, 1, None, 3));
  const auto& sizes = s.spec().shard_sizes(0);
  EXPECT_EQ(std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), 4);
}

TEST(ShapeSlice, Narrow) {
  auto mesh = test_mesh();
  auto x = seeded_randn({11, 6});
  const std::vector<st::Placements> layouts{{S0, S1}, {S1, S0}};
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.narrow(0, 3, 5); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.narrow(0, -4, 2); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.narrow(0, 11, 0); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.narrow(-1, 2, 3); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) { return t.narrow(0, at::scalar_tensor(2, at::kLong), 6); }, x,
      layouts, mesh));
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0}));
  expect_error_everywhere([&] { (void)sx.narrow(0, 8, 5); }, {"exceeds dimension size"});
}

TEST(ShapeSlice, Select) {
  auto mesh = test_mesh();
  auto x = seeded_randn({7, 5, 3});
  const std::vector<st::Placements> layouts{{S0, S1}, {S1, S2}, {S2, S0}};
  for (int64_t i : {0, 3, 6, -1, -7}) {
    EXPECT_TRUE(
        check_layouts([i](const at::Tensor& t) { return t.select(0, i); }, x, layouts, mesh))
        << "select(0, " << i << ")";
  }
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t.select(1, 2); }, x, layouts, mesh));
  EXPECT_TRUE(
      check_layouts([](const at::Tensor& t) { return t.select(-1, -1); }, x, layouts, mesh));
  EXPECT_TRUE(check_layouts([](const at::Tensor& t) { return t[4][1]; }, x, layouts, mesh));
  // Selecting along the sharded dim replicates that mesh dim; other dims shift.
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2})));
  EXPECT_EQ(st::ShardTensor(sx.select(0, 3)).spec().placements(), fit_placements(mesh, {R, S1}));
  expect_error_everywhere([&] { (void)sx.select(0, 7); }, {"out of range"});
}

// ---------------------------------------------------------------- expand

TEST(ShapeExpand, ExpandKeepsShardedDims) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 1, 4});
  const std::vector<st::Placements> layouts{{S0, S2}, {S2, R}, {R, S0}};
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.expand({5, 3, 4});
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.expand({2, 5, 3, 4});
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.expand({-1, 3, -1});
      },
      x, layouts, mesh));
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        return t.expand_as(at::empty({2, 5, 3, 4})) * 1.5;
      },
      x, layouts, mesh));
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S1}));
  expect_error_everywhere(
      [&] {
        (void)sx.expand({5, 3, 4});
      },
      {"aten::expand", "Shard(1)", "sharded dim 1"});
}

// ---------------------------------------------------------------- split / unbind

TEST(ShapeSplit, SplitChunkUnbind) {
  auto mesh = test_mesh();
  auto x = seeded_randn({10, 6});
  const std::vector<st::Placements> layouts{{S0, S1}, {S1, S0}};
  for (int64_t k = 0; k < 4; ++k) {
    EXPECT_TRUE(
        check_layouts([k](const at::Tensor& t) { return t.split(3, 0)[k]; }, x, layouts, mesh))
        << "split(3, 0)[" << k << "]";
    EXPECT_TRUE(check_layouts(
        [k](const at::Tensor& t) {
          return t.split_with_sizes({2, 0, 5, 3}, 0)[k];
        },
        x, layouts, mesh))
        << "split_with_sizes[" << k << "]";
  }
  for (int64_t k = 0; k < 3; ++k) {
    EXPECT_TRUE(
        check_layouts([k](const at::Tensor& t) { return t.chunk(3, 0)[k]; }, x, layouts, mesh));
    EXPECT_TRUE(
        check_layouts([k](const at::Tensor& t) { return t.split(4, 1)[k % 2]; }, x, layouts, mesh));
    EXPECT_TRUE(check_layouts([k](const at::Tensor& t) { return t.tensor_split(3, 0)[k]; }, x,
                              layouts, mesh));
  }
  // Gradients flow into every piece.
  EXPECT_TRUE(check_layouts(
      [](const at::Tensor& t) {
        auto p = t.split(4, 0);
        return p[0] * 2 + p[1] * 3;
      },
      x, layouts, mesh));
  auto y = seeded_randn({3, 5, 4});
  for (int64_t k = 0; k < 3; ++k) {
    EXPECT_TRUE(check_layouts([k](const at::Tensor& t) { return t.unbind(0)[k]; }, y,
                              {{S0, S1}, {S1, S2}}, mesh));
    EXPECT_TRUE(check_layouts([k](const at::Tensor& t) { return t.unbind(2)[k] * (k + 1); }, y,
                              {{S0, S1}, {S2, S0}}, mesh));
  }
}

// ---------------------------------------------------------------- cat / stack

TEST(ShapeCat, AlongAnUnshardedDim) {
  auto mesh = test_mesh();
  auto a = seeded_randn({5, 3}, 1), b = seeded_randn({5, 4}, 2), c = seeded_randn({5, 2}, 3),
       d = seeded_randn({5, 1}, 4);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::cat(in, 1);
  };
  const auto ps = fit_placements(mesh, {S0, R});
  // ShardTensor, plain, replicated ShardTensor, same layout with other sizes.
  EXPECT_TRUE(reference_check(
      fn,
      {RefInput{a, ps}, RefInput{b, std::nullopt}, RefInput{c, fit_placements(mesh, {R, R})},
       RefInput{d, ps, true, sizes_with_empty_first(mesh, ps, d.sizes())}},
      mesh));
  // The first input plain; another sharded along the cat dim itself.
  EXPECT_TRUE(
      reference_check([](const std::vector<at::Tensor>& in,
                         const std::vector<at::Tensor>&) { return at::cat(in, -1); },
                      {RefInput{b, std::nullopt}, RefInput{a, fit_placements(mesh, {S0, S1})},
                       RefInput{c, fit_placements(mesh, {S1, S0})}},
                      mesh));
  auto sa = st::distribute_tensor(a, mesh, ps);
  auto out = st::ShardTensor(at::cat({sa, b}, 1));
  EXPECT_EQ(out.spec().placements(), ps);
}

TEST(ShapeCat, AlongAShardedDimIsGloballyOrdered) {
  auto mesh = test_mesh();
  auto a = seeded_randn({5, 3}, 1), b = seeded_randn({4, 3}, 2), c = seeded_randn({2, 3}, 3),
       d = seeded_randn({3, 3}, 4), e = seeded_randn({7, 3}, 5);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::cat(in, 0);
  };
  const auto ps = fit_placements(mesh, {S0, S1});
  EXPECT_TRUE(reference_check(fn, {RefInput{a, ps}, RefInput{b, ps}}, mesh));
  // Uneven and empty pieces, plain and replicated inputs, one sharded along
  // the other dim, one Partial.
  EXPECT_TRUE(reference_check(
      fn,
      {RefInput{a, ps}, RefInput{b, ps, true, sizes_with_empty_first(mesh, ps, b.sizes())},
       RefInput{c, std::nullopt}, RefInput{d, fit_placements(mesh, {R, S1})},
       RefInput{e, fit_placements(mesh, {S1, S0})},
       // (a Partial input's gradient is replicated, so reference_check, which
       // gathers gradients in the input's layout, cannot compare it)
       RefInput{a, fit_placements(mesh, {st::Partial{}, R}), false}},
      mesh));
  // Plain first; legacy empty 1-D input skipped; negative dim.
  EXPECT_TRUE(reference_check(
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::cat(in, -2);
      },
      {RefInput{c, std::nullopt}, RefInput{at::empty({0}), std::nullopt},
       RefInput{e, ps, true, sizes_with_empty_first(mesh, ps, e.sizes())}, RefInput{a, ps}},
      mesh));
  // Mixed dtypes promote like libtorch.
  EXPECT_TRUE(
      reference_check(fn, {RefInput{a, ps}, RefInput{b.to(at::kDouble), std::nullopt}}, mesh));
  // The result is balanced along the cat dim.
  auto sa = st::distribute_tensor(a, mesh, ps);
  auto sb = st::distribute_tensor(b, mesh, ps, false, sizes_with_empty_first(mesh, ps, b.sizes()));
  auto out = st::ShardTensor(at::cat({sa, sb, c}, 0));
  EXPECT_EQ(out.spec().placements(), ps);
  EXPECT_EQ(out.spec().shard_sizes(0), st::balanced_sizes(11, mesh.size(0)));
  EXPECT_TRUE(all_close(out.full_tensor(), at::cat({a, b, c}, 0)));
}

TEST(ShapeCat, Stack) {
  auto mesh = test_mesh();
  auto a = seeded_randn({5, 3}, 1), b = seeded_randn({5, 3}, 2), c = seeded_randn({5, 3}, 3);
  for (int64_t d : {0, 1, 2, -1}) {
    EXPECT_TRUE(
        reference_check([d](const std::vector<at::Tensor>& in,
                            const std::vector<at::Tensor>&) { return at::stack(in, d); },
                        {RefInput{a, fit_placements(mesh, {S0, S1})}, RefInput{b, std::nullopt},
                         RefInput{c, fit_placements(mesh, {S1, S0})}},
                        mesh))
        << "stack dim " << d;
  }
  EXPECT_TRUE(reference_check(
      [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        return at::stack(in, 1);
      },
      {RefInput{a, fit_placements(mesh, {S0, S1}), true,
                sizes_with_empty_first(mesh, fit_placements(mesh, {S0, S1}), a.sizes())},
       RefInput{b, fit_placements(mesh, {S0, S1})}},
      mesh));
  auto sa = st::distribute_tensor(a, mesh, fit_placements(mesh, {S0}));
  expect_error_everywhere(
      [&] {
        (void)at::stack({sa, seeded_randn({5, 2})}, 0);
      },
      {"stack expects each tensor to be equal size"});
}
