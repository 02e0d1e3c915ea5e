// Linear algebra rules (src/ops/linear.cpp): linear, matmul, mm, bmm, mv, dot,
// addmm, addmv, baddbmm and torch::nn::Linear, compared with plain libtorch on
// the full tensors: forward output, input gradients and parameter gradients.
//
// Every layout is written for a 2x2 mesh and trimmed by fit_placements() on a
// 1-D mesh, so one test covers 1, 2, 3 and 4 ranks and the 2x2 mesh. Extents
// are chosen not divisible by 3 or 4 (uneven shards); the empty(...) inputs give
// coordinate 0 of every sharded mesh dim an empty piece.
//
// Tolerances: the project's rtol 1e-5 / atol 1e-6. A sharded contraction (and
// every parameter gradient, which contracts over the sharded rows) re-associates
// a float32 sum (per-rank partial sums, then an all-reduce); at these extents the
// difference stays inside that tolerance on every decomposition tested.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

class LinAlg : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  // A sharded input with the balanced split.
  RefInput sh(const at::Tensor& full, const P& wanted, bool grad = true) {
    return sharded_input(mesh, full, wanted, grad);
  }
  // A sharded input whose first piece along every sharded mesh dim is empty.
  RefInput empty(const at::Tensor& full, const P& wanted, bool grad = true) {
    return empty_first_input(mesh, full, wanted, grad);
  }
  // A plain (replicated) input.
  static RefInput plain(const at::Tensor& full, bool grad = true) {
    return RefInput{full, std::nullopt, grad};
  }

  ::testing::AssertionResult check(const RefFn& fn, const std::vector<RefInput>& in,
                                   const std::vector<at::Tensor>& params = {}) {
    return reference_check(fn, in, mesh, params, kRtol, kAtol);
  }
};

std::string describe(const std::vector<RefInput>& in) {
  std::ostringstream os;
  for (const auto& r : in) {
    os << "[" << r.full.sizes() << " "
       << (r.placements ? st::to_string(*r.placements) : std::string("plain"))
       << (r.sizes ? " empty-first" : "") << "] ";
  }
  return os.str();
}

at::Tensor matmul_fn(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  return at::matmul(in[0], in[1]);
}

}  // namespace

// ---------------------------------------------------------------- linear

TEST_F(LinAlg, LinearSequenceSharded) {
  // The common SciML case: [B, S, F] sharded along S (and along B on the 2x2 mesh's
  // second mesh dim): no forward communication, weight gradients all-reduced.
  auto x = rnd({2, 7, 5}, 1);
  auto w = rnd({3, 5}, 2), b = rnd({3}, 3);
  auto with_bias = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0], p[1]);
  };
  auto no_bias = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0]);
  };
  for (const P& p : {P{S1, S0}, P{S1, R}, P{R, S1}}) {
    EXPECT_TRUE(check(with_bias, {sh(x, p)}, {w, b})) << st::to_string(p);
    EXPECT_TRUE(check(no_bias, {sh(x, p)}, {w})) << st::to_string(p);
    EXPECT_TRUE(check(with_bias, {empty(x, p)}, {w, b})) << st::to_string(p);
  }
}

TEST_F(LinAlg, LinearBatchSharded) {
  auto x = rnd({5, 3, 4}, 4);
  auto w = rnd({6, 4}, 5), b = rnd({6}, 6);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0], p[1]);
  };
  auto no_bias = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0]);
  };
  for (const P& p : {P{S0, S1}, P{S0, R}}) {
    EXPECT_TRUE(check(fn, {sh(x, p)}, {w, b})) << st::to_string(p);
    EXPECT_TRUE(check(no_bias, {sh(x, p)}, {w})) << st::to_string(p);
    EXPECT_TRUE(check(fn, {empty(x, p)}, {w, b})) << st::to_string(p);
  }
}

TEST_F(LinAlg, LinearFeatureShardedAllReduces) {
  // Contraction dim sharded, plain weight: the weight is sliced along its input
  // features, each rank computes a partial sum, an all-reduce completes it, and
  // the bias is added once, after the all-reduce.
  auto x = rnd({3, 7, 6}, 7);
  auto w = rnd({5, 6}, 8), b = rnd({5}, 9);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0], p[1]);
  };
  for (const P& p : {P{S2, S1}, P{S2, R}, P{S1, S2}, P{S2, S0}}) {
    EXPECT_TRUE(check(fn, {sh(x, p)}, {w, b})) << st::to_string(p);
    EXPECT_TRUE(check(fn, {empty(x, p)}, {w, b})) << st::to_string(p);
  }
  // 2-D input.
  auto x2 = rnd({7, 6}, 10);
  EXPECT_TRUE(check(fn, {sh(x2, {S1, S0})}, {w, b}));
  EXPECT_TRUE(check(fn, {empty(x2, {S1, S0})}, {w, b}));
}

