// Reliability (issue 15): the transport's large-count paths (Note [large
// counts], exercised at small sizes by lowering the per-call limit), the
// watchdog's settings (Note [watchdog]; the expiry itself is tested by
// tests/watchdog_check.sh), agreement on requires_grad in from_local, NaN/Inf
// propagation through global reductions, the NaN/Inf-exact all_close, and one
// > 2 GiB scatter / gather / all-to-all (LargeCount.*, registered separately).
#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "comm/transport.h"
#include "testing.h"

namespace st = shardtensor;
namespace transport = shardtensor::comm::transport;
using namespace shardtensor::testing;

namespace {

/// Lowers the transport's per-call count limit for the scope.
class SmallCount {
 public:
  explicit SmallCount(int64_t n) : previous_(transport::set_max_count_for_testing(n)) {}
  ~SmallCount() { transport::set_max_count_for_testing(previous_); }

 private:
  int64_t previous_;
};

at::Tensor seeded(c10::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

// Uneven piece sizes with a zero: rank 1 owns nothing, rank c != 1 owns 3c + 5 + c % 2.
std::vector<int64_t> uneven(int p) {
  std::vector<int64_t> n(p);
  for (int c = 0; c < p; ++c) n[c] = c == 1 ? 0 : 3 * c + 5 + (c % 2);
  return n;
}

}  // namespace

// ---- Note [large counts] at small sizes -------------------------------------------

class ChunkedTransport : public ::testing::TestWithParam<int64_t> {};

TEST_P(ChunkedTransport, AllPrimitivesMatchUnchunked) {
  auto mesh = test_mesh();
  const SmallCount limit(GetParam());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    MPI_Comm comm = mesh.comm(m);
    const int p = transport::comm_size(comm), me = transport::comm_rank(comm);
    const auto n = uneven(p);
    const int64_t total = std::accumulate(n.begin(), n.end(), int64_t{0});
    const int64_t off = std::accumulate(n.begin(), n.begin() + me, int64_t{0});
    at::Tensor full = seeded({total}, 11 + m);  // the same on every rank
    std::vector<int64_t> bytes(p);
    for (int c = 0; c < p; ++c) bytes[c] = n[c] * 8;

    // all_gatherv
    at::Tensor gathered_full = at::empty({total}, at::kDouble);
    transport::all_gatherv(full.narrow(0, off, n[me]).contiguous(), gathered_full, bytes, comm);
    EXPECT_TRUE(gathered_full.equal(full)) << "all_gatherv, mesh dim " << m;

    // all_gatherv_rows (Note [strided gather]): [3, total, 2] gathered along dim 1.
    at::Tensor full3 = seeded({3, total, 2}, 21 + m);
    at::Tensor out3 = at::empty({3, total, 2}, at::kDouble);
    transport::all_gatherv_rows(full3.narrow(1, off, n[me]).movedim(1, 0).contiguous(), out3, n, 3,
                                2 * 8, comm);
    EXPECT_TRUE(out3.equal(full3)) << "all_gatherv_rows, mesh dim " << m;

    // scatterv from the last rank
    const int root = p - 1;
    at::Tensor piece = at::empty({n[me]}, at::kDouble);
    transport::scatterv(me == root ? full : at::Tensor(), bytes, piece, root, comm);
    EXPECT_TRUE(piece.equal(full.narrow(0, off, n[me]))) << "scatterv, mesh dim " << m;

    // broadcast_
    at::Tensor b = me == root ? full.clone() : at::zeros({total}, at::kDouble);
    transport::broadcast_(b, root, comm);
    EXPECT_TRUE(b.equal(full)) << "broadcast_, mesh dim " << m;

    // all_reduce_ (float and half), start_all_reduce_
    at::Tensor r = full * (me + 1);
    transport::all_reduce_(r, st::ReduceOp::Sum, comm);
    EXPECT_TRUE(at::allclose(r, full * (p * (p + 1) / 2.0))) << "all_reduce_, mesh dim " << m;
    at::Tensor h = at::ones({total}, at::kHalf);
    transport::all_reduce_(h, st::ReduceOp::Sum, comm);
    EXPECT_TRUE(h.equal(at::full({total}, p, at::kHalf))) << "all_reduce_ half, mesh dim " << m;
    at::Tensor pr = full * (me + 1);
    auto pending = transport::start_all_reduce_(pr, st::ReduceOp::Max, comm);
    pending.finish();
    EXPECT_TRUE(at::allclose(pr, at::maximum(full, full * p))) << "start_all_reduce_, dim " << m;

    // reduce_scatter
    at::Tensor rs = at::empty({n[me]}, at::kDouble);
    transport::reduce_scatter(full * (me + 1), rs, n, st::ReduceOp::Sum, comm);
    EXPECT_TRUE(at::allclose(rs, full.narrow(0, off, n[me]) * (p * (p + 1) / 2.0)))
        << "reduce_scatter, mesh dim " << m;

    // all_to_allv: rank me sends (me + 1) * (c + 1) + c doubles to rank c.
    auto count = [](int from, int to) { return int64_t{(from + 1) * (to + 1) + to}; };
    std::vector<int64_t> sb(p), sd(p), rb(p), rd(p);
    int64_t so = 0, ro = 0;
    for (int c = 0; c < p; ++c) {
      sb[c] = count(me, c) * 8;
      sd[c] = so;
      so += sb[c];
      rb[c] = count(c, me) * 8;
      rd[c] = ro;
      ro += rb[c];
    }
    at::Tensor send = at::arange(so / 8, at::kDouble) + 1000.0 * me;
    at::Tensor recv = at::full({ro / 8}, -1.0, at::kDouble);
    transport::all_to_allv(send, sb, sd, recv, rb, rd, comm);
    for (int c = 0; c < p; ++c) {
      // What c sent me: its elements from offset sum_{k<me} count(c, k).
      int64_t from = 0;
      for (int k = 0; k < me; ++k) from += count(c, k);
      at::Tensor expect = at::arange(from, from + count(c, me), at::kDouble) + 1000.0 * c;
      EXPECT_TRUE(recv.narrow(0, rd[c] / 8, count(c, me)).equal(expect))
          << "all_to_allv from " << c << ", mesh dim " << m;
    }

    // split-phase exchange with the neighbours (messages split into pieces)
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    const at::Tensor base = seeded({23}, 99);
    at::Tensor out = base + me;
    at::Tensor in = at::empty({23}, at::kDouble);
    auto ex = transport::start_exchange({transport::PeerBuffer{next, out}},
                                        {transport::PeerBuffer{prev, in}}, comm);
    ex.finish();
    EXPECT_TRUE(in.equal(base + prev)) << "exchange, mesh dim " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Limits, ChunkedTransport, ::testing::Values(1, 7, 64, INT_MAX));

TEST(ChunkedShardTensor, RoundTripsWithTinyMessages) {
  // scatter_tensor, full_tensor, redistribute and a stencil op, each with every
  // MPI call carrying at most 5 bytes / elements.
  auto mesh = test_mesh();
  const SmallCount limit(5);
  at::Tensor full = rnd({7, 5, 6}, 3);
  const st::Placements pl = fit_placements(mesh, {S0, S2});
  at::Tensor x = st::scatter_tensor(mesh.rank() == 0 ? full : at::Tensor(), 0, mesh, pl);
  EXPECT_TRUE(all_close(st::ShardTensor(x).full_tensor(), full, 0, 0));
  at::Tensor y = st::ShardTensor(x).redistribute(fit_placements(mesh, {S1, S0}));
  EXPECT_TRUE(all_close(st::ShardTensor(y).full_tensor(), full, 0, 0));
  EXPECT_TRUE(
      reference_check([](const std::vector<at::Tensor>& in,
                         const std::vector<at::Tensor>&) { return at::avg_pool1d(in[0], 3, 1, 1); },
                      {sharded_input(mesh, full, {S2, S1})}, mesh));
}

// ---- collective discipline ------------------------------------------------------

TEST(Agreement, FromLocalRequiresGradMustAgree) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  at::Tensor local = at::ones({2, 3});
  if (mesh.rank() == mesh.size() - 1) local.requires_grad_(true);
  EXPECT_TRUE(throws_everywhere(
      [&] {
        (void)st::ShardTensor::from_local(local, mesh, fit_placements(mesh, {S0, S1}));
      },
      {"from_local", "requires_grad", "mesh rank"}));
  // Agreeing ranks are fine either way.
  at::Tensor ok = st::ShardTensor::from_local(at::ones({2, 3}).requires_grad_(true), mesh,
                                              fit_placements(mesh, {S0, S1}));
  EXPECT_TRUE(st::ShardTensor(ok).local().requires_grad());
}

