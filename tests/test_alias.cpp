// Aliasing follows libtorch (issue 25, part B): Note [wrapper strides] and
// Note [stale copy views] (src/ops/shape.cpp). Every program runs on a plain
// tensor and on a ShardTensor of it (uneven, and with an empty piece at the
// first and at a later coordinate, several dtypes) and every step is compared.
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
using shardtensor::DeviceMesh;
using shardtensor::Placements;

namespace {

// A program over a list of tensors: ts[0] is the source; it may push views.
// It returns the tensors to compare after each step.
using Step = std::function<void(std::vector<at::Tensor>& ts)>;

void check_steps(const DeviceMesh& mesh, const std::string& name, const at::Tensor& x,
                 const std::vector<Step>& steps, const std::vector<Placements>& layouts,
                 const std::vector<at::ScalarType>& dtypes = {at::kFloat, at::kLong,
                                                              at::kComplexDouble}) {
  for (const auto& wanted : layouts) {
    const auto p = fit_placements(mesh, wanted);
    for (int empty = 0; empty < 3; ++empty) {
      for (auto dtype : dtypes) {
        at::Tensor full = x.to(dtype);
        std::optional<st::ShardSizes> sizes;
        if (empty == 1) sizes = sizes_with_empty_first(mesh, p, full.sizes());
        if (empty == 2) sizes = sizes_with_empty_at(mesh, p, full.sizes(), EmptyAt::kLast);
        std::vector<at::Tensor> ref{full.clone()};
        std::vector<at::Tensor> got{st::distribute_tensor(full, mesh, p, false, sizes)};
        for (size_t i = 0; i < steps.size(); ++i) {
          steps[i](ref);
          steps[i](got);
          ASSERT_EQ(ref.size(), got.size());
          for (size_t k = 0; k < ref.size(); ++k) {
            EXPECT_TRUE(all_close(gathered(got[k]), ref[k], 0, 0))
                << name << ": tensor " << k << " after step " << i << " on " << st::to_string(p)
                << " empty=" << empty << " " << c10::toString(dtype);
          }
        }
      }
    }
  }
}

const std::vector<Placements> kLayouts = {{S0, S1}, {S1, S0}, {S1, R}, {R, S0}};

using V = std::vector<at::Tensor>;

// Steps shared by the tests: take a view (or copy) of the source, write it, write the source.
Step push(std::function<at::Tensor(const at::Tensor&)> f) {
  return [f](V& ts) { ts.push_back(f(ts[0])); };
}
const Step mul_view = [](V& ts) { ts[1].mul_(10); };
const Step zero_src = [](V& ts) { ts[0].zero_(); };
const Step add_src = [](V& ts) { ts[0].add_(3); };

}  // namespace

// Issue 25 item 1: contiguous() of a transposed, permuted or sliced view is a
// copy, as in libtorch: writes through it leave the source alone and writes
// into the source leave it alone. Was: the wrapper always said contiguous, so
// contiguous() returned the view itself (at P = 1 too).
TEST(Alias, ContiguousOfANonContiguousViewIsACopy) {
  auto mesh = test_mesh();
  auto x = rnd({7, 5}, 1, 4.0).round();
  check_steps(
      mesh, "t().contiguous()", x,
      {push([](const at::Tensor& t) { return t.t().contiguous(); }), mul_view, zero_src, mul_view},
      kLayouts);
  check_steps(mesh, "t().contiguous() source first", x,
              {push([](const at::Tensor& t) { return t.t().contiguous(); }), add_src, mul_view},
              kLayouts);
  check_steps(mesh, "permute().contiguous()", x.reshape({7, 5, 1}),
              {push([](const at::Tensor& t) {
                 return t.permute({2, 1, 0}).contiguous();
               }),
               mul_view, zero_src, mul_view},
              {{S0, S1}, {S1, S0}});
  check_steps(mesh, "[:, 1:3].contiguous()", x,
              {push([](const at::Tensor& t) { return t.slice(1, 1, 3).contiguous(); }), mul_view,
               add_src, mul_view},
              kLayouts);
  // A contiguous view stays a view: contiguous() returns it.
  check_steps(mesh, "[1:4].contiguous() is a view", x,
              {push([](const at::Tensor& t) { return t.slice(0, 1, 4).contiguous(); }), mul_view,
               add_src, mul_view},
              kLayouts);
  // The strides themselves are libtorch's.
  at::Tensor u = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1}));
  EXPECT_EQ(u.t().strides(), x.t().strides());
  EXPECT_EQ(u.slice(1, 1, 3).strides(), x.slice(1, 1, 3).strides());
  EXPECT_FALSE(u.t().is_contiguous());
  EXPECT_TRUE(u.t().contiguous().is_contiguous());
}

