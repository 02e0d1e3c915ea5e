// Neighbourhood attention on token grids (src/ops/neighborhood_attention.cpp,
// include/shardtensor/ops/neighborhood_attention.h) compared with a plain
// reference written here from the definition: full attention over all N
// tokens of the grid with a dense N x N visibility mask, built per dim from
// a brute-force window choice (the centred window of K keys in the query's
// residue class, shifted the least to fit inside the grid; causal: the K
// class members ending at the query). Output and dq/dk/dv on the gathered
// tensors, 1-, 2- and 3-D grids, dilation 1 and 2, causal and not, plain
// tensors and ShardTensors (uneven pieces, empty first pieces, two spatial
// dims on the 2x2 mesh, batch on one mesh dim and a spatial dim on the
// other). Also: per-rank peak memory against the single-process run, and
// errors on every rank.
//
// Tolerances: float64 cases at rtol 1e-10 / atol 1e-12 (the algebra must
// match to rounding: the reference sums over all N keys with exact zeros for
// hidden ones); float32 cases at the project's rtol 1e-5 / atol 1e-6.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

at::Tensor rnd_d(c10::IntArrayRef shape, uint64_t seed, at::ScalarType dt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble).to(dt);
}

// [n, n] bool: key j is in the window of query i along one dim.
at::Tensor dim_mask(int64_t n, int64_t K, int64_t d, bool causal) {
  auto m = torch::zeros({n, n}, torch::kBool);
  auto acc = m.accessor<bool, 2>();
  for (int64_t i = 0; i < n; ++i) {
    if (causal) {
      for (int64_t j = 0; j <= i; ++j) {
        if ((i - j) % d == 0 && (i - j) / d < K) acc[i][j] = true;
      }
      continue;
    }
    // Among all windows {s, s + d, ..., s + (K-1) d} inside [0, n) with s in
    // i's residue class, the one whose centre is nearest to i.
    int64_t best = -1, best_dist = std::numeric_limits<int64_t>::max();
    for (int64_t s = i % d; s + (K - 1) * d < n; s += d) {
      const int64_t dist = std::llabs(s + (K / 2) * d - i);
      if (dist < best_dist) {
        best_dist = dist;
        best = s;
      }
    }
    for (int64_t t = 0; t < K; ++t) acc[i][best + t * d] = true;
  }
  return m;
}

// Plain full attention over the flattened grid with the product mask.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t K,
                     int64_t d, bool causal) {
  const int64_t nd = q.dim() - 3;
  at::Tensor mask = torch::ones({1, 1}, torch::kBool);
  int64_t N = 1;
  for (int64_t sd = 0; sd < nd; ++sd) {
    const int64_t n = q.size(2 + sd);
    // Row-major token order: the new dim is the fastest.
    mask = (mask.unsqueeze(1).unsqueeze(3) & dim_mask(n, K, d, causal).unsqueeze(0).unsqueeze(2))
               .reshape({N * n, N * n});
    N *= n;
  }
  const int64_t B = q.size(0), H = q.size(1);
  at::Tensor qf = q.reshape({B, H, N, q.size(-1)}), kf = k.reshape({B, H, N, k.size(-1)}),
             vf = v.reshape({B, H, N, v.size(-1)});
  at::Tensor s = torch::matmul(qf, kf.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor out = torch::matmul(torch::softmax(s, -1), vf);
  std::vector<int64_t> shape(v.sizes().begin(), v.sizes().end());
  return out.reshape(shape);
}

struct Case {
  std::vector<int64_t> spatial;
  int64_t K = 3, d = 1;
  bool causal = false;
  P placements;  // wanted (fitted to the mesh); empty: plain tensors
  bool empty = false;
  at::ScalarType dtype = at::kDouble;
  int64_t B = 2, H = 2, D = 4;
};

class Natten : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  ::testing::AssertionResult run(const Case& c) {
    const double rtol = c.dtype == at::kDouble ? 1e-10 : 1e-5;
    const double atol = c.dtype == at::kDouble ? 1e-12 : 1e-6;
    std::vector<int64_t> shape{c.B, c.H};
    shape.insert(shape.end(), c.spatial.begin(), c.spatial.end());
    shape.push_back(c.D);
    auto q = rnd_d(shape, 1, c.dtype), k = rnd_d(shape, 2, c.dtype), v = rnd_d(shape, 3, c.dtype);
    std::vector<RefInput> in;
    for (const auto& t : {q, k, v}) {
      if (c.placements.empty()) {
        in.push_back(RefInput{t, std::nullopt});
      } else if (c.empty) {
        in.push_back(empty_first_input(mesh, t, c.placements));
      } else {
        in.push_back(sharded_input(mesh, t, c.placements));
      }
    }
    int calls = 0;  // first call: the reference on plain tensors; second: the library
    auto fn = [&](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>&) {
      if (calls++ == 0) return reference(x[0], x[1], x[2], c.K, c.d, c.causal);
      return st::neighborhood_attention(x[0], x[1], x[2], c.K, c.d, c.causal);
    };
    return reference_check(fn, in, mesh, {}, rtol, atol);
  }
};