TEST_F(LinAlg, LinearShardedWeight) {
  // Tensor-parallel weights: column-parallel (output features sharded) and
  // row-parallel (input features sharded), with a plain or a sharded input.
  auto x = rnd({2, 7, 6}, 11);
  auto w = rnd({5, 6}, 12), b = rnd({5}, 13);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], in[1], p[0]);
  };
  auto fn_sharded_bias = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::linear(in[0], in[1], in[2]);
  };
  std::vector<std::vector<RefInput>> cases = {
      {plain(x), sh(w, {S0, S1})},      {plain(x), sh(w, {S1, S0})},
      {plain(x), empty(w, {S0, R})},    {sh(x, {S1, R}), sh(w, {S0, S1})},
      {sh(x, {S2, R}), sh(w, {S1})},    {sh(x, {S2, S1}), empty(w, {S1, S0})},
      {sh(x, {S0, S1}), sh(w, {R, S0})}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(fn, c, {b})) << describe(c);
  }
  EXPECT_TRUE(check(fn_sharded_bias, {plain(x), sh(w, {S0, S1}), sh(b, {S0})}));
  EXPECT_TRUE(check(fn_sharded_bias, {sh(x, {S1, S0}), sh(w, {S1, S0}), sh(b, {R, S0})}));
}

TEST_F(LinAlg, LinearVectorShapes) {
  // 1-D input and 1-D weight (libtorch's linear allows both).
  auto w = rnd({5, 7}, 14), b = rnd({5}, 15), v = rnd({7}, 16);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0], p[1]);
  };
  EXPECT_TRUE(check(fn, {sh(v, {S0})}, {w, b}));
  EXPECT_TRUE(check(fn, {empty(v, {S0})}, {w, b}));
  auto x = rnd({6, 7}, 17);
  auto fn1 = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::linear(in[0], p[0]);
  };
  EXPECT_TRUE(check(fn1, {sh(x, {S0, S1})}, {v}));
  EXPECT_TRUE(check(fn1, {sh(x, {S1, S0})}, {v}));
}

TEST_F(LinAlg, NnLinearModule) {
  // torch::nn::Linear through aten::linear, with the module's own parameters:
  // after backward every rank's parameter gradients equal the single-process ones.
  for (const P& p : {P{S1, S0}, P{S2, S1}, P{S0, S2}}) {
    torch::manual_seed(42);
    torch::nn::Linear ref(torch::nn::LinearOptions(6, 4));
    torch::nn::Linear sharded(torch::nn::LinearOptions(6, 4));
    {
      torch::NoGradGuard g;
      sharded->weight.copy_(ref->weight);
      sharded->bias.copy_(ref->bias);
    }
    auto x = rnd({3, 7, 6}, 18);
    auto xr = x.clone().requires_grad_(true);
    auto xs = st::distribute_tensor(x, mesh, fit_placements(mesh, p), true);
    auto yr = ref(xr);
    auto ys = sharded(xs);
    EXPECT_TRUE(st::ShardTensor::is_shard_tensor(ys));
    EXPECT_TRUE(all_close(gathered(ys), yr, kRtol, kAtol)) << st::to_string(p);
    auto cot = rnd(yr.sizes(), 19);
    yr.backward(cot);
    st::backward(ys, cot);
    EXPECT_TRUE(all_close(sharded->weight.grad(), ref->weight.grad(), kRtol, kAtol))
        << st::to_string(p);
    EXPECT_TRUE(all_close(sharded->bias.grad(), ref->bias.grad(), kRtol, kAtol))
        << st::to_string(p);
    EXPECT_TRUE(all_close(gathered(xs.grad()), xr.grad(), kRtol, kAtol)) << st::to_string(p);
    // A full contraction of the output (built from this family's ops only) is a
    // plain scalar: loss.backward() works.
    sharded->zero_grad();
    ref->zero_grad();
    auto c3 = rnd({3}, 23), c7 = rnd({7}, 24), c4 = rnd({4}, 25);
    auto loss = [&](const at::Tensor& y) { return at::dot(at::matmul(c3, at::matmul(y, c4)), c7); };
    auto lr = loss(ref(xr));
    auto ls = loss(sharded(xs));
    EXPECT_FALSE(st::ShardTensor::is_shard_tensor(ls));
    lr.backward();
    ls.backward();
    EXPECT_TRUE(all_close(ls, lr, kRtol, kAtol));
    EXPECT_TRUE(all_close(sharded->weight.grad(), ref->weight.grad(), kRtol, kAtol))
        << st::to_string(p);
  }
}