// ---- watchdog settings ------------------------------------------------------------

TEST(Watchdog, TimeoutSetter) {
  const double before = st::timeout();
  EXPECT_GE(before, 0.0);
  st::set_timeout(12.5);
  EXPECT_EQ(st::timeout(), 12.5);
  EXPECT_THROW(st::set_timeout(-1.0), c10::Error);
  EXPECT_THROW(st::set_timeout(std::numeric_limits<double>::infinity()), c10::Error);
  EXPECT_EQ(st::timeout(), 12.5);
  st::set_timeout(0.0);  // disabled: waits still complete
  auto mesh = test_mesh();
  at::Tensor s =
      st::distribute_tensor(at::ones({5, 4}), mesh, fit_placements(mesh, {S0, S1})).sum();
  EXPECT_EQ(s.item<float>(), 20.0f);
  st::set_timeout(before);
  {
    const st::OpLabel outer("outer");
    {
      const st::OpLabel inner("inner");
      EXPECT_STREQ(st::OpLabel::current(), "inner");
    }
    EXPECT_STREQ(st::OpLabel::current(), "outer");
  }
  EXPECT_STREQ(st::OpLabel::current(), "");
}

// ---- NaN / Inf --------------------------------------------------------------------

TEST(NonFinite, AllCloseComparesPositionsExactly) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto t = [](std::vector<double> v) { return at::tensor(v, at::kDouble); };
  EXPECT_TRUE(all_close(t({1, nan, inf, -inf}), t({1, nan, inf, -inf})));
  EXPECT_FALSE(all_close(t({1, nan}), t({1, inf})));
  EXPECT_FALSE(all_close(t({1, inf}), t({1, -inf})));
  EXPECT_FALSE(all_close(t({nan, 1}), t({1, nan})));
  EXPECT_FALSE(all_close(t({1, 2}), t({1, nan})));
}