// Issue 25: the view ops whose rules live outside ops/shape.cpp (real, imag,
// unfold, detach, alias, _conj, clone) give their wrappers libtorch's strides
// too. Was: `x.real.contiguous()`, `x.unfold(1, 2, 1).contiguous()` and
// `x.t().detach().contiguous()` returned the view, so writes through it
// changed `x` (and writes into `x` changed it), at any number of ranks.
TEST(Alias, ViewOpsOutsideShapeHaveTorchStrides) {
  auto mesh = test_mesh();
  auto x = rnd({7, 5}, 2, 4.0).round();
  const std::vector<at::ScalarType> complex = {at::kComplexFloat, at::kComplexDouble};
  check_steps(mesh, "real.contiguous()", x,
              {push([](const at::Tensor& t) { return at::real(t).contiguous(); }), mul_view,
               zero_src, mul_view},
              kLayouts, complex);
  check_steps(
      mesh, "imag.contiguous()", x,
      {push([](const at::Tensor& t) { return at::imag(t).contiguous(); }), add_src, mul_view},
      kLayouts, complex);
  // A view of a view: real then slice, still a view in both.
  check_steps(mesh, "real[:, 1:3] is a view", x,
              {push([](const at::Tensor& t) { return at::real(t).slice(1, 1, 3); }), mul_view,
               add_src, mul_view},
              kLayouts, complex);
  check_steps(mesh, "unfold(1, 2, 1).contiguous()", x,
              {push([](const at::Tensor& t) { return t.unfold(1, 2, 1).contiguous(); }), mul_view,
               zero_src, mul_view},
              {{S0, S1}, {R, S0}});
  // Windows along a sharded dim are a copy whose writes are refused; its
  // contiguous() and reshape() are copies of their own, as in libtorch, and
  // take writes (they inherit no refusal).
  check_steps(mesh, "unfold along a sharded dim, then contiguous()", x,
              {push([](const at::Tensor& t) { return t.unfold(1, 2, 1).contiguous(); }), mul_view,
               add_src, mul_view},
              {{S1, R}, {S0, S1}});
  check_steps(mesh, "unfold along a sharded dim, then reshape(-1)", x,
              {push([](const at::Tensor& t) { return t.unfold(1, 2, 1).reshape({-1}); }), mul_view,
               zero_src, mul_view},
              {{S1, R}, {S0, S1}});
  check_steps(mesh, "t().detach().contiguous()", x,
              {push([](const at::Tensor& t) { return t.t().detach().contiguous(); }), mul_view,
               add_src, mul_view},
              kLayouts);
  check_steps(mesh, "t().alias().contiguous()", x,
              {push([](const at::Tensor& t) { return at::alias(t.t()).contiguous(); }), mul_view,
               zero_src, mul_view},
              kLayouts);
  // detach of a contiguous tensor is a view, and contiguous() keeps it one.
  check_steps(mesh, "detach().contiguous() is a view", x,
              {push([](const at::Tensor& t) { return t.detach().contiguous(); }), mul_view, add_src,
               mul_view},
              kLayouts);
  // The strides themselves are libtorch's.
  const auto p = fit_placements(mesh, {S0, S1});
  const at::Tensor xc = x.to(at::kComplexDouble);
  const at::Tensor u = st::distribute_tensor(xc, mesh, p);
  EXPECT_EQ(at::real(u).strides(), at::real(xc).strides());
  EXPECT_EQ(at::imag(u).strides(), at::imag(xc).strides());
  EXPECT_FALSE(at::real(u).is_contiguous());
  EXPECT_EQ(u.t().detach().strides(), xc.t().detach().strides());
  EXPECT_EQ(at::alias(u.t()).strides(), xc.t().strides());
  EXPECT_EQ(u.t().clone().strides(), xc.t().clone().strides());
  EXPECT_EQ(u.t().conj().strides(), xc.t().conj().strides());
  const at::Tensor v = st::distribute_tensor(x, mesh, p);
  EXPECT_EQ(v.unfold(1, 2, 1).strides(), x.unfold(1, 2, 1).strides());
  EXPECT_FALSE(v.unfold(1, 2, 1).is_contiguous());
}

