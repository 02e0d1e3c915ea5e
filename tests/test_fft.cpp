// The distributed FFT (src/ops/fft.cpp), einsum with sharded dims
// (src/ops/einsum.cpp), complex dtypes through the transport, and a spectral
// convolution written the usual PyTorch way, compared with plain libtorch on
// the full tensors: forward output and input/parameter gradients.
//
// Layouts are written for the 2x2 mesh and trimmed by fit_placements() on a
// 1-D mesh, so one test covers 1, 2, 3 and 4 ranks and the 2x2 mesh. Extents
// are not divisible by 3 or 4 (uneven shards); the empty-first cases give
// coordinate 0 of every sharded mesh dim an empty piece.
//
// Tolerances (Note [fft tolerance]): float64 results must match elementwise
// (rtol 1e-12, atol 1e-12) and float32 results norm-wise, ||a - b||_2 <=
// 1e-5 ||b||_2. Complex values are compared as (real, imag) pairs.
//
// Note [fft tolerance]
// ~~~~~~~~~~~~~~~~~~~~
// The sharded transform is the same arithmetic in another order: one 1-D pass
// per dim, with all-to-alls between (Note [fft pencil]), where libtorch's
// pocketfft runs its own multi-dim plan. The rounding error of an FFT is bounded
// norm-wise, not elementwise: ||fl(FFT x) - FFT x||_2 <= c log2(N) u ||FFT x||_2
// (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Thm. 24.2;
// c about 5 with accurate twiddles, u = 2^-24 in float32). Every output
// coefficient carries an absolute error of the size of u ||x||, so a
// coefficient near zero has a large *relative* error in any correct FFT:
// float32 outputs of 20-57 differed by 3e-6-8e-6 here, which an elementwise
// atol of 1e-6 rejects. For the sizes tested (N <= 2^7 per transform) two
// correct results differ by at most about 2 * 5 * 7 * 6e-8 = 4e-6 of the norm,
// so the float32 check is the project's rtol 1e-5 applied to the norm: a
// wrong coefficient, a wrong normalization or a missing stage is off by far
// more. At P = 1 (no dim sharded) the rule runs libtorch's own call and matches
// bit for bit; float64 stays elementwise.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

using Fn = std::function<at::Tensor(const at::Tensor&)>;

bool is_double(at::ScalarType t) { return t == at::kDouble || t == at::kComplexDouble; }

at::Tensor as_real(const at::Tensor& t) {
  if (!t.defined() || !t.is_complex()) return t;
  return at::view_as_real(t.resolve_conj().contiguous());
}

at::Tensor rnd_of(c10::IntArrayRef shape, uint64_t seed, at::ScalarType dt) {
  if (at::isComplexType(dt)) {
    return at::complex(rnd(shape, seed), rnd(shape, seed + 1000)).to(dt);
  }
  return rnd(shape, seed).to(dt);
}

// Note [fft tolerance]: elementwise in float64, norm-wise in float32.
::testing::AssertionResult spectral_close(const at::Tensor& a, const at::Tensor& b, bool dbl) {
  if (dbl) return all_close(a, b, 1e-12, 1e-12);
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  }
  const at::Tensor ad = a.detach().to(at::kDouble), bd = b.detach().to(at::kDouble);
  const bool finite = ad.isfinite().all().item<bool>() && bd.isfinite().all().item<bool>();
  const double err = (ad - bd).norm().item<double>(), ref = bd.norm().item<double>();
  const bool ok = finite && err <= 1e-5 * ref;
  if (all_ranks(ok)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "norm-wise mismatch: ||a - b|| = " << err << ", ||b|| = " << ref << ", ratio "
         << err / ref << " > 1e-5" << (finite ? "" : " (non-finite values)");
}