TEST(NonFinite, OneRanksNaNReachesEveryRank) {
  // A NaN (or Inf) in the last rank's piece makes every global reduction
  // exactly what single-process libtorch gives, on every rank.
  auto mesh = test_mesh();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {nan, inf, -inf}) {
    at::Tensor full = rnd({6, 5}, 8).to(at::kDouble);
    full.index_put_({5, 4}, bad);  // the last element: on the last rank of every split
    const st::Placements pl = fit_placements(mesh, {S0, S1});
    at::Tensor x = st::distribute_tensor(full, mesh, pl);
    EXPECT_TRUE(all_close(x.sum(), full.sum())) << bad;
    EXPECT_TRUE(all_close(x.mean(), full.mean())) << bad;
    EXPECT_TRUE(all_close(x.amax(), full.amax())) << bad;
    EXPECT_TRUE(all_close(x.amin(), full.amin())) << bad;
    EXPECT_TRUE(all_close(gathered(x.sum(0)), full.sum(0))) << bad;
    EXPECT_TRUE(all_close(gathered(x.amax(1)), full.amax(1))) << bad;
    // The scalar is the same on every rank (bitwise, NaN included).
    const bool isnan_here = std::isnan(x.sum().item<double>());
    EXPECT_TRUE(all_ranks(isnan_here == std::isnan(full.sum().item<double>())));
  }
}

// Found by the NaN/Inf-exact all_close: softmax over a sharded dim whose row
// holds +Inf in one rank's piece gave NaN only at the Inf's position, while
// libtorch gives NaN for the whole row (ops/softmax.cpp subtracted 0 instead
// of the +inf maximum). Also NaN and -Inf, and log_softmax.
TEST(NonFinite, SoftmaxWithInfInOneRanksPiece) {
  auto mesh = test_mesh();
  for (double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    at::Tensor full = rnd({6, 5}, 8).to(at::kDouble);
    full.index_put_({5, 4}, bad);
    at::Tensor x = st::distribute_tensor(full, mesh, fit_placements(mesh, {S0, S1}));
    EXPECT_TRUE(all_close(gathered(at::softmax(x, 1)), at::softmax(full, 1))) << bad;
    EXPECT_TRUE(all_close(gathered(at::log_softmax(x, 1)), at::log_softmax(full, 1))) << bad;
  }
}

// ---- Note [layout-invariant randomness] -------------------------------------------