// Issue 25: the generic fallback's view results (copies: as_strided,
// view_as_real) have libtorch's strides too. Was: contiguous strides, so
// `x.as_strided({3, 3}, {1, 3}).contiguous()` returned the copy itself, whose
// writes are refused, where libtorch copies and takes the write; and
// `.view(-1)` of it was taken where libtorch raises.
TEST(Alias, FallbackViewResultsHaveTorchStrides) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({4, 5}, 3, 4.0).round();
  auto strided = [](const at::Tensor& t) { return t.as_strided({3, 3}, {1, 3}, 2); };
  check_steps(mesh, "as_strided(...).contiguous()", x,
              {push([&](const at::Tensor& t) { return strided(t).contiguous(); }), mul_view,
               add_src, mul_view},
              kLayouts, {at::kDouble, at::kLong, at::kComplexDouble});
  check_steps(mesh, "as_strided(...).reshape(-1)", x,
              {push([&](const at::Tensor& t) { return strided(t).reshape({-1}); }), mul_view,
               zero_src, mul_view},
              kLayouts);
  check_steps(
      mesh, "view_as_real(x[:, 1:4]).contiguous()", x,
      {push([](const at::Tensor& t) { return at::view_as_real(t.slice(1, 1, 4)).contiguous(); }),
       mul_view, add_src, mul_view},
      kLayouts, {at::kComplexDouble});
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    const at::Tensor u = st::distribute_tensor(x, mesh, p);
    EXPECT_EQ(strided(u).strides(), strided(x).strides()) << st::to_string(p);
    EXPECT_FALSE(strided(u).is_contiguous()) << st::to_string(p);
    EXPECT_TRUE(throws_everywhere([&] { (void)strided(u).view({-1}); }, {"view", "stride"}))
        << "as_strided(...).view(-1) must raise as in libtorch, on " << st::to_string(p);
    const at::Tensor uc = st::distribute_tensor(x.to(at::kComplexDouble), mesh, p);
    EXPECT_EQ(at::view_as_real(uc.slice(1, 1, 4)).strides(),
              at::view_as_real(x.to(at::kComplexDouble).slice(1, 1, 4)).strides())
        << st::to_string(p);
  }
}

// view and reshape decide view or copy from the global strides, on every
// rank alike: view of a non-contiguous tensor raises everywhere (as in
// libtorch), reshape of it copies everywhere, reshape of a contiguous one is
// a view. Writes in both directions are compared.
TEST(Alias, ViewAndReshapeDecideByTheGlobalStrides) {
  auto mesh = test_mesh();
  auto x = rnd({6, 4}, 2, 4.0).round();
  using V = std::vector<at::Tensor>;
  check_steps(mesh, "t().reshape(-1) copies", x,
              {[](V& ts) { ts.push_back(ts[0].t().reshape({-1})); }, [](V& ts) { ts[1].mul_(10); },
               [](V& ts) { ts[0].add_(1); }, [](V& ts) { ts[1].sub_(2); }},
              kLayouts);
  check_steps(mesh, "reshape(3, 8) views", x,
              {[](V& ts) {
                 ts.push_back(ts[0].reshape({3, 8}));
               },
               [](V& ts) { ts[1].mul_(10); }, [](V& ts) { ts[1].sub_(2); }},
              {{S0, R}, {R, R}});
  check_steps(mesh, "t().contiguous().view(-1)", x,
              {[](V& ts) { ts.push_back(ts[0].t().contiguous().view({-1})); },
               [](V& ts) { ts[1].mul_(10); }, [](V& ts) { ts[0].add_(1); }},
              kLayouts);
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    at::Tensor u = st::distribute_tensor(x, mesh, p);
    EXPECT_TRUE(throws_everywhere([&] { u.t().view({-1}); }, {"view", "stride", "reshape"}))
        << st::to_string(p);
  }
}

// Chains of views: a view of a view, then writes at both ends.
TEST(Alias, ChainsOfViews) {
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 3, 4.0).round();
  using V = std::vector<at::Tensor>;
  check_steps(
      mesh, "slice of transpose", x,
      {[](V& ts) { ts.push_back(ts[0].t()); }, [](V& ts) { ts.push_back(ts[1].slice(1, 1, 4)); },
       [](V& ts) { ts[2].mul_(10); }, [](V& ts) { ts[0].add_(1); }, [](V& ts) { ts[2].sub_(3); },
       [](V& ts) { ts.push_back(ts[2].contiguous()); }, [](V& ts) { ts[3].mul_(7); },
       [](V& ts) { ts[0].neg_(); }},
      kLayouts);
  check_steps(mesh, "select of a fresh select", x,
              {[](V& ts) { ts[0].select(0, 2).select(0, 3).fill_(100); },
               [](V& ts) { ts[0].select(1, 4).select(0, 5).fill_(-100); }},
              kLayouts);
}