// The reference's window: a spot check of NATTEN's clamping by hand (n = 7, K = 3).
TEST(NattenReference, WindowByHand) {
  auto m = dim_mask(7, 3, 1, false);
  EXPECT_TRUE(m[0].equal(torch::tensor({1, 1, 1, 0, 0, 0, 0}).to(torch::kBool)));
  EXPECT_TRUE(m[3].equal(torch::tensor({0, 0, 1, 1, 1, 0, 0}).to(torch::kBool)));
  EXPECT_TRUE(m[6].equal(torch::tensor({0, 0, 0, 0, 1, 1, 1}).to(torch::kBool)));
  auto md = dim_mask(7, 3, 2, false);  // classes {0,2,4,6} and {1,3,5}
  EXPECT_TRUE(md[1].equal(torch::tensor({0, 1, 0, 1, 0, 1, 0}).to(torch::kBool)));
  EXPECT_TRUE(md[6].equal(torch::tensor({0, 0, 1, 0, 1, 0, 1}).to(torch::kBool)));
  auto mc = dim_mask(7, 3, 2, true);
  EXPECT_TRUE(mc[5].equal(torch::tensor({0, 1, 0, 1, 0, 1, 0}).to(torch::kBool)));
  EXPECT_TRUE(mc[1].equal(torch::tensor({0, 1, 0, 0, 0, 0, 0}).to(torch::kBool)));
}

TEST_F(Natten, Plain1d2d3d) {
  EXPECT_TRUE(run({{17}, 5, 1, false, {}}));
  EXPECT_TRUE(run({{17}, 3, 3, true, {}}));
  EXPECT_TRUE(run({{9, 11}, 3, 2, false, {}}));
  EXPECT_TRUE(run({{9, 11}, 5, 1, true, {}, false, at::kFloat}));
  EXPECT_TRUE(run({{7, 6, 8}, 3, 2, false, {}}));
}

TEST_F(Natten, Sharded1d) {
  EXPECT_TRUE(run({{17}, 5, 1, false, {S2, S0}}));
  EXPECT_TRUE(run({{17}, 5, 1, false, {S2, S0}, true}));
  EXPECT_TRUE(run({{17}, 3, 2, false, {S2, R}, false, at::kFloat}));
  EXPECT_TRUE(run({{19}, 3, 2, true, {S2, S0}, true}));
  EXPECT_TRUE(run({{13}, 5, 1, true, {S2, R}}));
}

TEST_F(Natten, Sharded2d) {
  // Two spatial dims sharded on the 2x2 mesh (corners through both exchanges).
  EXPECT_TRUE(run({{9, 11}, 3, 1, false, {S2, S3}}));
  EXPECT_TRUE(run({{9, 11}, 3, 2, false, {S2, S3}, true}));
  EXPECT_TRUE(run({{9, 11}, 5, 1, true, {S3, S2}, false, at::kFloat}));
  // Batch on one mesh dim, a spatial dim on the other.
  EXPECT_TRUE(run({{10, 9}, 3, 2, true, {S3, S0}, true}));
  EXPECT_TRUE(run({{10, 9}, 5, 1, false, {S0, S2}}));
}

TEST_F(Natten, Sharded3d) {
  EXPECT_TRUE(run({{7, 6, 8}, 3, 1, false, {S4, S2}}));
  EXPECT_TRUE(run({{7, 6, 8}, 3, 2, false, {S2, S4}, true}));
  EXPECT_TRUE(run({{7, 6, 8}, 3, 2, true, {S3, S0}}));
  EXPECT_TRUE(run({{6, 7, 6}, 3, 1, true, {S2, S3}, true, at::kFloat}));
}

// Note [pending partial sums]: q, k and v projected from feature-sharded
// tokens arrive Partial over the feature mesh dim; neighborhood_attention sums
// them first. Values and the gradients of the tokens and the projections.
TEST_F(Natten, PartialProjections) {
  const auto x = rnd_d({2, 2, 9, 8, 6}, 7, at::kDouble);
  const auto wq = rnd_d({6, 4}, 8, at::kDouble), wk = rnd_d({6, 4}, 9, at::kDouble),
             wv = rnd_d({6, 4}, 10, at::kDouble);
  bool saw_partial = false;
  int calls = 0;
  auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& w) {
    const at::Tensor q = at::matmul(in[0], w[0]), k = at::matmul(in[0], w[1]),
                     v = at::matmul(in[0], w[2]);
    if (calls++ == 0) return reference(q, k, v, 3, 1, false);
    for (const auto& pl : st::ShardTensor(q).placements()) {
      saw_partial = saw_partial || std::holds_alternative<st::Partial>(pl);
    }
    return st::neighborhood_attention(q, k, v, 3, 1, false);
  };
  for (const P& p : {P{S4, S2}, P{S4, S0}}) {
    calls = 0;
    EXPECT_TRUE(reference_check(fn, {sharded_input(mesh, x, p)}, mesh, {wq, wk, wv}, 1e-10, 1e-12))
        << st::to_string(fit_placements(mesh, p));
  }
  EXPECT_TRUE(saw_partial);
}

