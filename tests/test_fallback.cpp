// The generic fallback (Note [generic fallback]) and visible gathers
// (Note [visible gathers]): ops with no rule give the single-process results
// and gradients on gathered data, warn once per op on mesh rank 0, count
// gathered_bytes, and strict mode refuses them on every rank.
#include <torch/torch.h>
#include <torch/version.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
using shardtensor::DeviceMesh;
using shardtensor::Placements;

namespace {

// Collects c10 warnings while alive.
struct WarningCapture : c10::WarningHandler {
  std::vector<std::string> msgs;
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& w) override { msgs.push_back(w.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    msgs.push_back(msg);
  }
#endif
  int64_t count(const std::string& needle) const {
    int64_t n = 0;
    for (const auto& m : msgs) n += m.find(needle) != std::string::npos;
    return n;
  }
};

#if TORCH_VERSION_MAJOR >= 2
namespace warn_api = c10::WarningUtils;
#else
namespace warn_api = c10::Warning;
#endif

// Installs a warning handler while alive.
struct HandlerGuard {
  c10::WarningHandler* prev;
  explicit HandlerGuard(c10::WarningHandler* h) : prev(warn_api::get_warning_handler()) {
    warn_api::set_warning_handler(h);
  }
  ~HandlerGuard() { warn_api::set_warning_handler(prev); }
};

// Restores the strict flag on scope exit.
struct StrictGuard {
  bool prev;
  explicit StrictGuard(bool on) : prev(st::strict()) { st::set_strict(on); }
  ~StrictGuard() { st::set_strict(prev); }
};

using Fn1 = std::function<at::Tensor(const at::Tensor&)>;

void sweep(const DeviceMesh& mesh, const std::string& name, const Fn1& f, const at::Tensor& x,
           const std::vector<Placements>& layouts, bool grad = true) {
  for (const auto& p : layouts) {
    for (bool empty : {false, true}) {
      for (auto dtype : {at::kFloat, at::kDouble}) {
        auto full = x.to(dtype);
        auto in =
            empty ? empty_first_input(mesh, full, p, grad) : sharded_input(mesh, full, p, grad);
        auto fn = [&](const std::vector<at::Tensor>& v, const std::vector<at::Tensor>&) {
          return f(v[0]);
        };
        EXPECT_TRUE(reference_check(fn, {in}, mesh, {}, 1e-5, 1e-6, grad))
            << name << " on " << st::to_string(*in.placements) << (empty ? " empty-first" : "")
            << " " << c10::toString(dtype);
      }
    }
  }
}

const std::vector<Placements> kLayouts = {{S0, S1}, {S1, S0}, {R, S1}, {S0, R}};

}  // namespace

TEST(Fallback, OpsWithoutRuleMatchSingleProcess) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 1);
  // Same shape as the input: re-sharded like it.
  sweep(
      mesh, "renorm", [](const at::Tensor& t) { return at::renorm(t, 2, 0, 1.5); }, x, kLayouts);
  sweep(
      mesh, "i0", [](const at::Tensor& t) { return at::i0(t); }, x, kLayouts);
  // Another shape: returned replicated (plain).
  sweep(
      mesh, "trace", [](const at::Tensor& t) { return at::trace(t); }, x, kLayouts);
  sweep(
      mesh, "diag", [](const at::Tensor& t) { return at::diag(t, 1) * 2.0; }, x, kLayouts);
  // Integer results (no gradient).
  sweep(
      mesh, "bucketize",
      [](const at::Tensor& t) {
        return at::bucketize(t, at::tensor(std::vector<double>{-1.0, 0.0, 0.5}, t.options()))
            .to(t.scalar_type());
      },
      x, kLayouts, false);
}

TEST(Fallback, ResultLayouts) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 2);
  auto p = fit_placements(mesh, {S0, S1});
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
  auto r = at::renorm(sx, 2, 0, 1.5);
  ASSERT_TRUE(st::ShardTensor::is_shard_tensor(r));
  EXPECT_EQ(st::ShardTensor(r).spec(), sx.spec());
  auto t = at::trace(sx);
  EXPECT_FALSE(st::ShardTensor::is_shard_tensor(t));
  EXPECT_TRUE(all_close(t, at::trace(x)));
}

TEST(Fallback, InPlaceWritesIntoTheShardTensor) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 3);
  for (const auto& wanted : kLayouts) {
    auto p = fit_placements(mesh, wanted);
    st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
    auto before = sx.local().data_ptr();
    auto& same = sx.renorm_(2, 1, 0.5);
    EXPECT_TRUE(same.is_same(sx));
    EXPECT_EQ(sx.local().data_ptr(), before);
    EXPECT_TRUE(all_close(sx.full_tensor(), at::renorm(x, 2, 1, 0.5)));
  }
}