TEST_F(LinAlg, SequenceShardedLinearForwardDoesNotCommunicate) {
  auto x = rnd({2, 9, 5}, 20);
  auto w = rnd({3, 5}, 21).requires_grad_(true), b = rnd({3}, 22).requires_grad_(true);
  auto xs = st::distribute_tensor(x, mesh, fit_placements(mesh, {S1, S0}), true);
  st::reset_comm_stats();
  auto y = at::linear(xs, w, b);
  EXPECT_EQ(st::comm_stats().bytes_sent, 0);
  EXPECT_EQ(st::comm_stats().messages, 0);
  EXPECT_EQ(st::to_string(st::ShardTensor(y).placements()),
            st::to_string(fit_placements(mesh, {S1, S0})));
  EXPECT_TRUE(all_ranks(true));
}

// ---------------------------------------------------------------- matmul

TEST_F(LinAlg, MatmulVectorVector) {
  // A dot product: the contraction is the only dim; the result is a plain scalar.
  auto a = rnd({11}, 30), b = rnd({11}, 31);
  std::vector<std::vector<RefInput>> cases = {
      {sh(a, {S0}), sh(b, {S0})},
      {sh(a, {S0}), plain(b)},
      {plain(a), empty(b, {S0})},
      {sh(a, {S0}), empty(b, {S0})},  // unequal splits: one side is re-split
      {empty(a, {R, S0}), sh(b, {S0, R})}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
  auto out = at::matmul(st::distribute_tensor(a, mesh, fit_placements(mesh, {S0})), b);
  EXPECT_FALSE(st::ShardTensor::is_shard_tensor(out));
  EXPECT_EQ(out.dim(), 0);
}

TEST_F(LinAlg, MatmulMatrixVector) {
  auto a = rnd({7, 6}, 32), v = rnd({6}, 33);
  std::vector<std::vector<RefInput>> cases = {{sh(a, {S0, S1}), plain(v)},
                                              {sh(a, {S1, S0}), sh(v, {S0})},
                                              {plain(a), empty(v, {S0})},
                                              {empty(a, {S0, S1}), sh(v, {R, S0})},
                                              {sh(a, {S0}), sh(v, {S0})}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

TEST_F(LinAlg, MatmulVectorMatrix) {
  auto v = rnd({7}, 34), b = rnd({7, 5}, 35);
  std::vector<std::vector<RefInput>> cases = {{sh(v, {S0}), plain(b)},
                                              {plain(v), sh(b, {S1, S0})},
                                              {sh(v, {S0}), sh(b, {S0, S1})},
                                              {empty(v, {S0}), sh(b, {S1})},
                                              {plain(v), empty(b, {S0, S1})}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

TEST_F(LinAlg, MatmulMatrixMatrix) {
  auto a = rnd({7, 6}, 36), b = rnd({6, 5}, 37);
  std::vector<std::vector<RefInput>> cases = {
      {sh(a, {S0, S1}), plain(b)},         // rows, and k on the 2x2 mesh
      {plain(a), sh(b, {S1, S0})},         // cols, and k
      {sh(a, {S1}), sh(b, {S0})},          // k on both
      {sh(a, {S1, R}), plain(b)},          // k, plain partner sliced
      {sh(a, {S0}), sh(b, {S1})},          // rows vs cols on one mesh dim: redistribute
      {sh(a, {S0, R}), sh(b, {R, S1})},    // 2-D: row blocks x col blocks
      {sh(a, {S0, S1}), sh(b, {R, S1})},   // k vs cols on mesh dim 1
      {sh(a, {S1, S0}), sh(b, {S0, S1})},  // 2x2: k on both, then rows vs cols
      {sh(a, {S1}), empty(b, {S0})},       // k, unequal splits
      {empty(a, {S0, S1}), empty(b, {S1, S0})},
      {sh(a, {S0, S1}), sh(b, {S0, R})},  // rows vs k
      {sh(a, {R, S1}), sh(b, {S0, R})}};  // k on different mesh dims
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

// Note [ring matmul]: rows vs cols (Q @ K^T) and rows vs k (P @ V) on one mesh
// dim keep both operands sharded; b's blocks circulate. Forward and gradients
// against plain, batched and broadcast, uneven and empty pieces, the 2x2 mesh.
TEST_F(LinAlg, RingMatmul) {
  auto q = rnd({2, 11, 4}, 60), k = rnd({2, 11, 4}, 61), v = rnd({11, 3}, 62);
  auto qk = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::matmul(in[0], in[1].transpose(-2, -1));
  };
  auto pv = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::matmul(at::matmul(in[0], in[1].transpose(-2, -1)), in[2]);
  };
  std::vector<std::vector<RefInput>> qk_cases = {
      {sh(q, {S1}), sh(k, {S1})},
      {sh(q, {S1, S0}), sh(k, {S1, S0})},  // 2x2: ring on mesh dim 0, batch on mesh dim 1
      {sh(q, {S0, S1}), sh(k, {S0, S1})},  // 2x2: batch on mesh dim 0, ring on mesh dim 1
      {empty(q, {S1}), sh(k, {S1})},
      {sh(q, {S1}), empty(k, {S1})},
      {empty(q, {R, S1}), empty(k, {R, S1})}};
  for (const auto& c : qk_cases) {
    EXPECT_TRUE(check(qk, c)) << "q @ k^T " << describe(c);
  }
  std::vector<std::vector<RefInput>> pv_cases = {
      {sh(q, {S1}), sh(k, {S1}), sh(v, {S0})},          // b = v, 2-D: broadcast batch
      {sh(q, {S1, S0}), sh(k, {S1, S0}), sh(v, {S0})},  // the 2x2 mesh
      {empty(q, {S1}), sh(k, {S1}), empty(v, {S0})},
      {sh(q, {S1}), empty(k, {S1}), sh(v, {S0})}};
  for (const auto& c : pv_cases) {
    EXPECT_TRUE(check(pv, c)) << "(q @ k^T) @ v " << describe(c);
  }
  // A vector contracted along the ring: rows vs k with a 1-D b.
  auto a = rnd({9, 7}, 63), x = rnd({7}, 64);
  EXPECT_TRUE(check(matmul_fn, {sh(a, {S0}), sh(x, {S0})}));
  EXPECT_TRUE(check(matmul_fn, {empty(a, {S0}), sh(x, {S0})}));
  // Float64.
  auto q64 = rnd({13, 5}, 65).to(at::kDouble), k64 = rnd({13, 5}, 66).to(at::kDouble);
  EXPECT_TRUE(check(qk, {sh(q64, {S0}), sh(k64, {S0})}));
}

// The ring replicates nothing (no gathered bytes, allowed in strict mode) and
// sends exactly P - 1 blocks of k per rank: every block but the next
// coordinate's (it is the last to arrive and is not sent on).
TEST_F(LinAlg, RingMatmulTraffic) {
  auto q = rnd({13, 8}, 67), k = rnd({13, 8}, 68);
  const P layout = fit_placements(mesh, {S0});
  auto sq = st::distribute_tensor(q, mesh, layout);
  auto sk = st::distribute_tensor(k, mesh, layout);
  const bool was_strict = st::strict();
  st::set_strict(true);
  st::reset_comm_stats();
  at::Tensor y;
  EXPECT_NO_THROW(y = at::matmul(sq, sk.t()));
  const auto stats = st::comm_stats();
  st::set_strict(was_strict);
  EXPECT_EQ(stats.gathered_bytes, 0);
  const int64_t P = mesh.size(0), me = mesh.coordinate()[0];
  const auto sizes = st::ShardTensor(sk).spec().shard_sizes(0);
  const int64_t expected = (13 - sizes[(me + 1) % P]) * 8 * 4;
  EXPECT_EQ(stats.bytes_sent, P == 1 ? 0 : expected);
  EXPECT_EQ(st::to_string(st::ShardTensor(y).placements()), st::to_string(layout));
  EXPECT_TRUE(all_close(gathered(y), at::matmul(q, k.t())));
}

TEST_F(LinAlg, MatmulBatched) {
  auto a = rnd({5, 7, 4}, 38), b = rnd({5, 4, 3}, 39);
  std::vector<std::vector<RefInput>> cases = {
      {sh(a, {S0, S1}), sh(b, {S0, R})},      // same batch dim on both (+ rows)
      {sh(a, {S0}), plain(b)},                // batch; the plain partner is sliced
      {plain(a), sh(b, {S0, S2})},            // batch + cols
      {sh(a, {S0}), sh(b, {S2})},             // batch vs cols: redistribute
      {sh(a, {S2, S1}), sh(b, {S1, R})},      // k on both
      {sh(a, {S1, S0}), sh(b, {R, S2})},      // rows, and batch vs cols
      {empty(a, {S0, S2}), sh(b, {S0, S1})},  // unequal batch splits
      {empty(a, {S2, S0}), plain(b)}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

TEST_F(LinAlg, MatmulBroadcast) {
  auto a4 = rnd({2, 1, 7, 4}, 40), b3 = rnd({3, 4, 5}, 41);  // -> [2, 3, 7, 5]
  auto a3 = rnd({5, 7, 4}, 42), b2 = rnd({4, 3}, 43), a2 = rnd({7, 4}, 44), v4 = rnd({4}, 45);
  auto b3b = rnd({5, 4, 3}, 46);
  std::vector<std::vector<RefInput>> cases = {
      {sh(a4, {S0, S2}), plain(b3)},        {plain(a4), sh(b3, {S0, S2})},
      {sh(a4, {S0}), sh(b3, {S0})},          // different batch dims on one mesh dim
      {sh(a4, {S1, S3}), sh(b3, {S0, S1})},  // a's size-1 batch dim sharded: gathered
      {sh(a4, {S2, S0}), sh(b3, {S2, S0})},  // rows vs cols, batch 0 on mesh dim 1
      {sh(a4, {S3, R}), sh(b3, {S1, S2})},   // k on both, cols
      {sh(a3, {S1, S0}), plain(b2)},        {sh(a3, {S2, S0}), sh(b2, {S0})},
      {plain(a2), sh(b3b, {S0, S2})},       {sh(a2, {S1, S0}), sh(b3b, {S1, S0})},
      {sh(v4, {S0}), sh(b3b, {S1, S0})},    {sh(a3, {S0, S1}), plain(v4)},
      {sh(a3, {S2, S1}), sh(v4, {S0})},     {empty(a4, {S2, S0}), empty(b3, {S2, S0})}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

TEST_F(LinAlg, PartialOperandIsSummedFirst) {
  // Partial inputs (a pending sum) are resolved before the product. Gradients of
  // a Partial input are not comparable with a gathered reference, so none here.
  auto a = rnd({7, 6}, 47), b = rnd({6, 5}, 48);
  std::vector<std::vector<RefInput>> cases = {
      {RefInput{a, fit_placements(mesh, {st::Partial{}, S0}), false}, plain(b)},
      {sh(a, {S0, S1}), RefInput{b, fit_placements(mesh, {st::Partial{}}), false}},
      {sh(a, {S1}), RefInput{b, fit_placements(mesh, {R, st::Partial{}}), false}}};
  for (const auto& c : cases) {
    EXPECT_TRUE(check(matmul_fn, c)) << describe(c);
  }
}

// ---------------------------------------------------------------- mm, bmm, mv, dot

TEST_F(LinAlg, MmBmmMvDot) {
  auto mm = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::mm(in[0], in[1]);
  };
  auto bmm = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::bmm(in[0], in[1]);
  };
  auto mv = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::mv(in[0], in[1]);
  };
  auto dot = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::dot(in[0], in[1]);
  };
  auto a = rnd({7, 6}, 50), b = rnd({6, 5}, 51), v = rnd({6}, 52), u = rnd({6}, 53);
  auto ba = rnd({5, 7, 4}, 54), bb = rnd({5, 4, 3}, 55);
  EXPECT_TRUE(check(mm, {sh(a, {S0, S1}), plain(b)}));
  EXPECT_TRUE(check(mm, {sh(a, {S1, S0}), sh(b, {S0, S1})}));
  EXPECT_TRUE(check(mm, {empty(a, {S1}), sh(b, {S0})}));
  EXPECT_TRUE(check(bmm, {sh(ba, {S0, S1}), plain(bb)}));
  EXPECT_TRUE(check(bmm, {sh(ba, {S2, S0}), sh(bb, {S1, S0})}));
  EXPECT_TRUE(check(bmm, {plain(ba), empty(bb, {S0, S2})}));
  EXPECT_TRUE(check(mv, {sh(a, {S0, S1}), plain(v)}));
  EXPECT_TRUE(check(mv, {sh(a, {S1, S0}), empty(v, {S0})}));
  EXPECT_TRUE(check(dot, {sh(v, {S0}), sh(u, {S0})}));
  EXPECT_TRUE(check(dot, {empty(v, {S0}), plain(u)}));
}

// ---------------------------------------------------------------- addmm, addmv, baddbmm

TEST_F(LinAlg, AddmmAddmvBaddbmm) {
  auto a = rnd({7, 6}, 60), b = rnd({6, 5}, 61), v = rnd({6}, 62);
  auto ba = rnd({5, 7, 4}, 63), bb = rnd({5, 4, 3}, 64);
  auto bias_mm = rnd({5}, 65), bias_mm2 = rnd({7, 5}, 66), bias_mv = rnd({7}, 67);
  auto bias_b = rnd({5, 7, 3}, 68);
  auto addmm_p = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::addmm(p[0], in[0], in[1], 0.5, 2.0);
  };
  auto addmm_in = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::addmm(in[0], in[1], in[2]);
  };
  auto addmv_p = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::addmv(p[0], in[0], in[1], 1.5, -1.0);
  };
  auto baddbmm_in = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::baddbmm(in[0], in[1], in[2], 0.5, 1.5);
  };
  // Contraction sharded: the bias must be added once, after the all-reduce.
  EXPECT_TRUE(check(addmm_p, {sh(a, {S1, S0}), plain(b)}, {bias_mm}));
  EXPECT_TRUE(check(addmm_p, {sh(a, {S1}), sh(b, {S0, S1})}, {bias_mm2}));
  EXPECT_TRUE(check(addmm_p, {sh(a, {S0, S1}), plain(b)}, {bias_mm}));
  EXPECT_TRUE(check(addmm_p, {empty(a, {S1, S0}), plain(b)}, {bias_mm2}));
  // A sharded bias in another layout than the product.
  EXPECT_TRUE(check(addmm_in, {sh(bias_mm2, {S1, S0}), sh(a, {S0, S1}), plain(b)}));
  EXPECT_TRUE(check(addmm_in, {sh(bias_mm, {S0}), plain(a), sh(b, {S1, S0})}));
  EXPECT_TRUE(check(addmv_p, {sh(a, {S0, S1}), plain(v)}, {bias_mv}));
  EXPECT_TRUE(check(addmv_p, {sh(a, {S1, S0}), sh(v, {S0})}, {bias_mv}));
  EXPECT_TRUE(check(baddbmm_in, {sh(bias_b, {S1, S0}), sh(ba, {S0, S2}), plain(bb)}));
  EXPECT_TRUE(check(baddbmm_in, {plain(bias_b), sh(ba, {S2, S0}), sh(bb, {S1, S0})}));
  EXPECT_TRUE(check(baddbmm_in, {empty(bias_b, {S0}), plain(ba), empty(bb, {S0, S2})}));
}

