// Views of a ShardTensor keep view semantics (Note [view write-back]):
// in-place ops through select/slice/narrow/view/squeeze/unsqueeze/transpose/
// diagonal reach the ShardTensor, on sharded and unsharded dims, compared with
// the same program on a plain tensor; where a result cannot alias, in-place
// ops on it raise.
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
using shardtensor::DeviceMesh;
using shardtensor::Placements;

namespace {

using Prog = std::function<void(at::Tensor& u)>;

// Runs `prog` on a plain tensor and on a ShardTensor of it in every layout
// (balanced and empty-first, float32 and float64), then compares the contents.
void check_writes(const DeviceMesh& mesh, const std::string& name, const at::Tensor& x,
                  const Prog& prog, const std::vector<Placements>& layouts) {
  for (const auto& wanted : layouts) {
    auto p = fit_placements(mesh, wanted);
    for (bool empty : {false, true}) {
      for (auto dtype : {at::kFloat, at::kDouble}) {
        auto full = x.to(dtype);
        at::Tensor ref = full.clone();
        prog(ref);
        std::optional<st::ShardSizes> sizes;
        if (empty) sizes = sizes_with_empty_first(mesh, p, full.sizes());
        at::Tensor u = st::distribute_tensor(full, mesh, p, false, sizes);
        prog(u);
        EXPECT_TRUE(all_close(st::ShardTensor(u).full_tensor(), ref, 0, 0))
            << name << " on " << st::to_string(p) << (empty ? " empty-first" : "") << " "
            << c10::toString(dtype);
      }
    }
  }
}

const std::vector<Placements> kLayouts = {{S2, S3}, {S3, S2}, {S0, S2}, {R, S3}, {S1, R}};

}  // namespace

TEST(Views, BoundaryConditionsWrittenTheUsualWay) {
  auto mesh = test_mesh();
  auto x = rnd({2, 3, 6, 5}, 1);
  auto v = rnd({2, 3, 6, 1}, 2);
  check_writes(
      mesh, "select(2, 0).fill_", x, [](at::Tensor& u) { u.select(2, 0).fill_(1.0); }, kLayouts);
  check_writes(
      mesh, "select(2, -1).fill_", x, [](at::Tensor& u) { u.select(2, -1).fill_(2.0); }, kLayouts);
  check_writes(
      mesh, "select(3, 2).zero_", x, [](at::Tensor& u) { u.select(3, 2).zero_(); }, kLayouts);
  check_writes(
      mesh, "slice(3, -1).copy_", x,
      [&](at::Tensor& u) { u.slice(3, -1).copy_(v.to(u.scalar_type())); }, kLayouts);
  check_writes(
      mesh, "slice(2, 1, 5, 2).mul_", x, [](at::Tensor& u) { u.slice(2, 1, 5, 2).mul_(3.0); },
      kLayouts);
  check_writes(
      mesh, "narrow(2, 4, 2).add_", x, [](at::Tensor& u) { u.narrow(2, 4, 2).add_(5.0); },
      kLayouts);
  check_writes(
      mesh, "select(1, 1).select(1, 0).fill_", x,
      [](at::Tensor& u) { u.select(1, 1).select(1, 0).fill_(7.0); }, kLayouts);
  check_writes(
      mesh, "select(2, 3).slice(2, 1, 3).fill_", x,
      [](at::Tensor& u) { u.select(2, 3).slice(2, 1, 3).fill_(-1.0); }, kLayouts);
}