TEST(Fallback, WarnsOncePerOpOnRankZeroAndCountsBytes) {
  st::set_strict(false);
  st::detail::reset_gather_warnings();
  auto mesh = test_mesh();
  auto x = rnd({8, 4}, 4);
  auto p = fit_placements(mesh, {S0, S1});
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
  WarningCapture cap;
  HandlerGuard guard(&cap);
  st::reset_comm_stats();
  auto a = at::trace(sx);
  const auto s1 = st::comm_stats();
  const int64_t expect = (x.numel() - sx.local().numel()) * 4;
  EXPECT_EQ(s1.gathered_bytes, expect);
  auto b = at::trace(sx);
  auto c = at::renorm(sx, 2, 0, 1.0);
  EXPECT_EQ(st::comm_stats().gathered_bytes, 3 * expect);
  // Rank 0 warns, once per op, when something was gathered (nothing is at P = 1).
  const int64_t want = mesh.rank() == 0 && expect > 0 ? 1 : 0;
  EXPECT_EQ(cap.count("aten::trace"), want);
  EXPECT_EQ(cap.count("aten::renorm"), want);
  if (want == 1) {
    EXPECT_EQ(cap.count("gathered " + std::to_string(expect) + " bytes per rank"), 2);
  }
}

TEST(Fallback, StrictModeRefusesOnEveryRank) {
  StrictGuard strict(true);
  auto mesh = test_mesh();
  auto x = rnd({6, 4}, 5);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  st::reset_comm_stats();
  EXPECT_TRUE(throws_everywhere([&] { auto y = at::trace(sx); },
                                {"no sharding rule", "aten::trace", "Shard(0)", "strict"}));
  EXPECT_EQ(st::comm_stats().gathered_bytes, 0);
  // Collectives still work afterwards.
  EXPECT_TRUE(all_close(st::ShardTensor(sx * 2.0).full_tensor(), x * 2.0));
}

TEST(VisibleGathers, MatmulReplicatingAnOperand) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  // a sharded along its rows, b along its batch dim, on the same mesh dim: no
  // ring applies, the planner replicates the smaller operand (b).
  auto a = rnd({5, 7, 4}, 6), b = rnd({5, 4, 3}, 7);
  st::ShardTensor sa(st::distribute_tensor(a, mesh, fit_placements(mesh, {S1, R})));
  st::ShardTensor sb(st::distribute_tensor(b, mesh, fit_placements(mesh, {S0, R})));
  {
    st::set_strict(false);
    st::reset_comm_stats();
    auto y = at::matmul(sa, sb);
    EXPECT_TRUE(all_close(gathered(y), at::matmul(a, b)));
    EXPECT_GT(st::comm_stats().gathered_bytes, 0);
  }
  {
    StrictGuard strict(true);
    EXPECT_TRUE(throws_everywhere([&] { auto y = at::matmul(sa, sb); },
                                  {"aten::matmul", "replicates", "strict"}));
  }
  // No gather: Q @ K^T on sequence-sharded tokens is a ring (Note [ring matmul]),
  // and row-sharded times a plain weight is local.
  auto q = rnd({7, 3}, 8), k = rnd({9, 3}, 9);
  auto p = fit_placements(mesh, {S0, R});
  st::ShardTensor sq(st::distribute_tensor(q, mesh, p));
  st::ShardTensor sk(st::distribute_tensor(k, mesh, p));
  {
    StrictGuard strict(true);
    st::reset_comm_stats();
    auto y = at::matmul(sq, sk.t());
    EXPECT_TRUE(all_close(gathered(y), at::matmul(q, k.t())));
    EXPECT_EQ(st::comm_stats().gathered_bytes, 0);
  }
  st::set_strict(false);
  st::reset_comm_stats();
  auto w = rnd({3, 5}, 10);
  auto y = at::matmul(sq, w);
  EXPECT_EQ(st::comm_stats().gathered_bytes, 0);
}

TEST(VisibleGathers, ChannelShardedConvInput) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  auto x = rnd({1, 4, 6, 6}, 9);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S1, S2})));
  // Note [channel-sharded conv]: partial sums over the input channels and a
  // reduce-scatter of the output; nothing is gathered, strict mode allows it.
  auto w = rnd({2, 4, 3, 3}, 10);
  {
    StrictGuard strict(true);
    st::reset_comm_stats();
    auto y = at::conv2d(sx, w, {}, 1, 1);
    EXPECT_TRUE(all_close(gathered(y), at::conv2d(x, w, {}, 1, 1), 1e-5, 1e-5));
    EXPECT_EQ(st::comm_stats().gathered_bytes, 0);
  }
  // A grouped convolution still replicates the channels: a visible gather.
  auto wg = rnd({2, 2, 3, 3}, 12);
  {
    st::set_strict(false);
    st::reset_comm_stats();
    auto y = at::conv2d(sx, wg, {}, 1, 1, 1, 2);
    EXPECT_TRUE(all_close(gathered(y), at::conv2d(x, wg, {}, 1, 1, 1, 2), 1e-5, 1e-5));
    EXPECT_GT(st::comm_stats().gathered_bytes, 0);
  }
  {
    StrictGuard strict(true);
    EXPECT_TRUE(throws_everywhere([&] { auto y = at::conv2d(sx, wg, {}, 1, 1, 1, 2); },
                                  {"conv", "channel", "strict"}));
  }
}

