// Sliding-window extraction rules (src/ops/unfold.cpp) against plain libtorch
// on the gathered tensors: Tensor.unfold along sharded and unsharded dims,
// im2col (F::unfold) and col2im (F::fold) with padding, dilation and stride,
// fold(unfold(x)); outputs and input gradients, float32 and float64, balanced
// and empty-first pieces. Layouts are written for the 2x2 mesh and trimmed by
// fit_placements() on a 1-D mesh. Extents are not multiples of 3 or 4, so
// pieces are uneven and windows cross piece boundaries (multi-hop at 3-4
// ranks). Every sharded call runs in strict mode with no generic fallback and
// no gathered bytes; Tensor.unfold's traffic is exactly its halo.
#include <shardtensor/dispatch/stats.h>
#include <torch/torch.h>

#include "comm/accumulate.h"
#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble};
// (dtype, empty first pieces): float32 balanced, float64 with coordinate 0 of
// every sharded mesh dim empty (keeps the suite's runtime small).
const std::vector<std::pair<at::ScalarType, bool>> kCases = {{at::kFloat, false},
                                                             {at::kDouble, true}};
double rtol_of(at::ScalarType dt) { return dt == at::kDouble ? 1e-12 : 1e-5; }
double atol_of(at::ScalarType dt) { return dt == at::kDouble ? 1e-12 : 1e-5; }

// Strict mode on for the scope: any gather (fallback or inside a rule) throws.
struct StrictScope {
  StrictScope() { st::set_strict(true); }
  ~StrictScope() { st::set_strict(false); }
};

// Runs fn in strict mode; returns (fallbacks, gathered bytes) on this rank.
std::pair<int64_t, int64_t> strict_run(const std::function<void()>& fn) {
  StrictScope strict;
  st::reset_dispatch_stats();
  st::reset_comm_stats();
  fn();
  return {st::dispatch_stats().fallbacks, st::comm_stats().gathered_bytes};
}

class Unfold : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  RefInput in(const at::Tensor& full, const P& wanted, bool empty_first) {
    return empty_first ? empty_first_input(mesh, full, wanted) : sharded_input(mesh, full, wanted);
  }
  // reference_check in strict mode, asserting no fallback and no gather.
  void check(const RefFn& fn, const std::vector<RefInput>& inputs, at::ScalarType dt,
             const std::string& what) {
    ::testing::AssertionResult r = ::testing::AssertionSuccess();
    auto fb =
        strict_run([&] { r = reference_check(fn, inputs, mesh, {}, rtol_of(dt), atol_of(dt)); });
    EXPECT_TRUE(r) << what;
    EXPECT_TRUE(all_ranks(fb.first == 0 && fb.second == 0))
        << what << ": fallbacks " << fb.first << ", gathered bytes " << fb.second;
  }
};

std::string cfg(const std::vector<int64_t>& k, const std::vector<int64_t>& d,
                const std::vector<int64_t>& p, const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "k=" << c10::IntArrayRef(k) << " d=" << c10::IntArrayRef(d) << " p=" << c10::IntArrayRef(p)
     << " s=" << c10::IntArrayRef(s);
  return os.str();
}

}  // namespace

// ---- Tensor.unfold -------------------------------------------------------------

TEST_F(Unfold, TensorUnfoldAlongShardedDimEqualsSingleProcess) {
  const std::vector<std::pair<int64_t, int64_t>> windows = {{3, 1}, {3, 2},  {1, 1}, {4, 3},
                                                            {2, 5}, {11, 1}, {0, 2}};
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({2, 11, 5}, 1).to(dt);
    {
      for (auto [size, step] : windows) {
        check([size = size, step = step](
                  const std::vector<at::Tensor>& t,
                  const std::vector<at::Tensor>&) { return t[0].unfold(1, size, step); },
              {in(x, {S1, S2}, empty)}, dt,
              "unfold(1, " + std::to_string(size) + ", " + std::to_string(step) + ") empty " +
                  std::to_string(empty));
      }
      // Along the unsharded last dim (a view of the piece) and twice.
      check([](const std::vector<at::Tensor>& t,
               const std::vector<at::Tensor>&) { return t[0].unfold(0, 1, 1).unfold(2, 2, 1); },
            {in(x, {S1, R}, empty)}, dt, "unfold unsharded dims");
      check([](const std::vector<at::Tensor>& t,
               const std::vector<at::Tensor>&) { return t[0].unfold(-2, 4, 2).unfold(1, 3, 2); },
            {in(x, {S1, S0}, empty)}, dt, "unfold twice");
    }
  }
}