TEST_F(LinAlg, BetaZeroIgnoresTheBias) {
  auto a = rnd({7, 6}, 70), b = rnd({6, 5}, 71);
  auto nan_bias = at::full({7, 5}, std::numeric_limits<float>::quiet_NaN());
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::addmm(in[2], in[0], in[1], 0.0, 3.0);
  };
  EXPECT_TRUE(check(fn, {sh(a, {S1, S0}), plain(b), plain(nan_bias, false)}));
  EXPECT_TRUE(check(fn, {sh(a, {S0}), plain(b), sh(nan_bias, {S0, S1}, false)}));
}

TEST_F(LinAlg, InPlaceForms) {
  auto c = rnd({7, 5}, 72), a = rnd({7, 6}, 73), b = rnd({6, 5}, 74), v = rnd({6}, 75);
  auto cb = rnd({5, 7, 3}, 76), ba = rnd({5, 7, 4}, 77), bb = rnd({5, 4, 3}, 78);
  auto cv = rnd({7}, 79);
  auto addmm_ = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto out = in[0] * 1.0;  // a non-leaf copy in in[0]'s layout
    out.addmm_(in[1], in[2], 0.5, 2.0);
    return out;
  };
  auto addmv_ = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto out = in[0] * 1.0;
    out.addmv_(in[1], in[2]);
    return out;
  };
  auto baddbmm_ = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto out = in[0] * 1.0;
    out.baddbmm_(in[1], in[2], 0.0, 1.0);
    return out;
  };
  EXPECT_TRUE(check(addmm_, {sh(c, {S0, S1}), sh(a, {S1, S0}), plain(b)}));
  EXPECT_TRUE(check(addmm_, {sh(c, {S1}), sh(a, {S0, S1}), sh(b, {R, S0})}));
  EXPECT_TRUE(check(addmv_, {sh(cv, {S0}), sh(a, {S1, S0}), sh(v, {S0})}));
  EXPECT_TRUE(check(baddbmm_, {sh(cb, {S0, S1}), sh(ba, {S0, S2}), plain(bb)}));
}