TEST(Views, TransposeUnsqueezeViewSqueezeDiagonal) {
  auto mesh = test_mesh();
  auto x = rnd({2, 3, 6, 5}, 3);
  check_writes(
      mesh, "transpose(2, 3).select(2, 1).fill_", x,
      [](at::Tensor& u) { u.transpose(2, 3).select(2, 1).fill_(4.0); }, kLayouts);
  check_writes(
      mesh, "unsqueeze(0).select(3, 5).fill_", x,
      [](at::Tensor& u) { u.unsqueeze(0).select(3, 5).fill_(4.0); }, kLayouts);
  check_writes(mesh, "view.add_", x,
               [](at::Tensor& u) {
                 u.view({2, 3, 30}).select(2, 7).add_(1.0);
               },
               {{S0, S2}, {S2, R}, {R, S2}, {S2, S0}});
  auto y = rnd({2, 1, 6, 5}, 4);
  check_writes(mesh, "view dropping a sharded size-1 dim", y,
               [](at::Tensor& u) {
                 u.view({2, 6, 5}).select(1, 4).fill_(3.0);
               },
               {{S1, S2}, {S1, R}, {S2, S1}});
  check_writes(mesh, "squeeze(1).fill_", y, [](at::Tensor& u) { u.squeeze(1).fill_(3.0); },
               {{S1, S2}, {S2, S1}, {S1, R}});
  auto sq = rnd({3, 6, 6}, 5);
  check_writes(mesh, "diagonal(0, 1, 2).fill_", sq,
               [](at::Tensor& u) { u.diagonal(0, 1, 2).fill_(9.0); },
               {{S1, S2}, {S2, S0}, {S0, R}, {R, S1}});
  check_writes(mesh, "diagonal(1, 2, 1).mul_", sq,
               [](at::Tensor& u) { u.diagonal(1, 2, 1).mul_(-2.0); }, {{S1, S2}, {S0, S1}});
}

TEST(Views, InPlaceOpsThroughViews) {
  auto mesh = test_mesh();
  auto x = rnd({4, 7, 5}, 6);
  const std::vector<Placements> layouts = {{S1, S2}, {S0, S1}, {S2, R}};
  check_writes(
      mesh, "masked_fill_", x,
      [](at::Tensor& u) {
        auto row = u.select(1, 3);
        row.masked_fill_(row > 0, 0.5);
      },
      layouts);
  check_writes(
      mesh, "index_put_", x,
      [](at::Tensor& u) {
        auto row = u.select(1, 6);
        row.index_put_({at::tensor({0, 2}, at::kLong)}, at::ones({5}, u.options()));
      },
      layouts);
  check_writes(
      mesh, "copy_ from sharded", x,
      [](at::Tensor& u) {
        auto a = u.select(1, 0);
        a.copy_(u.select(1, 4) * 2.0);
      },
      layouts);
}

// Gradients through in-place writes into views of a non-leaf, on sharded and
// unsharded dims. Regression: a select of a sharded dim is a view of an
// all-gather's output, which libtorch marked "created inside a custom
// Function" when the primitive returned a view of its own buffer, so the
// write raised in handle_view_on_rebase (Note [function outputs are not
// views], comm/function_output.h).
TEST(Views, GradientsFlowThroughWrittenViews) {
  auto mesh = test_mesh();
  auto x = rnd({5, 6}, 7);
  auto w = rnd({6}, 8);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor u = in[0] * 1.0;
    u.select(0, 3).copy_(in[1] * 2.0);
    u.select(1, 0).fill_(1.0);
    return u * u;
  };
  for (const auto& p : std::vector<Placements>{{S0, S1}, {S1, S0}, {R, S0}}) {
    EXPECT_TRUE(reference_check(fn, {sharded_input(mesh, x, p), {w, std::nullopt, true}}, mesh))
        << st::to_string(p);
    EXPECT_TRUE(reference_check(fn, {empty_first_input(mesh, x, p), {w, std::nullopt, true}}, mesh))
        << st::to_string(p) << " empty-first";
  }
}

// Dirichlet boundary conditions written the usual way inside a differentiated
// function: the written rows get no gradient, the rest flows through, as in
// libtorch (sharded and unsharded dims, both ends, a copy from a neighbour row).
TEST(Views, BoundaryConditionsInsideADifferentiatedFunction) {
  auto mesh = test_mesh();
  auto x = rnd({2, 3, 7, 6}, 21);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor u = in[0] * 2.0;
    u.select(2, 0).fill_(1.0);
    u.select(2, -1).fill_(0.0);
    u.select(3, 0).copy_(u.select(3, 1));
    u.slice(3, -1).mul_(0.5);
    return u * u;
  };
  for (const auto& p : std::vector<Placements>{{S2, S3}, {S3, S2}, {S0, S2}, {R, S3}}) {
    EXPECT_TRUE(reference_check(fn, {sharded_input(mesh, x, p)}, mesh)) << st::to_string(p);
    EXPECT_TRUE(reference_check(fn, {empty_first_input(mesh, x, p)}, mesh))
        << st::to_string(p) << " empty-first";
  }
}