TEST_F(Unfold, TensorUnfoldMovesOnlyTheHalo) {
  // x [3, 13, 4] sharded on dim 1; windows of 4 every 3: each coordinate
  // receives exactly the rows of its window range it does not own.
  const int64_t n = 13, size = 4, step = 3, inner = 4, outer = 3;
  at::Tensor x = rnd({outer, n, inner}, 2);
  auto p = fit_placements(mesh, {S1, R});
  auto sx = st::distribute_tensor(x, mesh, p);
  const auto& sizes = st::ShardTensor(sx).spec().shard_sizes(0);
  const int64_t c = mesh.coordinate()[0];
  const auto off = st::offsets_of(sizes);
  // Windows whose start this coordinate owns (the last one takes the rest).
  const int64_t nwin = (n - size) / step + 1;
  int64_t w0 = -1, w1 = -1;
  for (int64_t w = 0; w < nwin; ++w) {
    const bool mine = w * step >= off[c] && w * step < off[c] + sizes[c];
    if (mine && w0 < 0) w0 = w;
    if (mine) w1 = w + 1;
  }
  int64_t halo_rows = 0;
  if (w0 >= 0) {
    const int64_t lo = w0 * step, hi = (w1 - 1) * step + size;
    halo_rows =
        (hi - lo) - std::max<int64_t>(0, std::min(hi, off[c] + sizes[c]) - std::max(lo, off[c]));
  }
  at::Tensor out;
  auto fb = strict_run([&] { out = sx.unfold(1, size, step); });
  const auto stats = st::comm_stats();
  EXPECT_TRUE(all_ranks(fb.first == 0 && fb.second == 0));
  EXPECT_TRUE(all_ranks(stats.bytes_received ==
                        halo_rows * outer * inner * static_cast<int64_t>(sizeof(float))))
      << "received " << stats.bytes_received << ", halo rows " << halo_rows;
  EXPECT_TRUE(all_close(gathered(out), x.unfold(1, size, step), 0, 0));
  // Window dim stays sharded by the same mesh dim.
  EXPECT_EQ(st::to_string(st::ShardTensor(out).spec().placements()), st::to_string(p));
  // The result is a copy: writes through it must raise rather than be lost.
  EXPECT_TRUE(throws_everywhere([&] { out.fill_(1.0); }, {"unfold"}));
}

TEST_F(Unfold, TensorUnfoldBadArgumentsThrowEverywhere) {
  auto sx = st::distribute_tensor(rnd({2, 7}, 3), mesh, fit_placements(mesh, {S1, R}));
  EXPECT_TRUE(throws_everywhere([&] { sx.unfold(1, 8, 1); }, {"aten::unfold", "Shard(1)"}));
  EXPECT_TRUE(throws_everywhere([&] { sx.unfold(1, 2, 0); }, {"aten::unfold", "[2, 7]"}));
  EXPECT_TRUE(throws_everywhere([&] { sx.unfold(3, 2, 1); }, {"aten::unfold"}));
}

// ---- im2col / col2im ------------------------------------------------------------

struct Win {
  std::vector<int64_t> k, d, p, s;
};
const std::vector<Win> kWins = {{{3, 3}, {1, 1}, {1, 1}, {1, 1}},
                                {{3, 2}, {2, 1}, {2, 0}, {2, 1}},
                                {{2, 2}, {1, 1}, {0, 0}, {2, 2}},
                                {{4, 1}, {1, 3}, {3, 1}, {3, 1}}};