// Issue 25: a copy view (diagonal, unbind, select along a sharded dim, a
// view that moves data) follows its source as libtorch's view does (Note
// [stale copy views]): reads after a write into the source show the new
// values, and a write through the copy lands on them (its write-back puts
// nothing stale over the source). Was: reads showed the values of the time the
// view was taken, and writes were refused once the source had been written.
TEST(Alias, CopyViewsFollowTheirSource) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({5, 5}, 4, 4.0).round();
  using F = std::function<at::Tensor(const at::Tensor&)>;
  for (const auto& [name, f] : std::vector<std::pair<std::string, F>>{
           {"diagonal", [](const at::Tensor& t) { return t.diagonal(); }},
           {"diagonal(1)", [](const at::Tensor& t) { return t.diagonal(1); }},
           {"unbind(0)[2]", [](const at::Tensor& t) { return t.unbind(0)[2]; }},
           {"unbind(1)[4]", [](const at::Tensor& t) { return t.unbind(1)[4]; }},
           {"x[2]", [](const at::Tensor& t) { return t[2]; }},
           {"select(1, 3)", [](const at::Tensor& t) { return t.select(1, 3); }},
           {"slice(0, 1, 2).squeeze(0)",
            [](const at::Tensor& t) { return t.slice(0, 1, 2).squeeze(0); }}}) {
    check_steps(mesh, name + ": write the source, read, write the view", x,
                {push(f), zero_src, mul_view, add_src, mul_view, add_src}, kLayouts);
    check_steps(mesh, name + ": write the view, then the source", x,
                {push(f), mul_view, add_src, add_src, mul_view}, kLayouts);
  }
  // A view that moves data (Note [view merge]): [5, 4] sharded on dim 1 -> [20].
  check_steps(mesh, "view(-1) that moves data", rnd({5, 4}, 6, 4.0).round(),
              {push([](const at::Tensor& t) { return t.view({-1}); }), add_src, mul_view, zero_src,
               mul_view},
              kLayouts);
  // Chains: a true view of a copy view, and a copy view of a copy view.
  check_steps(
      mesh, "unsqueeze of diagonal", x,
      {push([](const at::Tensor& t) { return t.diagonal(); }),
       [](V& ts) { ts.push_back(ts[1].unsqueeze(0)); }, add_src, [](V& ts) { ts[2].mul_(10); },
       zero_src, [](V& ts) { ts[1].add_(2); }, [](V& ts) { ts[2].mul_(3); }},
      kLayouts);
  check_steps(
      mesh, "select of select", x,
      {push([](const at::Tensor& t) { return t.select(0, 2); }),
       [](V& ts) { ts.push_back(ts[1].select(0, 3)); }, add_src, [](V& ts) { ts[2].mul_(10); },
       zero_src, [](V& ts) { ts[1].add_(2); }, [](V& ts) { ts[2].mul_(3); }, add_src},
      kLayouts);
  // Siblings made together (unbind) and apart (two selects): a write through
  // one is seen by the others and by the source.
  check_steps(mesh, "unbind siblings", x,
              {[](V& ts) {
                 auto rows = ts[0].unbind(0);
                 ts.push_back(rows[1]);
                 ts.push_back(rows[3]);
               },
               [](V& ts) { ts.push_back(ts[0].select(1, 1)); }, add_src,
               [](V& ts) { ts[1].mul_(10); }, [](V& ts) { ts[3].sub_(1); },
               [](V& ts) { ts[2].mul_(2); }, zero_src, [](V& ts) { ts[1].add_(5); }},
              kLayouts);
  // The source written through a view of it, and by an op writing a list.
  check_steps(mesh, "write through a slice of the source", x,
              {push([](const at::Tensor& t) { return t.diagonal(); }),
               [](V& ts) { ts[0].slice(0, 1, 4).fill_(7); }, mul_view,
               [](V& ts) { ts[0].select(1, 2).fill_(-1); }, mul_view},
              kLayouts);
  // Used by ops that take a list (cat, stack).
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    at::Tensor u = st::distribute_tensor(x, mesh, p);
    at::Tensor want = x.clone();
    auto rows = u.unbind(0);
    auto wrows = want.unbind(0);
    u.add_(1);
    want.add_(1);
    EXPECT_TRUE(
        all_close(gathered(at::stack({rows[0], rows[4]})), at::stack({wrows[0], wrows[4]}), 0, 0))
        << st::to_string(p);
    // The source's layout changed in place: the copy cannot follow it.
    at::Tensor d = u.diagonal();
    const bool copy = !st::ShardTensor(d).local().is_alias_of(st::ShardTensor(u).local());
    ASSERT_TRUE(all_ranks(copy) || all_ranks(!copy)) << st::to_string(p);
    u.t_();
    if (all_ranks(copy)) {
      EXPECT_TRUE(throws_everywhere([&] { d.add(1); }, {"diagonal", "take the view again"}))
          << st::to_string(p);
    }
  }
}