// The FNO spectral convolution's slice assignment, on a non-leaf that
// requires grad: two mode corners written by copy_ into slices of sharded and
// unsharded dims, real (float64) and through rfft2/irfft2 (complex), compared
// with libtorch for the output, the input's gradient and the weights'.
TEST(Views, FnoSliceAssignmentIntoANonLeaf) {
  auto mesh = test_mesh();
  const int64_t H = 7, W = 8, m1 = 2, m2 = 3;
  auto x = rnd({2, 3, H, W}, 22).to(at::kDouble);
  auto w1 = rnd({3, 4, m1, m2}, 23).to(at::kDouble);
  auto w2 = rnd({3, 4, m1, m2}, 24).to(at::kDouble);
  auto real = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor u = in[0] * 1.5;
    at::Tensor out = at::cat({u, u.narrow(1, 0, 1)}, 1) * 0.5;  // [2, 4, H, W], non-leaf
    out.slice(2, 0, m1).slice(3, 0, m2).copy_(
        at::einsum("bixy,ioxy->boxy", {u.slice(2, 0, m1).slice(3, 0, m2), in[1]}));
    out.slice(2, H - m1, H)
        .slice(3, 0, m2)
        .copy_(at::einsum("bixy,ioxy->boxy", {u.slice(2, H - m1, H).slice(3, 0, m2), in[2]}));
    return out * u.sum(1, true);
  };
  auto spectral = [=](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor x_ft = torch::fft::rfft2(in[0] * 1.0);
    const auto cw1 = at::complex(in[1], in[2]);
    const auto cw2 = at::complex(in[2], in[1]);
    // A non-leaf that requires grad, of out_ft's shape [B, Cout, H, W/2+1].
    at::Tensor out_ft =
        at::einsum("bixy,io->boxy", {x_ft, at::ones({3, 4}, x_ft.options())}) * 0.25;
    out_ft.slice(2, 0, m1).slice(3, 0, m2).copy_(
        at::einsum("bixy,ioxy->boxy", {x_ft.slice(2, 0, m1).slice(3, 0, m2), cw1}));
    out_ft.slice(2, H - m1, H)
        .slice(3, 0, m2)
        .copy_(at::einsum("bixy,ioxy->boxy", {x_ft.slice(2, H - m1, H).slice(3, 0, m2), cw2}));
    return torch::fft::irfft2(out_ft, std::vector<int64_t>{H, W});
  };
  for (const auto& p : std::vector<Placements>{{S2, S3}, {S3, S2}, {S2, S0}, {R, S2}}) {
    const RefInput a{w1, std::nullopt, true}, b{w2, std::nullopt, true};
    EXPECT_TRUE(reference_check(real, {sharded_input(mesh, x, p), a, b}, mesh, {}, 1e-10, 1e-12))
        << "real " << st::to_string(p);
    EXPECT_TRUE(
        reference_check(real, {empty_first_input(mesh, x, p), a, b}, mesh, {}, 1e-10, 1e-12))
        << "real " << st::to_string(p) << " empty-first";
    EXPECT_TRUE(
        reference_check(spectral, {sharded_input(mesh, x, p), a, b}, mesh, {}, 1e-10, 1e-12))
        << "spectral " << st::to_string(p);
    EXPECT_TRUE(
        reference_check(spectral, {empty_first_input(mesh, x, p), a, b}, mesh, {}, 1e-10, 1e-12))
        << "spectral " << st::to_string(p) << " empty-first";
  }
}

TEST(Views, CopiesThatCannotAliasRefuseInPlaceOps) {
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 9);
  at::Tensor u = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1}));
  // as_strided has no rule: the generic fallback returns a copy.
  st::set_strict(false);
  auto win = u.as_strided({6, 5}, {5, 1});
  EXPECT_TRUE(throws_everywhere([&] { win.fill_(0.0); }, {"fill_", "copy, not a view"}));
  EXPECT_TRUE(all_close(st::ShardTensor(u).full_tensor(), x, 0, 0));
}