namespace {

using RandomOp = std::function<at::Tensor(const at::Tensor&)>;

struct NamedRandomOp {
  const char* name;
  RandomOp fn;
};

std::vector<NamedRandomOp> random_ops() {
  return {
      {"uniform_", [](const at::Tensor& x) { return x.clone().uniform_(-2.0, 3.0); }},
      {"normal_", [](const at::Tensor& x) { return x.clone().normal_(1.0, 2.0); }},
      {"bernoulli_(0.3)", [](const at::Tensor& x) { return x.clone().bernoulli_(0.3); }},
      {"bernoulli(probs)", [](const at::Tensor& x) { return at::bernoulli(at::sigmoid(x)); }},
      {"rand_like", [](const at::Tensor& x) { return at::rand_like(x); }},
      {"randn_like", [](const at::Tensor& x) { return at::randn_like(x); }},
      {"dropout", [](const at::Tensor& x) { return at::dropout(x, 0.4, /*train=*/true); }},
      {"dropout after mean (replicated)",
       [](const at::Tensor& x) { return at::dropout(x.mean({1}, true), 0.5, true); }},
      // Issue 25: these drew from each rank's generator on its piece.
      {"randint_like(10)", [](const at::Tensor& x) { return at::randint_like(x, 10); }},
      {"randint_like(-3, 7, long)",
       [](const at::Tensor& x) { return at::randint_like(x, -3, 7, at::kLong); }},
      {"random_()", [](const at::Tensor& x) { return x.clone().random_(); }},
      {"random_(7)", [](const at::Tensor& x) { return x.clone().random_(7); }},
      {"random_(-4, 9)", [](const at::Tensor& x) { return x.clone().random_(-4, 9); }},
      {"int64 random_()", [](const at::Tensor& x) { return x.to(at::kLong).random_(); }},
      {"int8 random_(-100, none)",
       [](const at::Tensor& x) { return x.to(at::kChar).random_(-100, c10::optional<int64_t>()); }},
      {"bool random_()", [](const at::Tensor& x) { return x.to(at::kBool).random_(); }},
      {"exponential_", [](const at::Tensor& x) { return x.clone().exponential_(2.0); }},
      {"geometric_", [](const at::Tensor& x) { return x.clone().geometric_(0.3); }},
      {"log_normal_", [](const at::Tensor& x) { return x.clone().log_normal_(0.5, 0.7); }},
      {"cauchy_", [](const at::Tensor& x) { return x.clone().cauchy_(1.0, 2.0); }},
  };
}

/// This rank's piece of `full` under `t`'s layout (for replicas: the whole extent).
at::Tensor expected_piece(const at::Tensor& t, const at::Tensor& full) {
  const auto& spec = st::ShardTensor(t).spec();
  at::Tensor piece = full;
  const auto offs = spec.local_offsets();
  const auto shape = spec.local_shape();
  for (int64_t d = 0; d < spec.ndim(); ++d) piece = piece.narrow(d, offs[d], shape[d]);
  return piece;
}

}  // namespace

TEST(Randomness, SameGlobalValuesAtAnyLayoutAndIdenticalReplicas) {
  auto mesh = test_mesh();
  auto self_mesh = st::DeviceMesh::create({1}, {"self"}, MPI_COMM_SELF);
  at::Tensor full = rnd({9, 7}, 21);
  std::vector<RefInput> layouts = {
      sharded_input(mesh, full, {S0, S1}, false), sharded_input(mesh, full, {S1, S0}, false),
      sharded_input(mesh, full, {R, S0}, false), sharded_input(mesh, full, {R, R}, false),
      empty_first_input(mesh, full, {S0, S1}, false)};
  for (const auto& op : random_ops()) {
    // Reference: the same op on a one-rank mesh (what any P must give).
    torch::manual_seed(1234);
    at::Tensor ref = st::ShardTensor(op.fn(st::distribute_tensor(full, self_mesh, {st::Shard{0}})))
                         .full_tensor();
    for (const auto& in : layouts) {
      // Ranks seeded differently: rank 0's key is used by all.
      torch::manual_seed(1234 + 1000 * mesh.rank());
      at::Tensor x = st::distribute_tensor(full, mesh, *in.placements, false, in.sizes);
      at::Tensor y = op.fn(x);
      ASSERT_TRUE(st::ShardTensor::is_shard_tensor(y)) << op.name;
      // Values equal up to the rounding of the op's other arithmetic (the mean
      // before a dropout is summed in a layout-dependent order); the random
      // part (which elements are zero, the draws themselves) is exact.
      EXPECT_TRUE(all_close(st::ShardTensor(y).full_tensor(), ref, 1e-6, 1e-7))
          << op.name << " at " << st::ShardTensor(y).spec().to_string();
      // Every rank's piece, replicas included, is its slice of the reference,
      // with exactly the same zero pattern.
      const at::Tensor mine = st::ShardTensor(y).local();
      const at::Tensor want = expected_piece(y, ref);
      EXPECT_TRUE(all_ranks(mine.sizes() == want.sizes() && (mine == 0).equal(want == 0) &&
                            mine.allclose(want, 1e-6, 1e-7)))
          << op.name << " replicas at " << st::ShardTensor(y).spec().to_string();
    }
  }
}