TEST_F(Unfold, Im2colEqualsSingleProcess) {
  // H (and W on 2x2), W alone, C with H: every documented layout.
  const std::vector<P> layouts = {{S2, S3}, {S3, R}, {S1, S2}, {S0, S3}};
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({2, 3, 10, 9}, 4).to(dt);
    for (const auto& pl : layouts) {
      {
        for (const auto& w : kWins) {
          check(
              [w](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
                namespace F = torch::nn::functional;
                return F::unfold(t[0],
                                 F::UnfoldFuncOptions(w.k).dilation(w.d).padding(w.p).stride(w.s));
              },
              {in(x, pl, empty)}, dt,
              "im2col " + cfg(w.k, w.d, w.p, w.s) + " " + st::to_string(pl) + " empty " +
                  std::to_string(empty));
        }
      }
    }
  }
  // Unbatched input [C, H, W].
  at::Tensor x3 = rnd({3, 10, 9}, 5);
  check(
      [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
        return at::im2col(t[0], {3, 2}, {1, 2}, {1, 1}, {2, 1});
      },
      {in(x3, {S1, S2}, false)}, at::kFloat, "im2col unbatched");
}

TEST_F(Unfold, FoldOfUnfoldEqualsSingleProcess) {
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({2, 3, 10, 9}, 6).to(dt);
    for (const auto& pl : std::vector<P>{{S2, S3}, {S3, R}}) {
      {
        for (const auto& w : kWins) {
          check(
              [w](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
                namespace F = torch::nn::functional;
                auto cols = F::unfold(
                    t[0], F::UnfoldFuncOptions(w.k).dilation(w.d).padding(w.p).stride(w.s));
                return F::fold(
                    cols, F::FoldFuncOptions({10, 9}, w.k).dilation(w.d).padding(w.p).stride(w.s));
              },
              {in(x, pl, empty)}, dt,
              "fold(unfold) " + cfg(w.k, w.d, w.p, w.s) + " " + st::to_string(pl) + " empty " +
                  std::to_string(empty));
        }
      }
    }
  }
}

TEST_F(Unfold, Col2imOnShardedColumnsEqualsSingleProcess) {
  // Columns sharded along L (balanced: not whole block rows, so repartitioned)
  // and along C*kh*kw (not whole channels).
  for (const auto& [dt, empty] : kCases) {
    for (const auto& w : kWins) {
      const int64_t H = 10, W = 9, C = 3;
      const int64_t oh = (H + 2 * w.p[0] - w.d[0] * (w.k[0] - 1) - 1) / w.s[0] + 1;
      const int64_t ow = (W + 2 * w.p[1] - w.d[1] * (w.k[1] - 1) - 1) / w.s[1] + 1;
      at::Tensor cols = rnd({2, C * w.k[0] * w.k[1], oh * ow}, 7).to(dt);
      for (const auto& pl : std::vector<P>{{S2, S1}, {S1, S2}, {S0, S2}}) {
        {
          check(
              [&](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
                return at::col2im(t[0], {H, W}, w.k, w.d, w.p, w.s);
              },
              {in(cols, pl, empty)}, dt,
              "col2im " + cfg(w.k, w.d, w.p, w.s) + " " + st::to_string(pl) + " empty " +
                  std::to_string(empty));
        }
      }
    }
  }
}

TEST_F(Unfold, Im2colCol2imBadArgumentsThrowEverywhere) {
  auto sx = st::distribute_tensor(rnd({1, 2, 5, 5}, 8), mesh, fit_placements(mesh, {S2, S3}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::im2col(sx, {7, 7}, {1, 1}, {0, 0}, {1, 1});
      },
      {"aten::im2col", "[1, 2, 5, 5]", "does not fit"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::im2col(sx, {2, 2}, {0, 1}, {0, 0}, {1, 1});
      },
      {"aten::im2col", "dilation"}));
  auto sc = st::distribute_tensor(rnd({1, 8, 12}, 9), mesh, fit_placements(mesh, {S2, S1}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::col2im(sc, {5, 5}, {2, 2}, {1, 1}, {0, 0}, {1, 1});
      },
      {"aten::col2im", "sliding blocks"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        at::col2im(sc, {4, 5}, {3, 3}, {1, 1}, {0, 0}, {1, 1});
      },
      {"aten::col2im", "multiple of kernel_size"}));
}

// ---- the accumulate primitive ---------------------------------------------------