class Fft : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  // fn on the full tensor vs fn on the sharded one: output, input gradient.
  ::testing::AssertionResult check(const Fn& fn, const at::Tensor& full, const P& wanted,
                                   bool empty_first = false) {
    const bool dbl = is_double(full.scalar_type());
    P p = fit_placements(mesh, wanted);
    std::optional<st::ShardSizes> sizes;
    if (empty_first) sizes = sizes_with_empty_first(mesh, p, full.sizes());
    at::Tensor ref_in = full.detach().clone().requires_grad_(true);
    at::Tensor sh_in = st::distribute_tensor(full, mesh, p, true, sizes);
    at::Tensor ref_out = fn(ref_in);
    at::Tensor sh_out = fn(sh_in);
    auto r = spectral_close(as_real(gathered(sh_out)), as_real(ref_out), dbl);
    if (!r) return ::testing::AssertionFailure() << "output: " << r.message();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    at::Tensor cot = at::randn(ref_out.sizes(), gen, ref_out.options().requires_grad(false));
    ref_out.backward(cot);
    st::backward(sh_out, cot);
    at::Tensor g = st::ShardTensor(sh_in).grad();
    if (!g.defined()) return ::testing::AssertionFailure() << "no gradient reached the input";
    auto rg = spectral_close(as_real(gathered(g)), as_real(ref_in.grad()), dbl);
    if (!rg) return ::testing::AssertionFailure() << "input grad: " << rg.message();
    return ::testing::AssertionSuccess();
  }
};

const std::vector<P> kLayouts = {P{S2, S3}, P{S3, S2}, P{S2, S1}, P{S1, S2}, P{R, S3}};

}  // namespace

// ---------------------------------------------------------------- real input

TEST_F(Fft, RealTransformsEveryLayout) {
  const std::vector<std::pair<std::string, Fn>> fns = {
      {"rfft2", [](const at::Tensor& x) { return torch::fft::rfft2(x); }},
      {"irfft2(rfft2)",
       [](const at::Tensor& x) {
         return torch::fft::irfft2(torch::fft::rfft2(x), std::vector<int64_t>{7, 10});
       }},
      {"rfftn ortho",
       [](const at::Tensor& x) {
         return torch::fft::rfftn(x, c10::nullopt, std::vector<int64_t>{1, 2, 3}, "ortho");
       }},
      {"rfft dim 2 forward",
       [](const at::Tensor& x) { return torch::fft::rfft(x, c10::nullopt, 2, "forward"); }},
      {"fft2 of real", [](const at::Tensor& x) { return torch::fft::fft2(x); }},
      {"ihfft dim 3", [](const at::Tensor& x) { return torch::fft::ihfft(x, c10::nullopt, 3); }},
  };
  for (auto dt : {at::kFloat, at::kDouble}) {
    auto x = rnd_of({2, 3, 7, 10}, 1, dt);
    for (const auto& p : kLayouts) {
      for (bool empty : {false, true}) {
        for (const auto& [name, fn] : fns) {
          EXPECT_TRUE(check(fn, x, p, empty))
              << name << " " << st::to_string(p) << (empty ? " empty-first " : " ") << dt;
        }
      }
    }
  }
}

TEST_F(Fft, PaddingAndTruncation) {
  // s=/n= resize the input before the transform (slice or zero-pad a sharded dim).
  const std::vector<std::pair<std::string, Fn>> fns = {
      {"rfft2 s={9,6}",
       [](const at::Tensor& x) {
         return torch::fft::rfft2(x, std::vector<int64_t>{9, 6});
       }},
      {"rfft n=4 dim 2", [](const at::Tensor& x) { return torch::fft::rfft(x, 4, 2); }},
      {"irfft2(rfft2) s={12,8}",
       [](const at::Tensor& x) {
         return torch::fft::irfft2(torch::fft::rfft2(x), std::vector<int64_t>{12, 8});
       }},
      {"irfft n=13 dim 3",
       [](const at::Tensor& x) { return torch::fft::irfft(torch::fft::rfft2(x), 13, 3); }},
      {"hfft n=9 dim 2", [](const at::Tensor& x) {
         return torch::fft::hfft(torch::fft::fft(x, c10::nullopt, 3), 9, 2);
       }}};
  auto x = rnd_of({2, 3, 7, 10}, 2, at::kDouble);
  for (const auto& p : {P{S2, S3}, P{S3, S1}}) {
    for (bool empty : {false, true}) {
      for (const auto& [name, fn] : fns) {
        EXPECT_TRUE(check(fn, x, p, empty))
            << name << " " << st::to_string(p) << (empty ? " empty-first" : "");
      }
    }
  }
}

// ---------------------------------------------------------------- complex input