TEST_F(LinAlg, OutForms) {
  // out= does not support autograd in libtorch either: values only.
  auto a = rnd({7, 6}, 80), b = rnd({6, 5}, 81), o = at::zeros({7, 5});
  auto w = rnd({5, 6}, 82), bias = rnd({5}, 83), o2 = at::zeros({7, 5});
  auto mm_out = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::mm_out(out, in[0], in[1]);
    return out;
  };
  auto matmul_out = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[2];
    at::matmul_out(out, in[0], in[1]);
    return out;
  };
  auto linear_out = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor out = in[3];
    at::linear_out(out, in[0], in[1], in[2]);
    return out;
  };
  EXPECT_TRUE(check(mm_out, {sh(a, {S1, S0}, false), plain(b, false), sh(o, {S0, S1}, false)}));
  EXPECT_TRUE(check(matmul_out, {sh(a, {S0, S1}, false), plain(b, false), sh(o, {S1, R}, false)}));
  EXPECT_TRUE(check(linear_out, {sh(a, {S1, S0}, false), plain(w, false), plain(bias, false),
                                 sh(o2, {S0}, false)}));
}

// ---------------------------------------------------------------- errors

namespace {

// Runs `fn`, which must throw on every rank with a message naming `op`; then a
// collective shows that no rank was left waiting.
void expect_error(const std::function<void()>& fn, const std::string& op) {
  bool threw = false;
  try {
    fn();
  } catch (const c10::Error& e) {
    threw = true;
    EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
  }
  EXPECT_TRUE(threw) << "expected " << op << " to throw";
  EXPECT_TRUE(all_ranks(true));
}

}  // namespace