// <A x, y> == <x, A^T y> with A = accumulate_range and A^T = gather_range
// (fill 0): ranges that cross the global edges, trim, and reach past thin
// neighbours.
TEST_F(Unfold, AccumulateRangeIsTheAdjointOfGatherRange) {
  const int64_t m = 0, P = mesh.size(0), n = 3 * P + 2;
  std::vector<int64_t> sizes = st::balanced_sizes(n, P);
  if (P > 1) {
    sizes[0] += sizes[1];
    sizes[1] = 0;
  }
  const auto off = st::offsets_of(sizes);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t c = 0; c < P; ++c) ranges.emplace_back(off[c] - 2 - c % 2, off[c] + sizes[c] + 3);
  const int64_t me = mesh.coordinate()[0];
  const auto [lo, hi] = ranges[me];
  // Every coordinate along mesh dim 1 (2x2) draws the same values: the
  // inner products below sum over mesh dim 0 only.
  at::Tensor xr = rnd({2, hi - lo}, 100 + me).to(at::kDouble).requires_grad_();
  at::Tensor y = rnd({2, sizes[me]}, 200 + me).to(at::kDouble);
  at::Tensor ax = st::comm::accumulate_range(xr, mesh, m, 1, sizes, ranges);
  ASSERT_EQ(ax.sizes(), y.sizes());
  at::Tensor aty = st::comm::gather_range(y, mesh, m, 1, sizes, ranges);
  double lhs = (ax * y).sum().item<double>(), rhs = (xr * aty).sum().item<double>();
  // The gradient of accumulate_range is gather_range of the cotangent.
  ax.backward(y);
  EXPECT_TRUE(all_close(xr.grad(), aty, 0, 0));
  auto tot = st::comm::all_reduce(at::tensor({lhs, rhs}, at::kDouble), mesh, {m});
  EXPECT_NEAR(tot[0].item<double>(), tot[1].item<double>(), 1e-10);
  // A wrong extent on every rank (a wrong extent on one rank alone is a
  // carried error: Note [carried errors]).
  EXPECT_TRUE(throws_everywhere(
      [&] {
        st::comm::accumulate_range(rnd({2, hi - lo + 1}, 1), mesh, m, 1, sizes, ranges);
      },
      {"accumulate_range", "extent"}));
}

// ---- reshape / view / flatten / unflatten that merge or split a sharded dim -------

// Note [view merge]: [B, H, W] sharded on H -> [B, H*W] keeps the shard with
// sizes piece_H * W and moves nothing; sharded on W, the W split is moved onto
// H first (an all-to-all, no gather); splitting [B, H*W] -> [B, H, W] with
// pieces that are not whole rows of W repartitions. Values and gradients
// equal libtorch's, in strict mode (no gather, no fallback).
TEST_F(Unfold, MergeAndSplitOfAShardedDimEqualSingleProcess) {
  using Fn = std::function<at::Tensor(const at::Tensor&)>;
  const std::vector<std::pair<std::string, Fn>> merges = {
      {"flatten", [](const at::Tensor& t) { return t.flatten(1); }},
      {"reshape",
       [](const at::Tensor& t) {
         return t.reshape({2, 35});
       }},
      {"view",
       [](const at::Tensor& t) {
         return t.view({2, -1});
       }},
      {"flatten all", [](const at::Tensor& t) { return t.flatten(); }}};
  const std::vector<std::pair<std::string, Fn>> splits = {{"unflatten",
                                                           [](const at::Tensor& t) {
                                                             return t.unflatten(1, {7, 5});
                                                           }},
                                                          {"view",
                                                           [](const at::Tensor& t) {
                                                             return t.view({2, 7, 5});
                                                           }},
                                                          {"reshape", [](const at::Tensor& t) {
                                                             return t.reshape({2, 7, -1});
                                                           }}};
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({2, 7, 5}, 11).to(dt);
    at::Tensor y = rnd({2, 35}, 12).to(dt);
    {
      for (const auto& [name, fn] : merges) {
        for (const P& pl : std::vector<P>{{S1, R}, {S2, R}, {S2, S0}}) {
          // Flattening B with a sharded W on a 2x2 mesh must gather (tested below).
          if (name == "flatten all" && is_mesh_2x2() && pl == P{S2, S0}) continue;
          check([fn = fn](const std::vector<at::Tensor>& t,
                          const std::vector<at::Tensor>&) { return fn(t[0]) * 2; },
                {in(x, pl, empty)}, dt, "merge " + name + " " + st::to_string(pl));
        }
      }
      for (const auto& [name, fn] : splits) {
        check([fn = fn](const std::vector<at::Tensor>& t,
                        const std::vector<at::Tensor>&) { return fn(t[0]) * 2; },
              {in(y, {S1, S0}, empty)}, dt, "split " + name);
      }
      // Writes through a view that had to move data reach the source.
      check(
          [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
            at::Tensor u = t[0] * 1.5;
            u.unflatten(1, {7, 5}).narrow(1, 2, 3).fill_(3.0);
            u.view({2, 7, 5}).narrow(2, 1, 2).mul_(-2.0);
            return u * u;
          },
          {in(y, {S1, S0}, empty)}, dt, "writes through split views");
      check(
          [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
            at::Tensor u = t[0] * 1.5;
            u.view({2, 35}).narrow(1, 3, 20).mul_(-2.0);
            return u * u;
          },
          {in(x, {S2, R}, empty)}, dt, "writes through merged views");
    }
  }
}