TEST_F(Fft, ComplexTransformsEveryLayout) {
  const std::vector<std::pair<std::string, Fn>> fns = {
      {"fft2", [](const at::Tensor& x) { return torch::fft::fft2(x); }},
      {"ifft2(fft2) ortho",
       [](const at::Tensor& x) {
         return torch::fft::ifft2(torch::fft::fft2(x, c10::nullopt, {-2, -1}, "ortho"),
                                  c10::nullopt, {-2, -1}, "ortho");
       }},
      {"fftn all", [](const at::Tensor& x) { return torch::fft::fftn(x); }},
      {"ifft dim 2", [](const at::Tensor& x) { return torch::fft::ifft(x, c10::nullopt, 2); }},
      {"irfftn dims 2,3", [](const at::Tensor& x) {
         return torch::fft::irfftn(x, c10::nullopt, std::vector<int64_t>{2, 3});
       }}};
  for (auto dt : {at::kComplexFloat, at::kComplexDouble}) {
    auto x = rnd_of({2, 3, 7, 6}, 3, dt);
    for (const auto& p : kLayouts) {
      for (bool empty : {false, true}) {
        for (const auto& [name, fn] : fns) {
          EXPECT_TRUE(check(fn, x, p, empty))
              << name << " " << st::to_string(p) << (empty ? " empty-first " : " ") << dt;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- layouts and bytes

namespace {

// Bytes one all-to-all of a [B, C, ...] complex piece sends from this rank:
// rows (this rank's extent along src) x every other coordinate's part of dst.
int64_t a2a_sent(int64_t common, int64_t mine_src, const std::vector<int64_t>& dst_sizes,
                 int64_t me, int64_t elem) {
  int64_t b = 0;
  for (size_t c = 0; c < dst_sizes.size(); ++c) {
    if (static_cast<int64_t>(c) != me) b += common * mine_src * dst_sizes[c] * elem;
  }
  return b;
}

}  // namespace

TEST_F(Fft, RoundTripSendsExactlyTheDocumentedBytes) {
  // [B, C, H, W] float32 sharded along H on mesh dim 0: rfft2 -> spectral layout
  // Shard(3) over W/2+1 (one all-to-all), irfft2 -> Shard(2) (one all-to-all).
  const int64_t B = 2, C = 3, H = 9, W = 10, Wh = W / 2 + 1;
  auto x = rnd({B, C, H, W}, 4);
  const P p = fit_placements(mesh, {S2});
  const int64_t P0 = mesh.size(0), me = mesh.coordinate()[0];
  const auto h = st::balanced_sizes(H, P0), wh = st::balanced_sizes(Wh, P0);
  auto sx = st::distribute_tensor(x, mesh, p, false);
  st::reset_comm_stats();
  auto y = torch::fft::rfft2(sx);
  const auto after_forward = st::comm_stats().bytes_sent;
  auto z = torch::fft::irfft2(y, std::vector<int64_t>{H, W});
  const auto total = st::comm_stats().bytes_sent;
  const int64_t fwd = a2a_sent(B * C, h[me], wh, me, 8);
  const int64_t inv = a2a_sent(B * C, wh[me], h, me, 8);
  EXPECT_TRUE(all_ranks(after_forward == fwd)) << after_forward << " vs " << fwd;
  EXPECT_TRUE(all_ranks(total == fwd + inv)) << total << " vs " << fwd + inv;
  // Spectral layout: the last transformed dim comes out sharded, unless the
  // mesh dim has one coordinate (then nothing moves: the plain call).
  EXPECT_EQ(st::to_string(st::ShardTensor(y).spec().placements()),
            st::to_string(fit_placements(mesh, {P0 > 1 ? S3 : S2})));
  EXPECT_EQ(st::to_string(st::ShardTensor(z).spec().placements()), st::to_string(p));
  EXPECT_TRUE(all_close(gathered(z), x, 1e-5, 1e-5));

  // FftLayout::Input: the result keeps the input's placements; twice the bytes.
  {
    st::FftLayoutGuard guard(st::FftLayout::Input);
    st::reset_comm_stats();
    auto y2 = torch::fft::rfft2(sx);
    EXPECT_EQ(st::to_string(st::ShardTensor(y2).spec().placements()), st::to_string(p));
    const int64_t fwd2 = fwd + a2a_sent(B * C, wh[me], h, me, 8);
    EXPECT_TRUE(all_ranks(st::comm_stats().bytes_sent == fwd2))
        << st::comm_stats().bytes_sent << " vs " << fwd2;
    auto z2 = torch::fft::irfft2(y2, std::vector<int64_t>{H, W});
    // The inverse cannot park H in W (c2r's last dim): it moves H into C
    // (complex), runs the c2r locally, and moves the real result back to H.
    const auto c = st::balanced_sizes(C, P0);
    const int64_t inv2 = a2a_sent(B * Wh, h[me], c, me, 8) + a2a_sent(B * W, c[me], h, me, 4);
    EXPECT_TRUE(all_ranks(st::comm_stats().bytes_sent == fwd2 + inv2))
        << st::comm_stats().bytes_sent << " vs " << fwd2 + inv2 << " (forward " << fwd2 << ")";
    EXPECT_EQ(st::to_string(st::ShardTensor(z2).spec().placements()), st::to_string(p));
    EXPECT_TRUE(spectral_close(as_real(gathered(y2)), as_real(torch::fft::rfft2(x)), false));
    EXPECT_TRUE(all_close(gathered(z2), x, 1e-5, 1e-5));
  }
  EXPECT_EQ(st::fft_layout(), st::FftLayout::Spectral);
}

TEST_F(Fft, InputLayoutModeIsCorrectEverywhere) {
  st::FftLayoutGuard guard(st::FftLayout::Input);
  auto x = rnd_of({2, 3, 7, 10}, 5, at::kDouble);
  Fn fn = [](const at::Tensor& x) {
    return torch::fft::irfft2(torch::fft::rfft2(x) * 2.0, std::vector<int64_t>{7, 10});
  };
  for (const auto& p : kLayouts) {
    EXPECT_TRUE(check(fn, x, p, true)) << st::to_string(p);
  }
}

TEST_F(Fft, NoFreeDimThrowsEverywhere) {
  auto x = rnd({7, 10}, 6);
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1}), false);
  if (mesh.ndim() == 2) {
    EXPECT_TRUE(throws_everywhere([&] { torch::fft::fft2(sx); }, {"_fft_", "no all-to-all"}));
  }
  auto v = st::distribute_tensor(rnd({10}, 7), mesh, fit_placements(mesh, {S0}), false);
  if (mesh.size(0) > 1) {
    EXPECT_TRUE(throws_everywhere([&] { torch::fft::rfft(v); }, {"_fft_r2c", "Shard(0)"}));
  } else {
    EXPECT_TRUE(all_close(gathered(torch::fft::rfft(v)).resolve_conj(),
                          torch::fft::rfft(rnd({10}, 7)).resolve_conj()));
  }
}

// ---------------------------------------------------------------- transport

TEST_F(Fft, ComplexAllReduce) {
  for (auto dt : {at::kComplexFloat, at::kComplexDouble}) {
    auto v = rnd_of({5, 3}, 8, dt) * (mesh.rank() + 1);
    auto all = st::comm::all_reduce(v, mesh, {0});
    const int64_t n = mesh.size(0);
    auto expect = rnd_of({5, 3}, 8, dt) * static_cast<double>(n * (n + 1) / 2);
    if (mesh.ndim() == 2) {
      // coordinate along mesh dim 0 differs from rank: recompute the sum of (rank+1) over dim 0
      auto ones = at::full({1}, static_cast<double>(mesh.rank() + 1), at::kDouble);
      auto s = st::comm::all_reduce(ones, mesh, {0}).item<double>();
      expect = rnd_of({5, 3}, 8, dt) * s;
    }
    EXPECT_TRUE(all_close(as_real(all), as_real(expect), 1e-6, 1e-6)) << dt;
  }
}

// ---------------------------------------------------------------- einsum

TEST_F(Fft, EinsumShardedDimsInAnyPosition) {
  auto x = rnd({2, 3, 7, 6}, 9);
  auto w = rnd({3, 4, 7, 6}, 10);
  auto m = rnd({3, 5}, 11);
  auto spectral = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return torch::einsum("bixy,ioxy->boxy", {in[0], p[0]});
  };
  auto channel = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return torch::einsum("bchw,cd->bdhw", {in[0], p[0]});
  };
  auto implicit = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return torch::einsum("...chw,cd", {in[0], p[0]});
  };
  for (const auto& p : kLayouts) {
    for (bool empty : {false, true}) {
      auto in = empty ? empty_first_input(mesh, x, p) : sharded_input(mesh, x, p);
      EXPECT_TRUE(reference_check(spectral, {in}, mesh, {w})) << st::to_string(p) << empty;
      EXPECT_TRUE(reference_check(channel, {in}, mesh, {m})) << st::to_string(p) << empty;
      EXPECT_TRUE(reference_check(implicit, {in}, mesh, {m})) << st::to_string(p) << empty;
    }
  }
  // Both operands sharded, on the same or different labels.
  auto two = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return torch::einsum("bixy,ioxy->boxy", {in[0], in[1]});
  };
  for (const auto& [pa, pb] : std::vector<std::pair<P, P>>{
           {P{S2, S3}, P{S2, S3}}, {P{S3, S2}, P{S2, S0}}, {P{S1, R}, P{S0, S2}}}) {
    EXPECT_TRUE(
        reference_check(two, {sharded_input(mesh, x, pa), sharded_input(mesh, w, pb)}, mesh))
        << st::to_string(pa) << " " << st::to_string(pb);
  }
}

