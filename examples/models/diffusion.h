#pragma once
// The main job's data: a domain-parallel diffusion solver (u_t = div(kappa
// grad u), zero-flux walls, explicit flux-form steps) that generates each
// sample on the fly on the sharded grid, and a small PNG writer. Shared by
// examples/unet_train.cpp and examples/fno_train.cpp, so that both train on
// exactly the same data.
#include <png.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace diffusion {

namespace st = shardtensor;

// ---- the solver -------------------------------------------------------------------

constexpr int kWaves = 8;
constexpr int kModes = 4;
constexpr double kLogKappaAmp = 0.4;  // per mode: kappa in [exp(-1.6), exp(1.6)]

/// The random parameters of one sample, identical on every rank (drawn from
/// the sample's seed); the fields are evaluated per subdomain.
/// u0: plane waves of wavelength 8..32 grid cells in random directions (so
/// that k explicit steps visibly damp them, at any resolution); log kappa: a
/// few large-scale Fourier modes of the unit square.
struct SampleParams {
  double amp[kWaves], wavelength[kWaves], angle[kWaves], wphase[kWaves];
  double b[kModes], p[kModes], q[kModes], phase[kModes];
};

inline SampleParams draw(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto r = at::rand({4 * kWaves + 4 * kModes}, gen, at::kDouble);
  auto a = r.accessor<double, 1>();
  SampleParams s{};
  int k = 0;
  for (int i = 0; i < kWaves; ++i) {
    s.amp[i] = (2 * a[k++] - 1) / std::sqrt(static_cast<double>(kWaves));
    s.wavelength[i] = 8 + 24 * a[k++];
    s.angle[i] = M_PI * a[k++];
    s.wphase[i] = 2 * M_PI * a[k++];
  }
  for (int m = 0; m < kModes; ++m) {
    s.b[m] = kLogKappaAmp * (2 * a[k++] - 1);
    s.p[m] = std::floor(7 * a[k++]) - 3;  // integer wave numbers in [-3, 3]
    s.q[m] = std::floor(7 * a[k++]) - 3;
    s.phase[m] = 2 * M_PI * a[k++];
  }
  return s;
}

/// Fields of one sample at rows [r0, r0 + rows) of an n x n grid: {u0, kappa}, [rows, n] each.
inline std::pair<at::Tensor, at::Tensor> fields(const SampleParams& s, int64_t n, int64_t r0,
                                                int64_t rows) {
  auto opt = at::TensorOptions().dtype(at::kFloat);
  auto I = at::arange(r0, r0 + rows, opt).unsqueeze(1);  // global row index
  auto J = at::arange(0, n, opt).unsqueeze(0);           // column index
  auto u = at::zeros({rows, n}, opt);
  for (int i = 0; i < kWaves; ++i) {
    const double w = 2 * M_PI / s.wavelength[i];
    u +=
        s.amp[i] * at::sin(w * (std::cos(s.angle[i]) * I + std::sin(s.angle[i]) * J) + s.wphase[i]);
  }
  auto X = (I + 0.5) / n, Y = (J + 0.5) / n;  // unit-square coordinates
  auto logk = at::zeros({rows, n}, opt);
  for (int m = 0; m < kModes; ++m) {
    logk += s.b[m] * at::sin(2 * M_PI * (s.p[m] * X + s.q[m] * Y) + s.phase[m]);
  }
  return {u, at::exp(logk)};
}

/// The sharded fields u0, kappa ([B, 1, n, n], Shard 0 over data, Shard 2 over
/// domain) of the global samples first_sample .. first_sample + batch - 1,
/// and the solution after `k` steps. Collective over the mesh.
struct Batch {
  at::Tensor input;   // ShardTensor [B, 2, n, n]
  at::Tensor target;  // ShardTensor [B, 1, n, n]
};