TEST_F(Unfold, MergeOfAShardedOuterDimMovesNothing) {
  at::Tensor x = rnd({2, 7, 5}, 13);
  auto p = fit_placements(mesh, {S1, R});
  auto sx = st::distribute_tensor(x, mesh, p);
  const auto h = st::ShardTensor(sx).spec().shard_sizes(0);
  at::Tensor out;
  auto fb = strict_run([&] { out = sx.flatten(1); });
  const auto stats = st::comm_stats();
  EXPECT_TRUE(all_ranks(fb.first == 0 && stats.bytes_sent == 0 && stats.bytes_received == 0));
  std::vector<int64_t> want;
  for (int64_t n : h) want.push_back(n * 5);
  EXPECT_EQ(st::ShardTensor(out).spec().shard_sizes(0), want);
  EXPECT_EQ(st::to_string(st::ShardTensor(out).spec().placements()), st::to_string(p));
  EXPECT_TRUE(all_close(gathered(out), x.flatten(1), 0, 0));
}

TEST_F(Unfold, MergeOfTwoShardedDimsGathersVisibly) {
  if (!is_mesh_2x2()) return;  // needs H and W sharded by two mesh dims
  at::Tensor x = rnd({2, 7, 5}, 14);
  auto sx = st::distribute_tensor(x, mesh, {S1, S2});
  // Strict mode refuses the gather of the inner mesh dim, on every rank.
  {
    StrictScope strict;
    EXPECT_TRUE(throws_everywhere([&] { (void)sx.flatten(1); },
                                  {"aten::flatten", "both sharded", "strict"}));
  }
  st::reset_comm_stats();
  at::Tensor out = sx.flatten(1);
  EXPECT_TRUE(all_ranks(st::comm_stats().gathered_bytes > 0));
  EXPECT_TRUE(all_close(gathered(out), x.flatten(1), 0, 0));
  EXPECT_TRUE(reference_check(
      [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
        return t[0].reshape({2, 35}) * 2;
      },
      {in(x, {S1, S2}, true)}, mesh));
}

// ---- grid_sample ------------------------------------------------------------------

namespace {

// A grid near the identity over [Ho, Wo]: reaches only nearby input rows.
at::Tensor near_identity_grid(int64_t n, int64_t ho, int64_t wo, uint64_t seed, double jitter) {
  at::Tensor ys = at::linspace(-1, 1, ho, at::kFloat), xs = at::linspace(-1, 1, wo, at::kFloat);
  auto yx = at::meshgrid({ys, xs}, "ij");
  at::Tensor g = at::stack({yx[1], yx[0]}, 2).unsqueeze(0).expand({n, ho, wo, 2});
  return g + rnd({n, ho, wo, 2}, seed, jitter);
}

}  // namespace