// In-place ops on the outputs of rules built on custom autograd Functions
// work as in libtorch (Note [function outputs are not views]): an unbatched
// conv's output (a squeeze inside the Function) takes a boundary write
// through a select of its sharded dim, then relu_; and libtorch's own guard stays:
// a softmax output (saved for backward) modified in place makes backward
// raise on every rank.
TEST(Views, InPlaceOpsOnFunctionOutputs) {
  auto mesh = test_mesh();
  auto x = rnd({2, 7, 6}, 41);
  auto w = rnd({3, 2, 3, 3}, 42), b = rnd({3}, 43);
  auto conv = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    at::Tensor y = at::conv2d(in[0] * 1.0, p[0], p[1], {1, 1}, {1, 1});
    y.select(1, 0).fill_(0.5);
    y.relu_();
    return y;
  };
  for (const auto& p : std::vector<Placements>{{S1, S2}, {S2, S1}, {R, S1}}) {
    EXPECT_TRUE(reference_check(conv, {sharded_input(mesh, x, p)}, mesh, {w, b}))
        << "unbatched conv2d + relu_ on " << st::to_string(p);
    EXPECT_TRUE(reference_check(conv, {empty_first_input(mesh, x, p)}, mesh, {w, b}))
        << "unbatched conv2d + relu_ on " << st::to_string(p) << " empty-first";
  }
  auto z = rnd({4, 6}, 44);
  for (const auto& p : std::vector<Placements>{{S1, S0}, {S0, S1}}) {
    at::Tensor sz = st::distribute_tensor(z, mesh, fit_placements(mesh, p), true);
    at::Tensor y = at::softmax(sz, 1);
    y.mul_(2.0);
    EXPECT_TRUE(
        throws_everywhere([&] { y.sum().backward(); }, {"modified by an inplace operation"}))
        << st::to_string(p);
  }
}

// Every path that returns a copy where libtorch returns a view marks its
// result, so in-place ops on it raise on every rank, naming the op, and the
// source is left unchanged: view ops through the generic fallback whose
// result cannot be re-sharded (view_as_real, view_as_complex: they used to
// come back plain and the writes were lost), unfold along a sharded dim (a
// rule that copies windows; along other dims it is a view and writes land),
// views of a chained refused result, and view ops of a Partial ShardTensor
// (summed first).
TEST(Views, FallbackAndCopyingRulesRefuseInPlaceOps) {
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 31);
  for (const auto& wanted : std::vector<Placements>{{S0, S1}, {S1, S0}, {R, S0}}) {
    const auto p = fit_placements(mesh, wanted);
    const std::string where = " on " + st::to_string(p);
    at::Tensor u = st::distribute_tensor(x, mesh, p);
    for (int64_t dim : {0, 1}) {
      auto win = u.unfold(dim, 2, 1);
      EXPECT_TRUE(all_close(gathered(win), x.unfold(dim, 2, 1), 0, 0)) << "unfold" << where;
      bool sharded = false;
      for (const auto& pl : p) sharded = sharded || (st::is_shard(pl) && st::shard_dim(pl) == dim);
      if (sharded) {
        // Windows copied from several pieces (Note [unfold windows]).
        EXPECT_TRUE(throws_everywhere([&] { win.fill_(0.0); }, {"fill_", "unfold", "not a view"}))
            << "unfold(" << dim << ").fill_" << where;
        EXPECT_TRUE(throws_everywhere([&] { win.select(0, 1).add_(1.0); }, {"add_", "unfold"}))
            << "unfold(" << dim << ").select.add_" << where;
      } else {
        // Along an unsharded dim the windows are a view of the piece: writes
        // land. (The first element of every window: no element written twice,
        // as windows overlap.)
        at::Tensor v = st::distribute_tensor(x, mesh, p);
        v.unfold(dim, 2, 1).select(-1, 0).add_(1.0);
        at::Tensor want = x.clone();
        want.unfold(dim, 2, 1).select(-1, 0).add_(1.0);
        EXPECT_TRUE(all_close(gathered(v), want, 0, 0)) << "unfold(" << dim << ") view" << where;
      }
    }
    at::Tensor c = st::distribute_tensor(at::complex(x, x * 2.0), mesh, p);
    auto re = at::view_as_real(c);
    EXPECT_TRUE(all_close(gathered(re), at::view_as_real(at::complex(x, x * 2.0)), 0, 0));
    EXPECT_TRUE(throws_everywhere([&] { re.mul_(2.0); }, {"mul_", "view_as_real"})) << where;
    at::Tensor pairs = st::distribute_tensor(x.narrow(1, 0, 4).reshape({6, 2, 2}), mesh, p);
    auto cx = at::view_as_complex(pairs);
    EXPECT_TRUE(throws_everywhere([&] { cx.zero_(); }, {"zero_", "view_as_complex"})) << where;
    EXPECT_TRUE(all_close(st::ShardTensor(u).full_tensor(), x, 0, 0)) << where;
  }
  // A Partial ShardTensor is summed by view ops of the pointwise family.
  at::Tensor part = st::distribute_tensor(x, mesh, fit_placements(mesh, {st::Partial{}, S1}));
  EXPECT_TRUE(
      throws_everywhere([&] { at::alias(part).fill_(1.0); }, {"fill_", "alias", "not a view"}));
  EXPECT_TRUE(throws_everywhere([&] { part.detach().zero_(); }, {"zero_", "detach", "not a view"}));
  EXPECT_TRUE(all_close(st::ShardTensor(part).full_tensor(), x, 0, 0));
}