TEST(Randomness, DistributionsAndSeeds) {
  auto mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, S1});
  at::Tensor x = st::distribute_tensor(at::zeros({128, 96}), mesh, pl);
  torch::manual_seed(5);
  at::Tensor u = st::ShardTensor(at::rand_like(x)).full_tensor();
  torch::manual_seed(5);
  at::Tensor u2 = st::ShardTensor(at::rand_like(x)).full_tensor();
  torch::manual_seed(6);
  at::Tensor u3 = st::ShardTensor(at::rand_like(x)).full_tensor();
  EXPECT_TRUE(u.equal(u2));
  EXPECT_FALSE(u.equal(u3));
  EXPECT_GE(u.min().item<float>(), 0.0f);
  EXPECT_LT(u.max().item<float>(), 1.0f);
  EXPECT_NEAR(u.mean().item<double>(), 0.5, 0.02);
  EXPECT_NEAR(u.var().item<double>(), 1.0 / 12.0, 0.01);
  at::Tensor z = st::ShardTensor(at::randn_like(x)).full_tensor();
  EXPECT_NEAR(z.mean().item<double>(), 0.0, 0.05);
  EXPECT_NEAR(z.std().item<double>(), 1.0, 0.05);
  // Neighbouring elements are not correlated.
  at::Tensor zf = z.view(-1);
  EXPECT_NEAR(
      (zf.narrow(0, 0, zf.numel() - 1) * zf.narrow(0, 1, zf.numel() - 1)).mean().item<double>(),
      0.0, 0.05);
  // Dropout: about p dropped, survivors scaled by 1/(1-p), gradient is the mask.
  at::Tensor ones = st::distribute_tensor(at::ones({128, 96}), mesh, pl, /*requires_grad=*/true);
  at::Tensor d = at::dropout(ones, 0.25, true);
  at::Tensor df = st::ShardTensor(d).full_tensor();
  at::Tensor kept = df != 0;
  EXPECT_TRUE(df.masked_select(kept).allclose(at::full({1}, 1.0 / 0.75)));
  EXPECT_NEAR(1.0 - kept.to(at::kDouble).mean().item<double>(), 0.25, 0.02);
  st::backward(d, at::ones({128, 96}));
  EXPECT_TRUE(all_close(st::ShardTensor(ones).grad().full_tensor(), df, 0, 0));
  // Bad arguments throw on every rank.
  EXPECT_TRUE(throws_everywhere([&] { (void)x.clone().uniform_(2.0, 1.0); }, {"uniform_"}));
  EXPECT_TRUE(throws_everywhere([&] { (void)x.clone().bernoulli_(1.5); }, {"bernoulli_"}));
}

// ---- > 2 GiB (registered separately at np = 2, label "large") ---------------------

/// Local. The int8 pattern (i mod 251) for flat global indices [start, start + len).
at::Tensor pattern(int64_t start, int64_t len) {
  at::Tensor out = at::empty({len}, at::kChar);
  const int64_t step = int64_t{1} << 24;
  for (int64_t s = 0; s < len; s += step) {
    const int64_t k = std::min(step, len - s);
    out.narrow(0, s, k).copy_((at::arange(k, at::kLong) + (start + s)).remainder(251));
  }
  return out;
}

/// Local. True iff the contiguous int8 `t` holds pattern(start, t.numel()).
bool matches_pattern(const at::Tensor& t, int64_t start) {
  at::Tensor flat = t.contiguous().view(-1);
  const int64_t step = int64_t{1} << 24;
  for (int64_t s = 0; s < flat.numel(); s += step) {
    const int64_t k = std::min(step, flat.numel() - s);
    if (!flat.narrow(0, s, k).equal(pattern(start + s, k))) return false;
  }
  return true;
}