TEST_F(Unfold, GridSampleEqualsSingleProcess) {
  const std::vector<P> layouts = {{S2, S3}, {S3, R}, {S1, S2}};
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({2, 3, 9, 7}, 21).to(dt);
    at::Tensor grid = near_identity_grid(2, 8, 6, 22, 0.08).to(dt);
    for (int64_t interp : {0, 1}) {
      for (int64_t padding : {0, 1, 2}) {
        for (bool align : {false, true}) {
          for (const auto& pl : layouts) {
            {
              check(
                  [=](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
                    return at::grid_sampler(t[0], t[1], interp, padding, align);
                  },
                  {in(x, pl, empty), RefInput{grid, std::nullopt, true}}, dt,
                  "grid_sample interp " + std::to_string(interp) + " padding " +
                      std::to_string(padding) + " align " + std::to_string(align) + " " +
                      st::to_string(pl) + " empty " + std::to_string(empty));
            }
          }
        }
      }
    }
  }
}

TEST_F(Unfold, GridSampleWithAShardedGridAndFunctional) {
  namespace F = torch::nn::functional;
  at::Tensor x = rnd({1, 2, 11, 6}, 23);
  // The grid sharded like the output (Ho on the mesh dim of H, Wo on W's).
  at::Tensor grid = near_identity_grid(1, 11, 6, 24, 0.1);
  for (bool empty : {false, true}) {
    for (auto mode : {0, 1}) {
      check(
          [mode](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
            auto o = F::GridSampleFuncOptions().align_corners(true);
            if (mode == 0) {
              o = o.mode(torch::kBilinear).padding_mode(torch::kReflection);
            } else {
              o = o.mode(torch::kNearest).padding_mode(torch::kBorder);
            }
            return F::grid_sample(t[0], t[1], o);
          },
          {in(x, {S2, S3}, empty), in(grid, {S1, S2}, empty)}, at::kFloat,
          "sharded grid mode " + std::to_string(mode) + " empty " + std::to_string(empty));
    }
  }
}

TEST_F(Unfold, GridSampleFarReachIsAVisibleGather) {
  at::Tensor x = rnd({1, 2, 13, 5}, 25);
  // Every output row samples the whole height (a flip plus noise).
  at::Tensor grid = near_identity_grid(1, 13, 5, 26, 0.05).flip(1);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S2, R}));
  const bool far = mesh.size(0) > 2;  // with 1-2 pieces every row is a neighbour's
  {
    StrictScope strict;
    if (far) {
      EXPECT_TRUE(throws_everywhere([&] { (void)at::grid_sampler(sx, grid, 0, 0, false); },
                                    {"aten::grid_sampler", "reaches beyond", "strict"}));
    }
  }
  st::reset_comm_stats();
  at::Tensor out = at::grid_sampler(sx, grid, 0, 0, false);
  const int64_t gb = st::comm_stats().gathered_bytes;
  // Counted where the reach is far (some rank fetches beyond its piece), never otherwise.
  const bool none = all_ranks(gb == 0);
  EXPECT_EQ(none, !far) << gb;
  EXPECT_TRUE(all_close(gathered(out), at::grid_sampler(x, grid, 0, 0, false)));
  // Gradients too (float32: the grid gradient reaches |37|, whose ulp is 4e-6,
  // so the file's float32 tolerance; float64 at 1e-12).
  for (auto dt : kDtypes) {
    EXPECT_TRUE(reference_check(
        [](const std::vector<at::Tensor>& t, const std::vector<at::Tensor>&) {
          return at::grid_sampler(t[0], t[1], 0, 2, true);
        },
        {in(x.to(dt), {S2, R}, true), RefInput{grid.to(dt), std::nullopt, true}}, mesh, {},
        rtol_of(dt), atol_of(dt)))
        << dt;
  }
}

TEST_F(Unfold, GridSampleBadArgumentsThrowEverywhere) {
  auto sx = st::distribute_tensor(rnd({2, 2, 6, 5}, 27), mesh, fit_placements(mesh, {S2, S3}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (void)at::grid_sampler(sx, rnd({3, 4, 4, 2}, 28), 0, 0, false);
      },
      {"aten::grid_sampler", "[N, Ho, Wo, 2]", "Shard(2)"}));
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (void)at::grid_sampler(sx, rnd({2, 4, 4, 2}, 28).to(at::kDouble), 0, 0, false);
      },
      {"aten::grid_sampler", "dtype"}));
}