// Issue 25: a pointwise result has libtorch's strides where an operand's
// wrapper is not contiguous (its piece follows the operand's layout, as in
// libtorch), so view decides like libtorch on every rank. Was: `(x.t() * 2)`
// reported contiguous strides, so `.view(-1)` of it viewed the piece on ranks
// whose piece allowed it and copied it on the others (a later write reached the
// result on some ranks only), and `.t().view(-1)` of it raised where libtorch
// gives a view.
TEST(Alias, PointwiseResultsOfStridedOperandsHaveTorchStrides) {
  auto mesh = test_mesh();
  auto x = rnd({7, 5}, 7, 4.0).round();
  using F = std::function<at::Tensor(const at::Tensor&)>;
  const std::vector<std::pair<std::string, F>> ops = {
      {"t() * 2", [](const at::Tensor& t) { return t.t() * 2; }},
      {"t() + t()", [](const at::Tensor& t) { return t.t() + t.t(); }},
      {"t().neg()", [](const at::Tensor& t) { return t.t().neg(); }},
      {"[:, 1:4].abs()", [](const at::Tensor& t) { return t.slice(1, 1, 4).abs(); }},
      {"permute().eq()",
       [](const at::Tensor& t) {
         return t.unsqueeze(2).permute({1, 2, 0}) == 1;
       }},
      {"t().to(double)", [](const at::Tensor& t) { return t.t().to(at::kDouble); }}};
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    const at::Tensor u = st::distribute_tensor(x, mesh, p);
    for (const auto& [name, f] : ops) {
      EXPECT_EQ(f(u).strides(), f(x).strides()) << name << " on " << st::to_string(p);
      EXPECT_EQ(f(u).is_contiguous(), f(x).is_contiguous()) << name << " on " << st::to_string(p);
    }
    // libtorch refuses view(-1) of a transposed result: so does every rank.
    EXPECT_TRUE(throws_everywhere([&] { (u.t() * 2).view({-1}); }, {"view", "stride"}))
        << st::to_string(p);
  }
  // Views of such results, written through and at their source.
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kLong, at::kComplexDouble};
  check_steps(mesh, "(t() * 2).t().view(-1)", x,
              {push([](const at::Tensor& t) { return t.t() * 2; }),
               [](V& ts) { ts.push_back(ts[1].t().view({-1})); }, [](V& ts) { ts[2].mul_(10); },
               [](V& ts) { ts[1].add_(1); }, [](V& ts) { ts[2].sub_(3); }},
              kLayouts, dtypes);
  check_steps(
      mesh, "(t() * 2).view(5, 7, 1)", x,
      {push([](const at::Tensor& t) { return t.t() * 2; }),
       [](V& ts) {
         ts.push_back(ts[1].view({5, 7, 1}));
       },
       [](V& ts) { ts[2].mul_(10); }, [](V& ts) { ts[1].add_(1); }, [](V& ts) { ts[2].sub_(3); }},
      kLayouts, dtypes);
  check_steps(mesh, "(t().contiguous() + 1).view(-1)", x,
              {push([](const at::Tensor& t) { return t.t().contiguous() + 1; }),
               [](V& ts) { ts.push_back(ts[1].view({-1})); }, [](V& ts) { ts[2].mul_(10); },
               [](V& ts) { ts[1].add_(1); }, [](V& ts) { ts[2].sub_(3); }},
              kLayouts, dtypes);
  check_steps(mesh, "(t() * 2).reshape(-1) copies", x,
              {push([](const at::Tensor& t) { return t.t() * 2; }),
               [](V& ts) { ts.push_back(ts[1].reshape({-1})); }, [](V& ts) { ts[2].mul_(10); },
               [](V& ts) { ts[1].add_(1); }, [](V& ts) { ts[2].sub_(3); }},
              kLayouts, dtypes);
}