TEST(LargeCount, ScatterGatherAllToAllOver2GiB) {
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  ASSERT_EQ(mesh.size(), 2) << "run at np = 2";
  // 2150 MiB of int8 as [2, n]: the root's scatter buffer (2150 MiB) and the
  // all-gather (2150 MiB on every rank) exceed INT_MAX bytes; the all-to-all
  // moves 537 MiB each way.
  const int64_t n = (int64_t{2150} << 20) / 2;
  at::Tensor x;
  {
    at::Tensor full;
    if (mesh.rank() == 0) full = pattern(0, 2 * n).view({2, n});
    x = st::scatter_tensor(full, 0, mesh, {st::Shard{1}});
  }
  const auto& local = st::ShardTensor(x).local();
  const int64_t w = n / 2, off = mesh.rank() * w;
  ASSERT_EQ(local.size(1), w);
  EXPECT_TRUE(all_ranks(matches_pattern(local[0], off) && matches_pattern(local[1], n + off)));
  // all-to-all: Shard{1} -> Shard{0}.
  at::Tensor y = st::ShardTensor(x).redistribute({st::Shard{0}});
  x = at::Tensor();
  EXPECT_TRUE(all_ranks(matches_pattern(st::ShardTensor(y).local(), mesh.rank() * n)));
  // all-gather: every rank gets the whole tensor.
  at::Tensor g = st::ShardTensor(y).full_tensor();
  y = at::Tensor();
  EXPECT_EQ(g.numel(), 2 * n);
  EXPECT_TRUE(all_ranks(matches_pattern(g, 0)));
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("[rank %d] LargeCount peak RSS %.2f GiB\n", mesh.rank(),
              static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0));
}

// Issue 25: the ranges and moments of the draws that moved to
// Note [layout-invariant randomness] (those of libtorch's own ops), and
// libtorch's argument checks, raised on every rank.
TEST(Randomness, IntegerAndOtherDistributions) {
  auto mesh = test_mesh();
  const st::Placements pl = fit_placements(mesh, {S0, S1});
  at::Tensor x = st::distribute_tensor(at::zeros({128, 96}), mesh, pl);
  auto full = [](const at::Tensor& t) { return st::ShardTensor(t).full_tensor().to(at::kDouble); };
  torch::manual_seed(7);
  at::Tensor r = full(at::randint_like(x, -3, 7));
  EXPECT_EQ(r.min().item<double>(), -3.0);
  EXPECT_EQ(r.max().item<double>(), 6.0);
  EXPECT_TRUE(r.equal(r.round()));
  EXPECT_NEAR(r.mean().item<double>(), 1.5, 0.1);
  at::Tensor b = full(x.to(at::kByte).random_());
  EXPECT_EQ(b.min().item<double>(), 0.0);
  EXPECT_EQ(b.max().item<double>(), 255.0);
  at::Tensor f = full(x.clone().random_(5));
  EXPECT_EQ(f.min().item<double>(), 0.0);
  EXPECT_EQ(f.max().item<double>(), 4.0);
  at::Tensor e = full(x.clone().exponential_(2.0));
  EXPECT_GT(e.min().item<double>(), 0.0 - 1e-12);
  EXPECT_NEAR(e.mean().item<double>(), 0.5, 0.02);
  at::Tensor g = full(x.clone().geometric_(0.25));
  EXPECT_GE(g.min().item<double>(), 1.0);
  EXPECT_TRUE(g.equal(g.round()));
  EXPECT_NEAR(g.mean().item<double>(), 4.0, 0.15);
  at::Tensor ln = full(x.clone().log_normal_(0.0, 0.5)).log();
  EXPECT_NEAR(ln.mean().item<double>(), 0.0, 0.03);
  EXPECT_NEAR(ln.std().item<double>(), 0.5, 0.03);
  at::Tensor c = full(x.clone().cauchy_(1.0, 2.0));
  EXPECT_NEAR(c.median().item<double>(), 1.0, 0.1);
  EXPECT_TRUE(throws_everywhere([&] { (void)x.clone().exponential_(-1.0); }, {"exponential_"}));
  EXPECT_TRUE(throws_everywhere([&] { (void)x.clone().geometric_(2.0); }, {"geometric_"}));
  EXPECT_TRUE(throws_everywhere([&] { (void)x.clone().random_(5, 2); }, {"random_"}));
  EXPECT_TRUE(throws_everywhere([&] { (void)at::randint_like(x, 4, 4); }, {"randint_like"}));
}