inline Batch make_batch(const st::DeviceMesh& mesh, int64_t batch, int64_t n, int64_t k,
                        uint64_t first_sample) {
  torch::NoGradGuard no_grad;
  const st::Placements pl{st::Shard{0}, st::Shard{2}};
  auto spec1 =
      std::make_shared<const st::ShardSpec>(mesh, pl, std::vector<int64_t>{batch, 1, n, n});
  auto spec2 =
      std::make_shared<const st::ShardSpec>(mesh, pl, std::vector<int64_t>{batch, 2, n, n});
  const auto off = spec1->local_offsets();
  const auto shape = spec1->local_shape();
  std::vector<at::Tensor> us, ks;
  for (int64_t b = 0; b < shape[0]; ++b) {
    auto s = draw(1000003ull * (first_sample + off[0] + b) + 17);
    auto [u, kap] = fields(s, n, off[2], shape[2]);
    us.push_back(u.unsqueeze(0));
    ks.push_back(kap.unsqueeze(0));
  }
  auto u0 = at::stack(us).contiguous();     // [b, 1, rows, n]
  auto kappa = at::stack(ks).contiguous();  // [b, 1, rows, n]
  // Face diffusivities (arithmetic means) from one halo of kappa; zero-flux
  // walls: PadMode::Replicate makes the ghost equal the edge, so the flux
  // through the wall vanishes.
  auto kst = st::ShardTensor::from_local_unchecked(kappa, spec1);
  auto kr = st::halo_exchange(kst, 2, 1, 1, st::PadMode::Replicate);  // [b,1,rows+2,n]
  const int64_t rows = shape[2];
  auto k_up = 0.5 * (kr.narrow(2, 0, rows) + kappa), k_dn = 0.5 * (kr.narrow(2, 2, rows) + kappa);
  auto kc = at::constant_pad_nd(kappa, {1, 1}, 0);  // columns are not sharded: local pad
  kc.select(3, 0).copy_(kappa.select(3, 0));
  kc.select(3, n + 1).copy_(kappa.select(3, n - 1));
  auto k_lf = 0.5 * (kc.narrow(3, 0, n) + kappa), k_rt = 0.5 * (kc.narrow(3, 2, n) + kappa);
  // Stable for every sample: dt <= h^2 / (4 kappa_max), kappa_max <= exp(kModes * amp).
  const double h = 1.0 / n;
  const double dt = 0.2 * h * h / std::exp(kModes * kLogKappaAmp);
  const double c = dt / (h * h);
  at::Tensor u = u0.clone();
  for (int64_t step = 0; step < k; ++step) {
    auto ust = st::ShardTensor::from_local_unchecked(u, spec1);
    auto ur = st::halo_exchange(ust, 2, 1, 1, st::PadMode::Replicate);
    auto uc = at::replication_pad2d(u, {1, 1, 0, 0});
    auto flux = k_up * (ur.narrow(2, 0, rows) - u) + k_dn * (ur.narrow(2, 2, rows) - u) +
                k_lf * (uc.narrow(3, 0, n) - u) + k_rt * (uc.narrow(3, 2, n) - u);
    u = u + c * flux;
  }
  Batch out;
  out.input =
      st::ShardTensor::from_local_unchecked(at::cat({u0, kappa.log()}, 1).contiguous(), spec2);
  out.target = st::ShardTensor::from_local_unchecked(u, spec1);
  return out;
}

// ---- PNG ----------------------------------------------------------------------------

/// A perceptual colour map (piecewise-linear through viridis-like anchors), t in [0, 1].
inline void colour(double t, png_byte* rgb) {
  static const double anchors[][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::clamp(t, 0.0, 1.0) * 4;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<png_byte>(anchors[i][c] + f * (anchors[i + 1][c] - anchors[i][c]));
  }
}

/// Panels (2-D tensors, same size) side by side, each scaled to [lo, hi] of its own range
/// (or the shared range of `shared`), with a 4-pixel white gap.
inline bool write_png(const std::string& path, const std::vector<at::Tensor>& panels,
                      const std::vector<std::pair<double, double>>& ranges) {
  const int64_t h = panels[0].size(0), w = panels[0].size(1), gap = 4;
  const int64_t W = static_cast<int64_t>(panels.size()) * (w + gap) - gap;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(f);
    return false;
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(W), static_cast<png_uint_32>(h), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  std::vector<png_byte> row(3 * W);
  std::vector<at::TensorAccessor<float, 2>> acc;
  std::vector<at::Tensor> keep;
  for (const auto& p : panels) keep.push_back(p.to(at::kFloat).contiguous());
  for (const auto& p : keep) acc.push_back(p.accessor<float, 2>());
  for (int64_t i = 0; i < h; ++i) {
    std::fill(row.begin(), row.end(), 255);
    for (size_t k = 0; k < panels.size(); ++k) {
      const auto [lo, hi] = ranges[k];
      for (int64_t j = 0; j < w; ++j) {
        const double t = (acc[k][i][j] - lo) / std::max(1e-12, hi - lo);
        colour(t, &row[3 * (k * (w + gap) + j)]);
      }
    }
    png_write_row(png, row.data());
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  std::fclose(f);
  return true;
}

}  // namespace diffusion