// ---- diag_embed / diag ---------------------------------------------------------

// Note [diag_embed rows]: the row dim follows the sharded last dim; no bytes move.
TEST_F(Unfold, DiagEmbedAndDiagEqualSingleProcess) {
  for (const auto& [dt, empty] : kCases) {
    at::Tensor x = rnd({3, 7}, 31).to(dt);
    at::Tensor v = rnd({7}, 32).to(dt);
    for (int64_t offset : {0, 2, -3}) {
      for (auto [d1, d2] : std::vector<std::pair<int64_t, int64_t>>{{-2, -1}, {0, 2}, {2, 0}}) {
        for (const P& pl : std::vector<P>{{S1, S0}, {S0, R}}) {
          check(
              [offset, d1 = d1, d2 = d2](const std::vector<at::Tensor>& t,
                                         const std::vector<at::Tensor>&) {
                return at::diag_embed(t[0], offset, d1, d2) * 2;
              },
              {in(x, pl, empty)}, dt,
              "diag_embed offset " + std::to_string(offset) + " dims " + std::to_string(d1) + "," +
                  std::to_string(d2) + " " + st::to_string(pl));
        }
      }
      check([offset](const std::vector<at::Tensor>& t,
                     const std::vector<at::Tensor>&) { return at::diag(t[0], offset) * 2; },
            {in(v, {S0, R}, empty)}, dt, "diag offset " + std::to_string(offset));
    }
  }
  auto sv = st::distribute_tensor(rnd({7}, 33), mesh, fit_placements(mesh, {S0, R}));
  at::Tensor out;
  auto fb = strict_run([&] { out = at::diag(sv, 1); });
  EXPECT_TRUE(all_ranks(fb.first == 0 && st::comm_stats().bytes_received == 0));
  EXPECT_TRUE(throws_everywhere([&] { (void)at::diag_embed(sv, 0, 0, 0); },
                                {"aten::diag_embed", "identical"}));
}

// im2col along a sharded H receives exactly the rows of its output block's
// input range that other ranks own (zero padding at the global edge is not sent).
TEST_F(Unfold, Im2colMovesOnlyTheHalo) {
  const int64_t N = 2, C = 3, H = 11, W = 6;
  at::Tensor x = rnd({N, C, H, W}, 41);
  auto p = fit_placements(mesh, {S2, R});
  auto sx = st::distribute_tensor(x, mesh, p);
  const auto in_sizes = st::ShardTensor(sx).spec().shard_sizes(0);
  const auto off = st::offsets_of(in_sizes);
  const int64_t c = mesh.coordinate()[0], P = mesh.size(0);
  for (const auto& w : kWins) {
    const int64_t oh = (H + 2 * w.p[0] - w.d[0] * (w.k[0] - 1) - 1) / w.s[0] + 1;
    const auto out_sizes = oh == H ? in_sizes : st::balanced_sizes(oh, P);
    const int64_t o0 = st::offsets_of(out_sizes)[c];
    int64_t rows = 0;
    if (out_sizes[c] > 0) {
      const int64_t lo = std::max<int64_t>(o0 * w.s[0] - w.p[0], 0);
      const int64_t hi = std::min<int64_t>(
          (o0 + out_sizes[c] - 1) * w.s[0] - w.p[0] + w.d[0] * (w.k[0] - 1) + 1, H);
      const int64_t own =
          std::max<int64_t>(0, std::min(hi, off[c] + in_sizes[c]) - std::max(lo, off[c]));
      rows = std::max<int64_t>(hi - lo, 0) - own;
    }
    at::Tensor out;
    auto fb = strict_run([&] { out = at::im2col(sx, w.k, w.d, w.p, w.s); });
    const int64_t got = st::comm_stats().bytes_received;
    EXPECT_TRUE(all_ranks(fb.first == 0 && fb.second == 0));
    EXPECT_TRUE(all_ranks(got == rows * N * C * W * static_cast<int64_t>(sizeof(float))))
        << cfg(w.k, w.d, w.p, w.s) << ": received " << got << ", halo rows " << rows;
    EXPECT_TRUE(all_close(gathered(out), at::im2col(x, w.k, w.d, w.p, w.s), 0, 0));
  }
}