// ---------------------------------------------------------------- spectral convolution

namespace {

// The usual PyTorch spectral convolution (FNO), unchanged.
struct SpectralConv2dImpl : torch::nn::Module {
  int64_t cin, cout, m1, m2;
  torch::Tensor w1, w2;
  SpectralConv2dImpl(int64_t in, int64_t out, int64_t modes1, int64_t modes2)
      : cin(in), cout(out), m1(modes1), m2(modes2) {
    const double scale = 1.0 / static_cast<double>(in * out);
    w1 = register_parameter("w1", scale * torch::rand({in, out, m1, m2}, torch::kComplexFloat));
    w2 = register_parameter("w2", scale * torch::rand({in, out, m1, m2}, torch::kComplexFloat));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), H = x.size(-2), W = x.size(-1);
    auto x_ft = torch::fft::rfft2(x);
    auto out_ft = x_ft.new_zeros({B, cout, H, W / 2 + 1});
    out_ft.slice(2, 0, m1).slice(3, 0, m2).copy_(
        torch::einsum("bixy,ioxy->boxy", {x_ft.slice(2, 0, m1).slice(3, 0, m2), w1}));
    out_ft.slice(2, H - m1, H)
        .slice(3, 0, m2)
        .copy_(torch::einsum("bixy,ioxy->boxy", {x_ft.slice(2, H - m1, H).slice(3, 0, m2), w2}));
    return torch::fft::irfft2(out_ft, std::vector<int64_t>{H, W});
  }
};
TORCH_MODULE(SpectralConv2d);

}  // namespace