// Per-rank peak memory (forward + backward) on a 2-D grid sharded over every
// rank stays near the single-process peak / P (measured on rank 0, shared).
TEST_F(Natten, MemoryPerRank) {
  P pl = fit_placements(mesh, {S2, S3});
  const int64_t P_ranks = mesh.size();
  const std::vector<int64_t> shape{1, 2, 64, 64, 16};
  auto q = rnd_d(shape, 41, at::kFloat), k = rnd_d(shape, 42, at::kFloat),
       v = rnd_d(shape, 43, at::kFloat);
  int64_t plain_peak = 0;
  if (st::world_rank() == 0) {
    auto qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true),
         vr = v.clone().requires_grad_(true);
    st::reset_peak_memory_stats();
    const int64_t base = st::memory_stats().current_bytes;
    st::neighborhood_attention(qr, kr, vr, 7, 1).sum().backward();
    plain_peak = st::memory_stats().peak_bytes - base;
  }
  MPI_Bcast(&plain_peak, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  auto sq = st::distribute_tensor(q, mesh, pl, true), sk = st::distribute_tensor(k, mesh, pl, true),
       sv = st::distribute_tensor(v, mesh, pl, true);
  q = k = v = at::Tensor();
  st::reset_peak_memory_stats();
  const int64_t base = st::memory_stats().current_bytes;
  st::neighborhood_attention(sq, sk, sv, 7, 1).sum().backward();
  const int64_t peak = st::memory_stats().peak_bytes - base;
  int64_t max_peak = peak;
  MPI_Allreduce(&peak, &max_peak, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (st::world_rank() == 0) {
    std::cout << "[memory] grid 64x64 K=7 P=" << P_ranks << ": single-process peak "
              << plain_peak / 1024 << " KiB, max per-rank peak " << max_peak / 1024
              << " KiB (ratio " << double(max_peak) / double(plain_peak)
              << ", 1/P = " << 1.0 / double(P_ranks) << ")\n";
  }
  // Halos and per-piece overheads allowed: 1.25 / P of the single-process peak.
  EXPECT_TRUE(all_ranks(plain_peak > 0 && peak * 4 * P_ranks <= plain_peak * 5));
}

TEST_F(Natten, Errors) {
  auto q = rnd_d({2, 2, 9, 11, 4}, 61, at::kFloat);
  P pl = fit_placements(mesh, {S2, S3});
  auto sq = st::distribute_tensor(q, mesh, pl);
  EXPECT_TRUE(
      throws_everywhere([&] { st::neighborhood_attention(sq, sq, sq, 4, 1); },
                        {"neighborhood_attention", "kernel_size", "[2, 2, 9, 11, 4]", "Shard(2)"}));
  EXPECT_TRUE(
      throws_everywhere([&] { st::neighborhood_attention(sq, sq, sq, 5, 2); },
                        {"neighborhood_attention", "exceeds the extent 9", "[2, 2, 9, 11, 4]"}));
  EXPECT_TRUE(throws_everywhere([&] { st::neighborhood_attention(q, q, q, 11, 1); },
                                {"neighborhood_attention", "exceeds the extent 9"}));
  EXPECT_TRUE(throws_everywhere([&] { st::neighborhood_attention(sq, q, q, 3, 1); },
                                {"neighborhood_attention", "all plain tensors or all ShardTensors",
                                 "Tensor[2, 2, 9, 11, 4]"}));
  auto sh = st::distribute_tensor(q, mesh, fit_placements(mesh, {S1, S2}));
  EXPECT_TRUE(throws_everywhere([&] { st::neighborhood_attention(sh, sh, sh, 3, 1); },
                                {"neighborhood_attention", "head and feature dims", "Shard(1)"}));
  auto sd = st::distribute_tensor(q, mesh, fit_placements(mesh, {S4, S2}));
  EXPECT_TRUE(throws_everywhere([&] { st::neighborhood_attention(sd, sd, sd, 3, 1); },
                                {"neighborhood_attention", "head and feature dims", "Shard(4)"}));
  auto q6 = rnd_d({1, 1, 2, 2, 2, 2, 4}, 62, at::kFloat);
  EXPECT_TRUE(throws_everywhere([&] { st::neighborhood_attention(q6, q6, q6, 1, 1); },
                                {"neighborhood_attention", "1 to 3 spatial dims"}));
}

}  // namespace