// local() never communicates, so it cannot bring a stale copy view up to
// date (Note [stale copy views]): it raises on every rank instead of showing
// old values; any op (clone) brings the copy up to date, and then local()
// holds this rank's piece of libtorch's current values. A result whose piece
// is its source's own memory (a true view, or a mesh dim of one coordinate)
// never raises.
TEST(Alias, LocalOfAStaleCopyViewRaises) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({5, 5}, 4, 4.0).round();
  using F = std::function<at::Tensor(const at::Tensor&)>;
  for (const auto& [name, f] : std::vector<std::pair<std::string, F>>{
           {"x[2]", [](const at::Tensor& t) { return t[2]; }},
           {"diagonal", [](const at::Tensor& t) { return t.diagonal(); }},
           {"unbind(1)[4]", [](const at::Tensor& t) { return t.unbind(1)[4]; }},
           {"x[2].unsqueeze(0)", [](const at::Tensor& t) { return t[2].unsqueeze(0); }}}) {
    for (const auto& wanted : kLayouts) {
      const auto p = fit_placements(mesh, wanted);
      const std::string where = name + " of " + st::to_string(p);
      at::Tensor u = st::distribute_tensor(x, mesh, p);
      at::Tensor y = f(u);
      const bool own = st::ShardTensor(y).local().is_alias_of(st::ShardTensor(u).local());
      u.add_(1);
      const at::Tensor want = f(x + 1);
      if (all_ranks(own)) {
        EXPECT_NO_THROW((void)st::ShardTensor(y).local()) << where;
      } else {
        EXPECT_TRUE(
            throws_everywhere([&] { (void)st::ShardTensor(y).local(); },
                              {"ShardTensor::local()", "Note [stale copy views]", "clone()"}))
            << where;
      }
      (void)y.clone();  // any op brings it up to date
      const st::ShardTensor ys(y);
      const at::Tensor mine =
          st::ShardTensor(st::distribute_tensor(want, mesh, ys.placements(), false,
                                                ys.spec().all_shard_sizes()))
              .local();
      EXPECT_TRUE(all_ranks(ys.local().equal(mine))) << where;
      EXPECT_TRUE(all_close(gathered(y), want, 0, 0)) << where;
    }
  }
}

// Issue 25 item 7: unbind and diagonal along a sharded dim replicate the whole
// tensor: counted in gathered_bytes, refused in strict mode.
TEST(Alias, UnbindAndDiagonalAlongShardedDimsAreVisibleGathers) {
  auto mesh = test_mesh();
  auto x = rnd({6, 6}, 5);
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    at::Tensor u = st::distribute_tensor(x, mesh, p);
    const bool s0 = std::any_of(p.begin(), p.end(), [](const auto& pl) {
      return st::is_shard(pl) && st::shard_dim(pl) == 0;
    });
    const bool any =
        std::any_of(p.begin(), p.end(), [&](const auto& pl) { return st::is_shard(pl); }) &&
        mesh.size() > 1;
    st::set_strict(false);
    st::reset_comm_stats();
    auto rows = u.unbind(0);
    const int64_t after_unbind = st::comm_stats().gathered_bytes;
    EXPECT_TRUE(all_close(gathered(rows[1]), x[1], 0, 0));
    st::reset_comm_stats();
    auto d = u.diagonal();
    const int64_t after_diag = st::comm_stats().gathered_bytes;
    EXPECT_TRUE(all_close(gathered(d), x.diagonal(), 0, 0));
    if (s0 && mesh.size() > 1) EXPECT_TRUE(all_ranks(after_unbind > 0)) << st::to_string(p);
    if (any) EXPECT_TRUE(all_ranks(after_diag > 0)) << st::to_string(p);
    // After a write into the source, the copies are made anew at their next
    // use (Note [stale copy views]): the same gather again, counted again.
    u.add_(1);
    st::reset_comm_stats();
    EXPECT_TRUE(all_close(gathered(rows[1] * 1), x[1] + 1, 0, 0)) << st::to_string(p);
    EXPECT_TRUE(all_ranks(st::comm_stats().gathered_bytes == after_unbind)) << st::to_string(p);
    st::reset_comm_stats();
    EXPECT_TRUE(all_close(gathered(d * 1), x.diagonal() + 1, 0, 0)) << st::to_string(p);
    EXPECT_TRUE(all_ranks(st::comm_stats().gathered_bytes == after_diag)) << st::to_string(p);
    st::set_strict(true);
    if (s0 && mesh.size() > 1) {
      EXPECT_TRUE(throws_everywhere([&] { u.unbind(0); }, {"unbind", "strict"}));
    }
    if (any) EXPECT_TRUE(throws_everywhere([&] { u.diagonal(); }, {"diagonal", "strict"}));
    // ... and in strict mode their refresh is refused, on every rank.
    u.add_(1);
    if (s0 && mesh.size() > 1) {
      EXPECT_TRUE(throws_everywhere([&] { (void)(rows[1] * 1); },
                                    {"unbind", "strict", "made anew after a write"}));
    }
    if (any) {
      EXPECT_TRUE(throws_everywhere([&] { (void)(d * 1); },
                                    {"diagonal", "strict", "made anew after a write"}));
    }
    st::set_strict(false);
    EXPECT_TRUE(all_close(gathered(rows[1]), x[1] + 2, 0, 0)) << st::to_string(p);
    EXPECT_TRUE(all_close(gathered(d), x.diagonal() + 2, 0, 0)) << st::to_string(p);
  }
}