// unbind along a sharded dim replicates it; writes through any result go
// back to the owners, as select's do (they were lost before).
TEST(Views, UnbindWritesBack) {
  auto mesh = test_mesh();
  auto x = rnd({2, 3, 6, 5}, 32);
  check_writes(
      mesh, "unbind(2)[i] writes", x,
      [](at::Tensor& u) {
        auto rows = u.unbind(2);
        rows[0].fill_(1.0);
        rows[5].mul_(-2.0);
        rows[3].select(2, 1).add_(4.0);
      },
      kLayouts);
  check_writes(
      mesh, "unbind(3)[i] writes", x,
      [](at::Tensor& u) {
        auto cols = u.unbind(3);
        cols[4].copy_(cols[0] * 3.0);
      },
      kLayouts);
}

// Note [wrapper autograd]: requires_grad_(), requires_grad(), grad(),
// retain_grad(), is_leaf() and backward() on an at::Tensor that is a
// ShardTensor act on the local piece.
TEST(WrapperAutograd, RequiresGradGradRetainGradActOnThePiece) {
  auto mesh = test_mesh();
  auto x = rnd({6, 4}, 11);
  for (const auto& wanted : std::vector<Placements>{{S0, S1}, {S1, S0}, {R, S0}}) {
    auto p = fit_placements(mesh, wanted);
    at::Tensor sx = st::distribute_tensor(x, mesh, p);
    EXPECT_FALSE(sx.requires_grad());
    sx.requires_grad_();
    EXPECT_TRUE(sx.requires_grad());
    EXPECT_TRUE(st::ShardTensor(sx).local().requires_grad());
    EXPECT_TRUE(sx.is_leaf());
    at::Tensor h = sx * 3.0;
    EXPECT_TRUE(h.requires_grad());
    EXPECT_FALSE(h.is_leaf());
    h.retain_grad();
    EXPECT_TRUE(h.retains_grad());
    (h * h).sum().backward();
    auto xr = x.clone().requires_grad_(true);
    auto hr = xr * 3.0;
    hr.retain_grad();
    (hr * hr).sum().backward();
    // The wrapper's own grad() and the typed view agree with single process.
    ASSERT_TRUE(sx.grad().defined());
    EXPECT_TRUE(st::ShardTensor::is_shard_tensor(sx.grad()));
    EXPECT_TRUE(all_close(st::ShardTensor(sx.grad()).full_tensor(), xr.grad()));
    EXPECT_TRUE(all_close(st::ShardTensor(sx).grad().full_tensor(), xr.grad()));
    EXPECT_TRUE(all_close(st::ShardTensor(h).grad().full_tensor(), hr.grad()));
    // Tensor::backward on a sharded output is shardtensor::backward.
    at::Tensor sy = st::distribute_tensor(x, mesh, p, true);
    EXPECT_TRUE(sy.requires_grad());
    (sy * 2.0).backward(at::ones({6, 4}));
    EXPECT_TRUE(all_close(st::ShardTensor(sy.grad()).full_tensor(), at::full({6, 4}, 2.0)));
    sx.requires_grad_(false);
    EXPECT_FALSE(sx.requires_grad());
    EXPECT_FALSE(st::ShardTensor(sx).local().requires_grad());
  }
}