TEST_F(Fft, SpectralConvTrainsUnchangedOnShardedInput) {
  torch::manual_seed(0);
  SpectralConv2d ref(3, 4, 3, 3);
  torch::manual_seed(0);
  SpectralConv2d sh(3, 4, 3, 3);
  st::distribute_module(*sh, mesh);
  auto x = rnd({2, 3, 9, 10}, 12);
  auto target = rnd({2, 4, 9, 10}, 13);
  for (const auto& p : {P{S2, S3}, P{S3, S2}, P{S2, S0}}) {
    for (bool empty : {false, true}) {
      ref->zero_grad();
      sh->zero_grad();
      auto loss_ref = torch::mse_loss(ref(x), target);
      loss_ref.backward();
      auto pl = fit_placements(mesh, p);
      std::optional<st::ShardSizes> sizes;
      if (empty) sizes = sizes_with_empty_first(mesh, pl, x.sizes());
      auto sx = st::distribute_tensor(x, mesh, pl, false, sizes);
      auto st_target = st::distribute_tensor(target, mesh, pl, false, sizes);
      auto out = sh(sx);
      auto loss = torch::mse_loss(out, st_target);
      EXPECT_TRUE(all_close(loss, loss_ref, 1e-5, 1e-6)) << st::to_string(p);
      loss.backward();
      for (const auto& name : {"w1", "w2"}) {
        auto g = sh->named_parameters()[name].grad();
        auto gr = ref->named_parameters()[name].grad();
        ASSERT_TRUE(g.defined());
        EXPECT_TRUE(spectral_close(as_real(g), as_real(gr), false))
            << name << " " << st::to_string(p) << (empty ? " empty-first" : "");
      }
    }
  }
}