// Copies where libtorch returns a view, made by rerunning what made them:
// view ops through the generic fallback (as_strided, view_as_real: Note
// [generic fallback]) and unfold along a sharded dim (a rule that copies
// windows: Note [unfold windows]). They follow their source as libtorch's
// views do (Note [stale copy views]): after a write into the source (add_, a
// slice's fill_, a select's fill_), the copy, a view of it and ops using it
// show the new values; writes through them are still refused on every rank;
// the fallback's rerun is a visible gather (counted, refused in strict mode);
// gradients reach the source's current value. Was: reads showed the values
// of the time the view was taken.
TEST(Alias, FallbackCopiesFollowTheirSource) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({7, 6}, 8, 4.0).round();
  const std::vector<at::ScalarType> dtypes = {at::kDouble, at::kLong, at::kComplexDouble};
  auto shard_dim_of = [](const Placements& p) {
    for (const auto& pl : p)
      if (st::is_shard(pl)) return st::shard_dim(pl);
    return int64_t{0};
  };
  auto strided = [](const at::Tensor& t) { return t.as_strided({4, 3}, {5, 2}, 1); };
  const Step fill_rows = [](V& ts) { ts[0].slice(0, 1, 3).fill_(5); };
  const Step fill_row = [](V& ts) { ts[0][0].fill_(-2); };
  const Step fill_col = [](V& ts) { ts[0].select(1, 2).fill_(9); };
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    const int64_t d = shard_dim_of(p);
    const std::string along = " along dim " + std::to_string(d);
    auto unfold = [d](const at::Tensor& t) { return t.unfold(d, 3, 2); };
    // ts: x, u = unfold, a = as_strided, u[0], u.transpose(0, 1), then reads by ops.
    check_steps(mesh, "unfold" + along + " and as_strided", x,
                {push(unfold), push(strided), [](V& ts) { ts.push_back(ts[1][0]); },
                 [](V& ts) { ts.push_back(ts[1].transpose(0, 1)); }, add_src,
                 [](V& ts) {
                   ts[0].add_(1);
                   ts.push_back(ts[1] * 2);  // an op reads the copy first
                   ts.push_back(ts[2] + 1);
                 },
                 fill_rows,
                 [](V& ts) {
                   ts[0].slice(1, 2, 5).fill_(-3);
                   ts.push_back(ts[3].sum(0));  // a view of the copy, read by an op
                   ts.push_back(at::cat({ts[2], ts[2]}));
                 },
                 fill_row, fill_col, zero_src, add_src},
                {wanted}, dtypes);
    // Views taken after the source was written, of a row of it (a copy
    // itself where dim 0 is sharded): unfold (a copy where the row is
    // sharded) and as_strided (a copy), so a copy of a copy follows too.
    // (as_strided counts from the row's own first element: libtorch's counts
    // from its storage's, which is the same for a row.)
    check_steps(mesh, "unfold and as_strided of a row" + along, x,
                {add_src, push([](const at::Tensor& t) { return t.select(0, 3); }),
                 [](V& ts) { ts.push_back(ts[1].unfold(0, 2, 3)); },
                 [](V& ts) {
                   ts.push_back(ts[1].as_strided({2, 2}, {1, 2}));
                 },
                 fill_rows, fill_col, add_src},
                {wanted}, dtypes);
    check_steps(mesh, "view_as_real", x,
                {push([](const at::Tensor& t) { return at::view_as_real(t); }), add_src, fill_rows,
                 [](V& ts) { ts.push_back(ts[1].select(-1, 1)); }, fill_col},
                {wanted}, {at::kComplexDouble});
  }
  for (const auto& wanted : kLayouts) {
    const auto p = fit_placements(mesh, wanted);
    const std::string where = " on " + st::to_string(p);
    const int64_t d = shard_dim_of(p);
    const bool sharded = mesh.size() > 1 && std::any_of(p.begin(), p.end(), [](const auto& pl) {
                           return st::is_shard(pl);
                         });
    for (auto sizes : {std::optional<st::ShardSizes>{},
                       std::optional<st::ShardSizes>{sizes_with_empty_first(mesh, p, x.sizes())}}) {
      at::Tensor u = st::distribute_tensor(x, mesh, p, false, sizes);
      at::Tensor want = x.clone();
      at::Tensor win = u.unfold(d, 3, 2), a = strided(u);
      at::Tensor wwin = want.unfold(d, 3, 2), wa = strided(want);
      const at::Tensor a_t = a.t();
      u.add_(1);
      want.add_(1);
      // local() never communicates: it refuses a stale copy (and a view of one).
      EXPECT_TRUE(throws_everywhere([&] { (void)st::ShardTensor(a).local(); },
                                    {"local()", "stale copy views"}))
          << where;
      EXPECT_TRUE(throws_everywhere([&] { (void)st::ShardTensor(a_t).local(); },
                                    {"local()", "stale copy views"}))
          << where;
      if (sharded) {
        EXPECT_TRUE(throws_everywhere([&] { (void)st::ShardTensor(win).local(); },
                                      {"local()", "stale copy views"}))
            << where;
      }
      // Writes through the copies stay refused, also once they are stale.
      EXPECT_TRUE(throws_everywhere([&] { a.fill_(0); }, {"fill_", "copy, not a view"})) << where;
      EXPECT_TRUE(throws_everywhere([&] { a.t().mul_(2); }, {"mul_", "copy, not a view"})) << where;
      if (sharded) {
        EXPECT_TRUE(throws_everywhere([&] { win.fill_(0); }, {"fill_", "not a view"})) << where;
        EXPECT_TRUE(throws_everywhere([&] { win.transpose(0, 1).add_(1); }, {"add_", "unfold"}))
            << where;
      }
      EXPECT_TRUE(all_close(gathered(win), wwin, 0, 0)) << where;
      EXPECT_TRUE(all_close(gathered(a), wa, 0, 0)) << where;
      EXPECT_TRUE(all_close(gathered(u), want, 0, 0)) << where;
      EXPECT_TRUE(all_ranks(st::ShardTensor(a).local().defined())) << where;
      // The fallback's rerun is a visible gather, once per write.
      u.mul_(3);
      want.mul_(3);
      st::reset_comm_stats();
      const at::Tensor a2 = a * 1;
      const int64_t first = st::comm_stats().gathered_bytes;
      const at::Tensor a3 = a * 1;
      const int64_t second = st::comm_stats().gathered_bytes - first;
      EXPECT_TRUE(all_close(gathered(a2), wa, 0, 0)) << where;
      EXPECT_TRUE(all_close(gathered(a3), wa, 0, 0)) << where;
      if (sharded) EXPECT_TRUE(max_over_ranks(first) > 0) << where;
      EXPECT_TRUE(all_ranks(second == 0)) << where;
      // Strict mode refuses the fallback's rerun on every rank, as it refuses
      // the first call; unfold's rule makes its copy anew without a gather.
      u.sub_(2);
      want.sub_(2);
      st::set_strict(true);
      EXPECT_TRUE(throws_everywhere([&] { a.sum(); }, {"as_strided", "strict"})) << where;
      EXPECT_TRUE(throws_everywhere([&] { gathered(a); }, {"as_strided", "strict"})) << where;
      EXPECT_TRUE(all_close(gathered(win * 1), wwin, 0, 0)) << where;
      st::set_strict(false);
      EXPECT_TRUE(all_close(gathered(a), wa, 0, 0)) << where;
      // The source's layout changed in place: the copy cannot follow it.
      u.t_();
      want.t_();
      EXPECT_TRUE(throws_everywhere([&] { a.sum(); }, {"as_strided", "take the view again"}))
          << where;
      if (sharded) {
        EXPECT_TRUE(throws_everywhere([&] { win.sum(); }, {"unfold", "take the view again"}))
            << where;
      }
    }
  }
  // Gradients reach the source's current value, as through libtorch's views.
  auto xg = rnd({7, 6}, 9).to(at::kDouble);
  for (const auto& wanted : kLayouts) {
    const int64_t d = shard_dim_of(fit_placements(mesh, wanted));
    auto fn = [&strided, d](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      at::Tensor y = in[0] * 1.0;
      at::Tensor win = y.unfold(d, 3, 2), a = strided(y);
      y.mul_(2.0);
      y.add_(in[0] * in[0]);
      return at::cat({win.sum(-1).reshape({-1}), a.sum(1)}) * 3.0;
    };
    EXPECT_TRUE(reference_check(fn, {sharded_input(mesh, xg, wanted)}, mesh, {}, 1e-12, 1e-12))
        << st::to_string(fit_placements(mesh, wanted));
    EXPECT_TRUE(reference_check(fn, {empty_first_input(mesh, xg, wanted)}, mesh, {}, 1e-12, 1e-12))
        << st::to_string(fit_placements(mesh, wanted)) << " empty-first";
  }
}