// Note [shard-dim swap]: swapping shard dims is a direct exchange now, not a
// gather: nothing counted in gathered_bytes, allowed in strict mode, and no
// rank sends more than its piece.
TEST(VisibleGathers, ShardDimSwapIsDirect) {
  auto mesh = test_mesh();
  if (mesh.ndim() < 2) GTEST_SKIP() << "needs the 2x2 mesh";
  auto x = rnd({5, 6}, 11);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, {S0, S1}));
  const int64_t piece_bytes = sx.local().numel() * static_cast<int64_t>(sizeof(float));
  for (bool strict : {false, true}) {
    StrictGuard guard(strict);
    WarningCapture warnings;
    HandlerGuard handler(&warnings);
    st::reset_comm_stats();
    st::ShardTensor y(sx.redistribute({S1, S0}));
    const st::CommStats s = st::comm_stats();
    EXPECT_TRUE(all_ranks(s.gathered_bytes == 0 && s.bytes_sent <= piece_bytes &&
                          warnings.count("gathered") == 0))
        << "strict " << strict << ": gathered " << s.gathered_bytes << " sent " << s.bytes_sent
        << " piece " << piece_bytes;
    EXPECT_TRUE(all_close(y.full_tensor(), x));
  }
}

// Issue 25 (Note [plain in-place target], src/ops/pointwise.cpp): the FNO
// spectral layer as written in the original code: a plain `out_ft` of zeros
// whose corner is assigned from a sharded einsum. It used to raise; now the
// einsum result is gathered, visibly: counted, warned once, refused in strict
// mode with the hint that keeps the data sharded. Outputs and gradients
// (input and weight) against single-process libtorch; sharded along H (the
// modes slice leaves pieces empty at P > 1) and, on 2x2, along the batch too.
TEST(VisibleGathers, PlainTargetOfAnInPlaceOp) {
  st::set_strict(false);
  st::detail::reset_gather_warnings();
  auto mesh = test_mesh();
  const int64_t B = 2, Ci = 3, Co = 2, H = 9, W = 8, m1 = 3, m2 = 3;
  auto x = rnd({B, Ci, H, W}, 11);
  auto w = at::complex(rnd({Ci, Co, m1, m2}, 12), rnd({Ci, Co, m1, m2}, 13));
  RefFn fno = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& prm) {
    at::Tensor x_ft = at::fft_rfft2(in[0]);
    at::Tensor out_ft =
        at::zeros({B, Co, H, W / 2 + 1}, at::TensorOptions().dtype(at::kComplexFloat));
    out_ft.slice(2, 0, m1).slice(3, 0, m2) =
        at::einsum("bixy,ioxy->boxy", {x_ft.slice(2, 0, m1).slice(3, 0, m2), prm[0]});
    return at::fft_irfft2(out_ft, std::vector<int64_t>{H, W});
  };
  for (const P& p : std::vector<P>{{S2}, {S2, S0}}) {
    EXPECT_TRUE(reference_check(fno, {sharded_input(mesh, x, p)}, mesh, {w}, 1e-4, 1e-5))
        << st::to_string(fit_placements(mesh, p));
    EXPECT_TRUE(reference_check(fno, {empty_first_input(mesh, x, p)}, mesh, {w}, 1e-4, 1e-5))
        << st::to_string(fit_placements(mesh, p)) << " empty-first";
  }
  // Counted and warned once (on mesh rank 0) when something is gathered.
  st::detail::reset_gather_warnings();
  WarningCapture cap;
  HandlerGuard guard(&cap);
  at::Tensor sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S2}));
  st::reset_comm_stats();
  (void)fno({sx}, {w});
  const int64_t bytes = st::comm_stats().gathered_bytes;
  (void)fno({sx}, {w});
  EXPECT_EQ(st::comm_stats().gathered_bytes, 2 * bytes);
  const int64_t corner = B * Co * m1 * m2 * 8;  // complex64
  const int64_t mine =
      st::ShardTensor(
          at::einsum("bixy,ioxy->boxy", {at::fft_rfft2(sx).slice(2, 0, m1).slice(3, 0, m2), w}))
          .local()
          .numel() *
      8;
  EXPECT_EQ(bytes, corner - mine);
  const int64_t want = mesh.rank() == 0 && bytes > 0 ? 1 : 0;
  EXPECT_EQ(cap.count("aten::copy_"), want);
  // Strict mode refuses on every rank and names the way to keep it sharded.
  StrictGuard strict(true);
  EXPECT_TRUE(throws_everywhere([&] { (void)fno({sx}, {w}); },
                                {"aten::copy_", "strict", "new_zeros", "Shard"}));
}