TEST_F(LinAlg, ErrorsNameTheOpOnEveryRank) {
  auto p = fit_placements(mesh, {S0, S1});
  auto a = st::distribute_tensor(rnd({7, 6}, 90), mesh, p);
  auto ba = st::distribute_tensor(rnd({5, 7, 4}, 91), mesh, p);
  expect_error([&] { at::mm(a, rnd({5, 5}, 92)); }, "aten::mm");
  expect_error([&] { at::mm(a, rnd({6}, 92)); }, "aten::mm");
  expect_error([&] { at::bmm(ba, rnd({1, 4, 3}, 93)); }, "aten::bmm");
  expect_error([&] { at::matmul(ba, rnd({2, 4, 3}, 94)); }, "aten::matmul");
  expect_error([&] { at::matmul(a, rnd({6, 3}, 95).to(at::kDouble)); }, "aten::matmul");
  expect_error([&] { at::addmm(rnd({4}, 96), a, rnd({6, 3}, 97)); }, "aten::addmm");
  expect_error([&] { at::linear(ba, rnd({3, 5}, 98)); }, "aten::linear");
  expect_error([&] { rnd({7, 3}, 99).addmm_(a, rnd({6, 3}, 100)); }, "aten::addmm_");
  expect_error(
      [&] {
        at::dot(st::distribute_tensor(rnd({6}, 101), mesh, fit_placements(mesh, {S0})),
                rnd({7}, 102));
      },
      "aten::dot");
}

// einsum has no rule of its own: it decomposes (permute, reshape, bmm) and the
// pieces come back to the view rules and to this family's bmm.
TEST_F(LinAlg, EinsumDecomposes) {
  auto a = rnd({5, 7, 4}, 110), b = rnd({5, 4, 3}, 111);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::einsum("bij,bjk->bik", {in[0], in[1]});
  };
  EXPECT_TRUE(check(fn, {sh(a, {S0, S1}), plain(b)}));
  EXPECT_TRUE(check(fn, {sh(a, {S2}), sh(b, {S1})}));
}
