// Sharding rules for interpolation (torch::nn::functional::interpolate,
// torch::nn::Upsample): upsample_nearest{1,2,3}d, _upsample_nearest_exact{1,2,3}d,
// upsample_linear1d, upsample_bilinear2d, upsample_bicubic2d,
// upsample_trilinear3d, each in its plain (output_size, scales...) and .vec
// (output_size?, scale_factors?) overloads. Mode "area" is adaptive_avg_pool
// (ops/pool.cpp).
//
// Note [interpolation as weighted gathers]: along each spatial dim, output o
// reads a few source indices idx_j(o) with weights w_j(o) (nearest: 1 tap,
// linear: 2, cubic: 4), computed here with libtorch's own formulas and
// precision (Note [interpolation indices]). Interpolation is separable, so the
// result is obtained dim by dim as
//     out = sum_j w_j(o) * x.index_select(dim, idx_j(o) - lo)
// where lo is the first global index of the input range this rank holds. The
// output is partitioned first (stencil::output_sizes); each rank needs the
// input range [min_j,o idx_j(o), max_j,o idx_j(o) + 1) of its output block,
// which comm::gather_range fetches (any halo, multi-hop, negative). index_select
// and mul are differentiable, and gather_range's backward is its adjoint, so
// the gradient is exact with no extra code. Every dim, sharded or not, takes
// the same path, so one rank and many ranks compute the same float operations
// (up to summation order). All decisions depend on global shapes, specs and
// op args only.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>

#include "comm/settings.h"
#include "ops/common.h"
#include "ops/halo_blocks.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

enum class Mode { Nearest, NearestExact, Linear, Cubic };

struct Taps {
  int64_t n = 1;                          // taps per output index
  std::vector<std::vector<int64_t>> idx;  // [tap][o], global source index
  std::vector<std::vector<double>> w;     // [tap][o]
};

// Note [interpolation indices]: these replicate the CPU kernels of libtorch
// 2.x (aten/src/ATen/native/UpSample.h and cpu/UpSampleKernel.cpp): the scale
// is computed in the input's scalar type (area_pixel_compute_scale: 1/scale
// when a positive scale is given and align_corners is false, else in/out or
// (in-1)/(out-1)); linear computes the source index and its weight in the op-math
// type (float for float32: libtorch 1.13 used double here, and a float32 weight then
// differed from 2.x's by up to ~1e-6, which Interp.SplitPhase2d caught at s = 3), with
// guard_index_and_lambda's clamps; cubic and nearest in the scalar type. Nearest is
// discontinuous, so the index must be bit-exact; linear and cubic are
// continuous in the source coordinate, so a rounding difference at an integer
// source index changes the result by at most a rounding error.
// Note [nearest special extents]: for nearest, libtorch's nearest_idx
// (UpSample.h) takes o where out == in and o / 2 where out == 2 * in, whatever
// scale is given, and floor(o * (1 / scale)) otherwise. In 2.13 (checked
// against index_select in float64, scales 1.05 and 2.05) the 2-d CPU kernels
// use it forward and backward; the 1-d and 3-d forward kernels use
// floor(o * (1 / scale)) at every extent while their backward kernels use
// nearest_idx, so their gradient is not their forward's adjoint there (libtorch
// 1.13 had that inconsistency for out == 2 * in). The rule follows each
// forward (`nearest_idx` is set for 2-d), and its gradient is that forward's
// exact adjoint.
template <typename T>
Taps compute_taps(Mode mode, int64_t in, int64_t out, bool align_corners,
                  std::optional<double> scale_opt, bool nearest_idx = false) {
  auto compute_scales_value = [&]() -> T {
    return (scale_opt.has_value() && *scale_opt > 0.) ? static_cast<T>(1.0 / *scale_opt)
                                                      : (static_cast<T>(in) / out);
  };
  auto area_pixel_compute_scale = [&](bool ac) -> T {
    if (ac) return out > 1 ? static_cast<T>(in - 1) / (out - 1) : static_cast<T>(0);
    return compute_scales_value();
  };
  Taps t;
  switch (mode) {
    case Mode::Nearest:
    case Mode::NearestExact:
      t.n = 1;
      break;
    case Mode::Linear:
      t.n = 2;
      break;
    case Mode::Cubic:
      t.n = 4;
      break;
  }
  t.idx.assign(t.n, std::vector<int64_t>(out));
  t.w.assign(t.n, std::vector<double>(out));
  for (int64_t o = 0; o < out; ++o) {
    if (mode == Mode::Nearest) {
      const T scale = area_pixel_compute_scale(false);
      const T real = scale * static_cast<T>(o);
      const int64_t i = static_cast<int64_t>(std::floor(real));
      t.idx[0][o] = std::min(i, in - 1);
      // Note [nearest special extents].
      if (nearest_idx && out == in) t.idx[0][o] = o;
      if (nearest_idx && out == 2 * in) t.idx[0][o] = o / 2;
      t.w[0][o] = 1.0;
    } else if (mode == Mode::NearestExact) {
      const T scale = area_pixel_compute_scale(false);
      T real = scale * (static_cast<T>(o) + static_cast<T>(0.5)) - static_cast<T>(0.5);
      if (real < 0) real = 0;
      const int64_t i = static_cast<int64_t>(std::floor(real + static_cast<T>(0.5)));
      t.idx[0][o] = std::min(i, in - 1);
      t.w[0][o] = 1.0;
    } else if (mode == Mode::Linear) {
      if (in == out) {
        t.idx[0][o] = t.idx[1][o] = o;
        t.w[0][o] = 1.0;
        t.w[1][o] = 0.0;
        continue;
      }
      const T scale = area_pixel_compute_scale(align_corners);
      T real;
      if (align_corners) {
        real = scale * static_cast<T>(o);
      } else {
        real = scale * (static_cast<T>(o) + static_cast<T>(0.5)) - static_cast<T>(0.5);
        if (real < 0) real = 0;
      }
      // guard_index_and_lambda (UpSample.h): floorf, clamped index and lambda.
      const int64_t i0 =
          std::min(static_cast<int64_t>(std::floor(static_cast<float>(real))), in - 1);
      const int64_t i1 = i0 + ((i0 < in - 1) ? 1 : 0);
      const T l1 =
          std::min(std::max(real - static_cast<T>(i0), static_cast<T>(0)), static_cast<T>(1));
      const T l0 = static_cast<T>(1.) - l1;
      t.idx[0][o] = i0;
      t.idx[1][o] = i1;
      t.w[0][o] = l0;
      t.w[1][o] = l1;
    } else {
      const T scale = area_pixel_compute_scale(align_corners);
      T real;
      if (align_corners) {
        real = scale * static_cast<T>(o);
      } else {
        real = scale * (static_cast<T>(o) + static_cast<T>(0.5)) - static_cast<T>(0.5);
      }
      const int64_t i0 = static_cast<int64_t>(std::floor(real));
      const T x1 = real - static_cast<T>(i0);
      const T A = static_cast<T>(-0.75);
      auto conv1 = [&](T x) { return ((A + 2) * x - (A + 3)) * x * x + 1; };
      auto conv2 = [&](T x) { return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A; };
      const T x2 = static_cast<T>(1.0) - x1;
      const T c[4] = {conv2(x1 + static_cast<T>(1.0)), conv1(x1), conv1(x2),
                      conv2(x2 + static_cast<T>(1.0))};
      for (int64_t j = 0; j < 4; ++j) {
        t.idx[j][o] = std::max<int64_t>(std::min(i0 - 1 + j, in - 1), 0);
        t.w[j][o] = c[j];
      }
    }
  }
  return t;
}

struct InterpOp {
  Mode mode;
  int64_t nd;      // spatial dims
  bool has_align;  // linear modes take align_corners
};

// libtorch's kernel for `mode` on `x` with explicit per-dim output sizes and scales.
at::Tensor upsample(const InterpOp& p, const at::Tensor& x, c10::IntArrayRef out, bool ac,
                    const std::vector<std::optional<double>>& sc) {
  auto o = [&](int64_t i) { return sc[i] ? c10::optional<double>(*sc[i]) : c10::nullopt; };
  switch (p.mode) {
    case Mode::Nearest:
      if (p.nd == 1) return at::upsample_nearest1d(x, out, o(0));
      if (p.nd == 2) return at::upsample_nearest2d(x, out, o(0), o(1));
      return at::upsample_nearest3d(x, out, o(0), o(1), o(2));
    case Mode::NearestExact:
      if (p.nd == 1) return at::_upsample_nearest_exact1d(x, out, o(0));
      if (p.nd == 2) return at::_upsample_nearest_exact2d(x, out, o(0), o(1));
      return at::_upsample_nearest_exact3d(x, out, o(0), o(1), o(2));
    case Mode::Linear:
      if (p.nd == 1) return at::upsample_linear1d(x, out, ac, o(0));
      if (p.nd == 2) return at::upsample_bilinear2d(x, out, ac, o(0), o(1));
      return at::upsample_trilinear3d(x, out, ac, o(0), o(1), o(2));
    case Mode::Cubic:
      return at::upsample_bicubic2d(x, out, ac, o(0), o(1));
  }
  return at::Tensor();
}

bool same_taps(const Taps& a, int64_t a0, const Taps& b, int64_t b0, int64_t shift, int64_t count) {
  for (int64_t j = 0; j < a.n; ++j) {
    for (int64_t o = 0; o < count; ++o) {
      if (a.idx[j][a0 + o] != b.idx[j][b0 + o] + shift || a.w[j][a0 + o] != b.w[j][b0 + o]) {
        return false;
      }
    }
  }
  return true;
}

// Note [native interpolation on pieces]: along a sharded dim with an integer
// scale s (out = s * n, and a given scale, if any, equal to s), this rank's
// output block [o0, o1) reads the input range [L, H) (the taps' hull,
// gathered with edge replication). libtorch's kernel run on that piece with
// output extent s * (H - L) and scale s computes, for local output o - s L,
// source coordinates shifted by exactly L *if* its taps (indices and weights,
// computed by compute_taps with libtorch's own formulas and precision) equal
// the global taps shifted by L for every output of the block. That is the
// general condition, checked here per rank from metadata (no agreement is
// needed: the communication, the gather of [L, H), is the same either way).
// It holds for linear and cubic modes with align_corners = false (the source
// coordinate (o + 1/2)/s - 1/2 is affine with slope 1/s; local clamping at 0
// and n - 1 only happens where the global one does, because [L, H) holds every
// tap) where the weights round alike at o and o - s L (s a power of two; not
// s = 3), and for nearest modes wherever float rounding of o * (1/s) does not
// move an index across an integer (always for s a power of two). It fails for
// align_corners = true (scale (in - 1)/(out - 1) depends on the extent) and
// non-integer scales; those keep the weighted gathers below. Unsharded dims
// are passed the global output extent and the caller's scale unchanged. The
// result is narrowed to the block; backward is libtorch's upsample backward
// (which saves no input) followed by gather_range's halo accumulate.
// This path runs where the split (Note [split-phase interpolation]) does not
// apply: the gather of [L, H) is blocking and makes a piece-sized copy, and
// the narrowed result is copied once more.
at::Tensor native_on_piece(const InterpOp& p, const at::Tensor& g, const ShardSpec& in,
                           const std::vector<stencil::DimPlan>& plans,
                           const std::vector<Taps>& taps, const std::vector<int64_t>& shape,
                           const std::vector<int64_t>& out_ext,
                           const std::vector<std::optional<double>>& scales, bool ac) {
  if (ac) return at::Tensor();
  const bool dbl = g.scalar_type() == at::kDouble;
  const auto coord = in.mesh().coordinate();
  std::vector<int64_t> call_out(out_ext);
  std::vector<std::optional<double>> call_sc(scales);
  std::vector<std::pair<int64_t, int64_t>> narrow(p.nd, {0, -1});  // (start, length)
  for (const auto& plan : plans) {
    const int64_t i = plan.dim - 2;
    const int64_t n = shape[plan.dim], out = out_ext[i];
    if (out % n != 0) return at::Tensor();
    const int64_t s = out / n;
    if (scales[i] && *scales[i] != static_cast<double>(s)) return at::Tensor();
    const int64_t c = coord[plan.mesh_dim];
    int64_t o0 = 0;
    for (int64_t k = 0; k < c; ++k) o0 += plan.out_sizes[k];
    const int64_t cnt = plan.out_sizes[c];
    const auto [L, H] = plan.ranges[c];
    if (cnt == 0 || H <= L) return at::Tensor();
    const int64_t lout = s * (H - L);
    const int64_t start = o0 - s * L;
    if (start < 0 || start + cnt > lout) return at::Tensor();
    const Taps lt = dbl ? compute_taps<double>(p.mode, H - L, lout, false, double(s))
                        : compute_taps<float>(p.mode, H - L, lout, false, double(s));
    if (!same_taps(taps[i], o0, lt, start, L, cnt)) return at::Tensor();
    call_out[i] = lout;
    call_sc[i] = static_cast<double>(s);
    narrow[i] = {start, cnt};
  }
  at::Tensor y = upsample(p, g, call_out, ac, call_sc);
  for (int64_t i = 0; i < p.nd; ++i) {
    if (narrow[i].second >= 0) y = y.narrow(i + 2, narrow[i].first, narrow[i].second);
  }
  return y.contiguous();
}

// Note [split-phase interpolation]: with the same condition as Note [native
// interpolation on pieces] (align_corners = false, integer scale s per
// sharded dim, libtorch's kernel computing the global taps on a sub-range),
// the halo exchange overlaps compute and the piece is never copied. The
// decision uses global shapes, specs and op args only (every coordinate's
// taps are checked, not only this rank's), so every rank takes the same path.
// Per sharded dim, every piece [off, off + n) and output block [o0, o0 + cnt)
// is non-empty and the block's interior [ia, ib) (outputs whose taps all lie
// inside the piece; taps are monotone in o, so it is a range) is non-empty,
// and libtorch's kernel, run on an input range [a, b) with scale s (output
// extent call_extent), computes the global taps shifted by a for: the
// interior outputs on the piece itself; the left boundary [o0, ia) and the
// right boundary [ib, o0 + cnt) on their taps' hulls; and, with several
// sharded dims, the whole block on its hull. Bit-equal taps need s * (1/s)
// products that round alike at o and o - s a: s a power of two in practice
// (s = 3 linear / cubic weights differ in the last bit, so those take the
// weighted gathers; nearest s = 3 splits). Then (the scheme of Note
// [split-phase pool], several sharded dims included: the 2x2 mesh) the halo
// strips, the rows left and right of each piece that its block reads, are
// posted (comm::gather_range_start; edge replication, though the taps never
// leave [0, N)), libtorch's kernel runs on the whole local piece while they
// travel (its outputs next to the piece's edges, which clamp at the local
// edge, are wrong and get replaced), and the boundary outputs are computed
// from strips with the same kernel: along sharded dim j, the boundary
// outputs of j crossed with the whole block of earlier sharded dims and the
// interior of later ones (every output written once), each strip assembled
// from narrowed blocks (halo rows + the few local rows the boundary taps
// read; corners come from a second-level exchange of the first-level blocks,
// as in the pool). When the interior kernel's output is exactly the block
// (o0 = s * off and cnt = s * n on every sharded dim: the even U-Net pieces),
// it is the output and the boundary rows are written into it; otherwise the
// interior is copied into an output-sized tensor. Nearest modes on aligned
// blocks read no halo at all: no message is sent, no copy is made.
// Backward: libtorch's own upsample backward kernels (they save no input),
// AssembleFn's (the block's gradient narrowed per strip; one clone with the
// strips' rows zeroed for the interior kernel when it wrote the block: a
// copy_ per strip would make one CopySlices each, each cloning the whole
// gradient) and the halo strips' adjoint; no halo-extended copy is saved.
// SHARDTENSOR_INTERP_SPLIT=0 turns the split path off (for comparisons; the
// test Interp.SplitPhaseHoldsNoPaddedCopy then fails: the general path holds
// the halo-extended piece and the kernel's output on it, ~5x the piece at
// x2 in 2-D). Everything else (empty pieces or blocks, no interior, taps
// that do not match) takes Note [native interpolation on pieces] or the
// weighted gathers.
// Measured (bench profile unet2d train 512x512, P = 2, 3 upsample_bilinear2d
// x2, ms per step on the slowest rank, four alternating pairs off -> on, CPU
// load 4-6 on 2 shared cores, times indicative): forward
// aten::upsample_bilinear2d 32-50 -> 29-47 (three of four pairs 29-30; its
// comm, the finish's wait with rank skew, 7-13 -> 8-15); backward
// UpsampleBilinear2DBackward0 + SliceBackward0 + GatherRangeFn 82-155 (three
// of four 82-91) -> UpsampleBilinear2DBackward0 (6 calls: interior + strip)
// + AssembleFn + SliceBackward0 + HaloEndFn 92-156 (three of four 92-98;
// AssembleFn's clone 11-17 replaces SliceBackward0's 14-32, and the halo
// adjoint's 13-40 of comm is mostly waiting for the other rank): the forward
// gains and holds no piece-sized copy, the backward is a wash at this noise.
// Bytes unchanged: 96 KiB, 3 messages each way.
struct SplitDim {
  int64_t si = 0, dim = 0, mesh_dim = 0, s = 1;
  std::vector<int64_t> in_sizes;
  std::vector<stencil::Range> left, right;  // per coordinate: the halo ranges
  // This rank: piece, block, interior, the hulls of the boundaries and the block.
  int64_t off = 0, n = 0, o0 = 0, cnt = 0, ia = 0, ib = 0;
  stencil::Range lhull, rhull, hull;
};

// The taps' hull of outputs [a, b) (a < b).
stencil::Range taps_hull(const Taps& t, int64_t a, int64_t b) {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t j = 0; j < t.n; ++j) {
    for (int64_t o = a; o < b; ++o) {
      lo = std::min(lo, t.idx[j][o]);
      hi = std::max(hi, t.idx[j][o] + 1);
    }
  }
  return {lo, hi};
}

// Note [split-phase interpolation]: the output extent of libtorch's kernel
// on m input rows (scale s given) whose outputs [0, end) are wanted: s * m
// when `full`, else `end` (the scale, not the extent, places the taps), except
// where libtorch special-cases the extent: out == in (linear copies, nearest's
// backward is the identity) and out == 2 * in with s != 2 (nearest's backward
// takes o / 2).
int64_t call_extent(int64_t s, int64_t m, int64_t end, bool full) {
  if (full || s == 1) return s * m;
  int64_t e = end;
  if (e == m) ++e;
  if (e == 2 * m && s != 2) ++e;
  return std::min(e, s * m);
}

// Whether libtorch's kernel on the input range `in` (scale s, output extent
// call_extent) computes outputs [oa, ob) with the global taps `t`.
bool kernel_fits(Mode mode, bool dbl, const Taps& t, int64_t s, stencil::Range in, int64_t oa,
                 int64_t ob, bool full) {
  const int64_t m = in.second - in.first;
  if (m <= 0 || oa >= ob) return false;
  const int64_t start = oa - s * in.first;
  if (start < 0 || ob - s * in.first > s * m) return false;
  const int64_t e = call_extent(s, m, ob - s * in.first, full);
  const Taps lt = dbl ? compute_taps<double>(mode, m, e, false, double(s))
                      : compute_taps<float>(mode, m, e, false, double(s));
  return same_taps(t, oa, lt, start, in.first, ob - oa);
}

std::optional<std::vector<SplitDim>> split_plan(
    const InterpOp& p, bool dbl, bool ac, const std::vector<stencil::DimPlan>& plans,
    const std::vector<Taps>& taps, c10::IntArrayRef shape, const std::vector<int64_t>& out_ext,
    const std::vector<std::optional<double>>& scales, const DeviceMesh& mesh) {
  // Note [agreed settings]: read where every rank takes the same path.
  if (ac || plans.empty() || !comm::use_setting(mesh, Setting::InterpSplit)) return std::nullopt;
  for (int64_t e : shape) {
    if (e == 0) return std::nullopt;
  }
  const bool several = plans.size() > 1;
  std::vector<SplitDim> out;
  for (const auto& pl : plans) {
    SplitDim sd;
    sd.dim = pl.dim;
    sd.si = pl.dim - 2;
    sd.mesh_dim = pl.mesh_dim;
    sd.in_sizes = pl.in_sizes;
    const int64_t i = sd.si, N = shape[pl.dim], out_n = out_ext[i];
    if (out_n % N != 0) return std::nullopt;
    const int64_t s = out_n / N;
    if (scales[i] && *scales[i] != static_cast<double>(s)) return std::nullopt;
    sd.s = s;
    const Taps& t = taps[i];
    const int64_t me = mesh.coordinate()[pl.mesh_dim];
    int64_t off = 0, o0 = 0;
    for (size_t c = 0; c < pl.in_sizes.size(); ++c) {
      const int64_t n = pl.in_sizes[c], cnt = pl.out_sizes[c];
      if (n == 0 || cnt == 0) return std::nullopt;
      // Interior: taps inside [off, off + n); monotone taps make it a range.
      int64_t ia = -1, ib = -1;
      for (int64_t o = o0; o < o0 + cnt; ++o) {
        bool in = true;
        for (int64_t j = 0; j < t.n && in; ++j) in = t.idx[j][o] >= off && t.idx[j][o] < off + n;
        if (!in) {
          if (ia >= 0 && ib < 0) ib = o;
          continue;
        }
        if (ib >= 0) return std::nullopt;  // not a range
        if (ia < 0) ia = o;
      }
      if (ia < 0) return std::nullopt;
      if (ib < 0) ib = o0 + cnt;
      // The interior kernel: the whole block when it is s times the piece.
      const bool exact = o0 == s * off && cnt == s * n;
      if (!kernel_fits(p.mode, dbl, t, s, {off, off + n}, ia, ib, exact)) return std::nullopt;
      stencil::Range lh{off, off}, rh{off + n, off + n};
      if (o0 < ia) {
        lh = taps_hull(t, o0, ia);
        if (lh.second > off + n || !kernel_fits(p.mode, dbl, t, s, lh, o0, ia, false)) {
          return std::nullopt;
        }
      }
      if (ib < o0 + cnt) {
        rh = taps_hull(t, ib, o0 + cnt);
        if (rh.first < off || !kernel_fits(p.mode, dbl, t, s, rh, ib, o0 + cnt, false)) {
          return std::nullopt;
        }
      }
      const stencil::Range hull = pl.ranges[c];
      if (several && !kernel_fits(p.mode, dbl, t, s, hull, o0, o0 + cnt, false))
        return std::nullopt;
      sd.left.emplace_back(std::min(hull.first, off), off);
      sd.right.emplace_back(off + n, std::max(hull.second, off + n));
      if (static_cast<int64_t>(c) == me) {
        sd.off = off;
        sd.n = n;
        sd.o0 = o0;
        sd.cnt = cnt;
        sd.ia = ia;
        sd.ib = ib;
        sd.lhull = lh;
        sd.rhull = rh;
        sd.hull = hull;
      }
      off += n;
      o0 += cnt;
    }
    out.push_back(std::move(sd));
  }
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Note [split-phase interpolation]: writes the values into the output block,
// in one autograd node (a copy_ per value would make one CopySlices each,
// every one cloning the block's whole gradient). `base`, when defined, is the
// interior kernel's output, already the block: the values are written into
// it (marked dirty). Otherwise the block is allocated (`shape`). `boxes`: per
// value, per sharded dim, (dim, start, length) in the block. `list` holds the
// `nvals` values, then the ties: exchanged blocks that feed no value, whose
// (zero, empty in practice) gradient must still reach their halo adjoint,
// which is collective. Backward: the block's gradient narrowed for each value
// (no copy), and for `base` one clone with the values' boxes zeroed.
struct AssembleFn : torch::autograd::Function<AssembleFn> {
  static at::Tensor forward(AutogradContext* ctx, const c10::optional<at::Tensor>& base_opt,
                            at::TensorList list, std::vector<int64_t> boxes, int64_t nvals,
                            std::vector<int64_t> shape) {
    const int64_t nb = static_cast<int64_t>(boxes.size()) / (3 * std::max<int64_t>(nvals, 1));
    const at::Tensor base = base_opt.value_or(at::Tensor());
    at::Tensor out = base.defined() ? base : at::empty(shape, list[0].options());
    for (int64_t i = 0; i < nvals; ++i) {
      at::Tensor dst = out;
      for (int64_t r = 0; r < nb; ++r) {
        const int64_t* b = &boxes[3 * (i * nb + r)];
        dst = dst.narrow(b[0], b[1], b[2]);
      }
      dst.copy_(list[i]);
    }
    if (base.defined()) ctx->mark_dirty({base});
    std::vector<int64_t> ties;  // per tie: ndim, sizes
    for (size_t i = nvals; i < list.size(); ++i) {
      ties.push_back(list[i].dim());
      for (int64_t e : list[i].sizes()) ties.push_back(e);
    }
    ctx->saved_data["boxes"] = std::move(boxes);
    ctx->saved_data["nvals"] = nvals;
    ctx->saved_data["ties"] = std::move(ties);
    ctx->saved_data["base"] = base.defined();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("AssembleFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    const auto boxes = ctx->saved_data.at("boxes").toIntVector();
    const auto ties = ctx->saved_data.at("ties").toIntVector();
    const int64_t nvals = ctx->saved_data.at("nvals").toInt();
    const bool has_base = ctx->saved_data.at("base").toBool();
    const int64_t nb = static_cast<int64_t>(boxes.size()) / (3 * std::max<int64_t>(nvals, 1));
    const at::Tensor& g = grads[0];
    auto box = [&](at::Tensor t, int64_t i) {
      for (int64_t r = 0; r < nb; ++r) {
        const int64_t* b = &boxes[3 * (i * nb + r)];
        t = t.narrow(b[0], b[1], b[2]);
      }
      return t;
    };
    variable_list res;
    if (has_base && g.defined()) {
      at::Tensor gb = g.clone();
      for (int64_t i = 0; i < nvals; ++i) box(gb, i).zero_();
      res.push_back(gb);
    } else {
      res.emplace_back();
    }
    for (int64_t i = 0; i < nvals; ++i) res.push_back(g.defined() ? box(g, i) : at::Tensor());
    for (size_t k = 0; k < ties.size();) {
      const int64_t nd = ties[k];
      std::vector<int64_t> sz(ties.begin() + k + 1, ties.begin() + k + 1 + nd);
      // Zero, but computed from g: under create_graph the halo adjoint's own
      // backward (collective) must run on every rank (Note [differentiable adjoints]).
      res.push_back(g.defined() ? g.narrow(0, 0, 0).sum().expand(sz) : at::Tensor());
      k += 1 + nd;
    }
    res.resize(res.size() + 3);  // boxes, nvals, shape
    return res;
  }
};

// Note [split-phase interpolation]: the forward of the split path; this
// rank's output block (shape out_local).
at::Tensor split_forward(const InterpOp& p, const at::Tensor& x, const DeviceMesh& mesh,
                         const std::vector<SplitDim>& sd, const std::vector<int64_t>& out_ext,
                         const std::vector<std::optional<double>>& scales,
                         const std::vector<int64_t>& out_local) {
  const int64_t D = static_cast<int64_t>(sd.size());
  // Note [halo blocks].
  std::vector<stencil::BlockDim> bd;
  for (const auto& d : sd)
    bd.push_back({d.dim, d.mesh_dim, d.in_sizes, d.left, d.right, d.off, d.n});
  stencil::HaloBlocks hb(x, mesh, std::move(bd), PadMode::Replicate, 0.0);
  // The global input box each boundary kernel reads (hb.region(want)).
  std::vector<stencil::Range> want(D);
  // libtorch's kernel on g, which holds the global input ranges `in` along the
  // sharded dims, for the global outputs before `end` there (scale s, extent
  // call_extent); the caller's extent and scale on the other dims.
  auto kernel = [&](const at::Tensor& g, const std::vector<stencil::Range>& in,
                    const std::vector<int64_t>& end, const std::vector<char>& full) {
    std::vector<int64_t> co(out_ext);
    std::vector<std::optional<double>> cs(scales);
    for (int64_t r = 0; r < D; ++r) {
      const int64_t m = in[r].second - in[r].first, s = sd[r].s;
      TORCH_INTERNAL_ASSERT(g.size(sd[r].dim) == m);
      co[sd[r].si] = call_extent(s, m, end[r] - s * in[r].first, full[r]);
      cs[sd[r].si] = static_cast<double>(s);
    }
    return upsample(p, g, co, false, cs);
  };

  hb.start_level(1);
  // Interior: libtorch's kernel on the whole local piece.
  std::vector<stencil::Range> piece(D);
  std::vector<int64_t> iend(D);
  std::vector<char> full(D);
  bool exact = true;
  for (int64_t r = 0; r < D; ++r) {
    piece[r] = {sd[r].off, sd[r].off + sd[r].n};
    iend[r] = sd[r].ib;
    full[r] = sd[r].o0 == sd[r].s * sd[r].off && sd[r].cnt == sd[r].s * sd[r].n;
    exact = exact && full[r];
  }
  at::Tensor yi = kernel(x, piece, iend, full);
  // The values written into the block (AssembleFn) and their boxes.
  std::vector<at::Tensor> vals;
  std::vector<int64_t> boxes;
  if (!exact) {
    at::Tensor src = yi;
    for (const auto& d : sd) {
      src = src.narrow(d.dim, d.ia - d.s * d.off, d.ib - d.ia);
      boxes.insert(boxes.end(), {d.dim, d.ia - d.o0, d.ib - d.ia});
    }
    vals.push_back(src);
  }
  for (int64_t l = 1; l <= D; ++l) {
    hb.finish_level(l);
    if (l < D) hb.start_level(l + 1);
    // Box l-1: boundary outputs of sharded dim l-1, the whole block of
    // earlier sharded dims, the interior of later ones.
    const int64_t j = l - 1;
    const SplitDim& dj = sd[j];
    for (int64_t sideb = 0; sideb < 2; ++sideb) {
      const stencil::Range ob =
          sideb == 0 ? stencil::Range{dj.o0, dj.ia} : stencil::Range{dj.ib, dj.o0 + dj.cnt};
      if (ob.first >= ob.second) continue;
      std::vector<stencil::Range> outs(D);
      std::vector<int64_t> end(D);
      std::vector<char> fr(D, 0);
      for (int64_t r = 0; r < D; ++r) {
        if (r < j) {
          outs[r] = {sd[r].o0, sd[r].o0 + sd[r].cnt};
          want[r] = sd[r].hull;
        } else if (r == j) {
          outs[r] = ob;
          want[r] = sideb == 0 ? dj.lhull : dj.rhull;
        } else {
          outs[r] = {sd[r].ia, sd[r].ib};
          want[r] = piece[r];
          fr[r] = full[r];  // as the interior kernel (checked so by split_plan)
        }
        end[r] = outs[r].second;
      }
      at::Tensor v = kernel(hb.region(want), want, end, fr);
      for (int64_t r = 0; r < D; ++r) {
        const int64_t len = outs[r].second - outs[r].first;
        v = v.narrow(sd[r].dim, outs[r].first - sd[r].s * want[r].first, len);
        boxes.insert(boxes.end(), {sd[r].dim, outs[r].first - sd[r].o0, len});
      }
      // Compact: the kernel's output (a few rows more) is freed at once.
      vals.push_back(v.contiguous());
    }
  }
  // A block that came through an exchange but feeds no strip (an empty halo
  // next to a rank whose neighbour does read from it) must still run its
  // adjoint in backward (collective): a tie of AssembleFn.
  const int64_t nvals = static_cast<int64_t>(vals.size());
  for (int64_t b = 0; b < hb.count(); ++b) {
    if (hb.exchanged(b) && !hb.used(b)) vals.push_back(hb.block(b));
  }
  if (vals.empty()) return yi;  // the block itself: nothing exchanged, no boundary
  at::Tensor out = AssembleFn::apply(exact ? c10::optional<at::Tensor>(yi) : c10::nullopt,
                                     at::TensorList(vals), std::move(boxes), nvals, out_local);
  return out;
}

void interpolate_rule(const c10::OperatorHandle& op, Stack* stack, InterpOp p) {
  auto args = pop_args(op, stack);
  const auto& schema = op.schema();
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  if (!s) fail(op, args, "the input must be the ShardTensor");
  {
    // Note [reduced precision]: libtorch's verdict on the input's dtype, before any communication.
    static const char* const names[4] = {"nearest", "nearest-exact", "linear", "cubic"};
    const std::string family = std::string("upsample ") + names[static_cast<int>(p.mode)] + " " +
                               std::to_string(p.nd) + "d";
    check_dtype_support(op, args, family.c_str(), {x.scalar_type()}, will_backward(x),
                        [p](c10::ArrayRef<at::ScalarType> t, bool rg) {
                          std::vector<int64_t> shape{1, 1}, size;
                          for (int64_t i = 0; i < p.nd; ++i) {
                            shape.push_back(2);
                            size.push_back(4);
                          }
                          const at::Tensor in = probe_ones(shape, t[0], rg);
                          switch (p.mode) {
                            case Mode::Nearest:
                              return p.nd == 1 ? at::upsample_nearest1d(in, size)
                                               : (p.nd == 2 ? at::upsample_nearest2d(in, size)
                                                            : at::upsample_nearest3d(in, size));
                            case Mode::NearestExact:
                              return p.nd == 1
                                         ? at::_upsample_nearest_exact1d(in, size)
                                         : (p.nd == 2 ? at::_upsample_nearest_exact2d(in, size)
                                                      : at::_upsample_nearest_exact3d(in, size));
                            case Mode::Linear:
                              return p.nd == 1
                                         ? at::upsample_linear1d(in, size, false)
                                         : (p.nd == 2 ? at::upsample_bilinear2d(in, size, false)
                                                      : at::upsample_trilinear3d(in, size, false));
                            case Mode::Cubic:
                              return at::upsample_bicubic2d(in, size, false);
                          }
                          return in;
                        });
  }
  const int64_t ndim = s->ndim();
  if (ndim != p.nd + 2) {
    fail(op, args, "expected a " + std::to_string(p.nd + 2) + "-D input (N, C, spatial...)");
  }
  // Note [integer linear interpolation]: the OpInfo sweep (tests/python/opinfo_sweep.py)
  // found uint8 bilinear/bicubic results that differ from torch's (shape (2,3,4,4),
  // scale 2, align_corners, Shard(2) at 2 ranks: 360 of 384 values, by up to 241). Until
  // the rule reproduces libtorch's integer kernels, linear and cubic modes refuse integer
  // inputs, alike on every rank (the dtype is the same everywhere) and before any
  // communication, instead of answering wrongly.
  if ((p.mode == Mode::Linear || p.mode == Mode::Cubic) && !at::isFloatingType(x.scalar_type()) &&
      !at::isComplexType(x.scalar_type())) {
    fail(op, args,
         std::string("linear and cubic interpolation of integer dtypes (") +
             c10::toString(x.scalar_type()) +
             ") is not supported on a ShardTensor yet (its results differed from torch's); "
             "convert the input to a floating dtype first");
  }
  const auto& shape = s->global_shape();

  // Parse: output_size, align_corners, scales (per-dim floats or a list).
  std::optional<std::vector<int64_t>> out_size;
  bool align_corners = false;
  std::vector<std::optional<double>> scales(p.nd);
  bool is_vec = false;
  std::optional<std::vector<double>> scale_factors;
  int64_t next_scale = 0;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& name = schema.arguments()[i].name();
    if (name == "output_size") {
      out_size = opt_int_list(args[i]);
    } else if (name == "align_corners") {
      align_corners = args[i].toBool();
    } else if (name == "scale_factors") {
      is_vec = true;
      if (!args[i].isNone()) scale_factors = args[i].toDoubleVector();
    } else if (name.rfind("scales", 0) == 0) {
      if (next_scale < p.nd && !args[i].isNone()) scales[next_scale] = args[i].toDouble();
      ++next_scale;
    } else {
      fail(op, args, "unexpected argument '" + name + "'");
    }
  }
  std::vector<int64_t> out_ext(p.nd);
  if (is_vec) {
    // upsample::compute_output_size
    if (out_size.has_value() == scale_factors.has_value()) {
      fail(op, args, "must specify exactly one of output_size and scale_factors");
    }
    if (out_size) {
      if (static_cast<int64_t>(out_size->size()) != p.nd) fail(op, args, "bad output_size length");
      out_ext = *out_size;
    } else {
      if (static_cast<int64_t>(scale_factors->size()) != p.nd) {
        fail(op, args, "bad scale_factors length");
      }
      for (int64_t i = 0; i < p.nd; ++i) {
        out_ext[i] = static_cast<int64_t>(static_cast<double>(shape[i + 2]) * (*scale_factors)[i]);
        scales[i] = (*scale_factors)[i];
      }
    }
  } else {
    if (!out_size || static_cast<int64_t>(out_size->size()) != p.nd) {
      fail(op, args, "output_size must have " + std::to_string(p.nd) + " entries");
    }
    out_ext = *out_size;
  }
  for (int64_t i = 0; i < p.nd; ++i) {
    if (shape[i + 2] <= 0 || out_ext[i] <= 0) {
      fail(op, args, "input and output spatial sizes must be greater than 0");
    }
  }
  // Note [plain fast path]: no spatial dim is sharded over more than one rank.
  if (runs_plain(*s, local_of(x), {0, 1})) return call_plain(op, std::move(args), stack);
  const std::vector<int64_t> spatial = [&] {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < p.nd; ++i) v.push_back(i + 2);
    return v;
  }();

  // Taps per spatial dim, in the precision libtorch uses for this dtype.
  const bool dbl = x.scalar_type() == at::kDouble;
  const bool nearest_idx = p.mode == Mode::Nearest && p.nd == 2;  // Note [nearest special extents]
  std::vector<Taps> taps;
  for (int64_t i = 0; i < p.nd; ++i) {
    const bool ac = p.has_align && align_corners;
    taps.push_back(
        dbl ? compute_taps<double>(p.mode, shape[i + 2], out_ext[i], ac, scales[i], nearest_idx)
            : compute_taps<float>(p.mode, shape[i + 2], out_ext[i], ac, scales[i], nearest_idx));
  }

  // Plans: output-first partition of each sharded spatial dim, and the input
  // range each output block reads.
  SpecPtr in_spec = std::make_shared<const ShardSpec>(without_partial(*s));
  std::vector<stencil::DimPlan> plans;
  for (int64_t i = 0; i < p.nd; ++i) {
    const int64_t d = i + 2;
    const int64_t m = in_spec->mesh_dim_of(d);
    if (m < 0) continue;
    stencil::DimPlan plan;
    plan.dim = d;
    plan.mesh_dim = m;
    plan.in_sizes = in_spec->shard_sizes(m);
    plan.out_sizes = stencil::output_sizes(plan.in_sizes, out_ext[i]);
    int64_t o0 = 0;
    for (int64_t n : plan.out_sizes) {
      if (n == 0) {
        plan.ranges.emplace_back(0, 0);
        continue;
      }
      int64_t lo = shape[d], hi = 0;
      for (int64_t j = 0; j < taps[i].n; ++j) {
        for (int64_t o = o0; o < o0 + n; ++o) {
          lo = std::min(lo, taps[i].idx[j][o]);
          hi = std::max(hi, taps[i].idx[j][o] + 1);
        }
      }
      plan.ranges.emplace_back(lo, hi);
      o0 += n;
    }
    plans.push_back(std::move(plan));
  }

  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  for (int64_t i = 0; i < p.nd; ++i) out_shape[i + 2] = out_ext[i];
  SpecPtr out_spec = stencil::output_spec(*in_spec, out_shape, plans);

  at::Tensor local = to_layout(x, *in_spec, *in_spec);
  // Note [split-phase interpolation].
  {
    const std::vector<int64_t> out_local = out_spec->local_shape();
    int64_t out_numel = 1;
    for (int64_t v : out_local) out_numel *= v;
    // out_numel == 0 here means an empty leading dim, the same on every peer.
    const auto split = split_plan(p, dbl, p.has_align && align_corners, plans, taps, shape, out_ext,
                                  scales, in_spec->mesh());
    if (split && out_numel > 0) {
      at::Tensor y = split_forward(p, local, in_spec->mesh(), *split, out_ext, scales, out_local);
      stack->push_back(wrap(y, out_spec));
      return;
    }
  }
  at::Tensor g = stencil::gather_plans(local, in_spec->mesh(), plans, PadMode::Replicate);

  // Note [native interpolation on pieces]: libtorch's own upsample kernel on
  // the halo-extended piece, where it computes exactly the global taps.
  if (g.numel() > 0) {
    at::Tensor y = native_on_piece(p, g, *in_spec, plans, taps, shape, out_ext, scales,
                                   p.has_align && align_corners);
    if (y.defined()) {
      stack->push_back(wrap(y, out_spec));
      return;
    }
  }

  // This rank's output block and input range along each spatial dim.
  const auto coord = in_spec->mesh().coordinate();
  for (int64_t i = 0; i < p.nd; ++i) {
    const int64_t d = i + 2;
    int64_t o_begin = 0, o_count = out_ext[i], lo = 0;
    for (const auto& plan : plans) {
      if (plan.dim != d) continue;
      const int64_t c = coord[plan.mesh_dim];
      for (int64_t k = 0; k < c; ++k) o_begin += plan.out_sizes[k];
      o_count = plan.out_sizes[c];
      lo = plan.ranges[c].first;
    }
    std::vector<int64_t> view(ndim, 1);
    view[d] = o_count;
    at::Tensor acc;
    for (int64_t j = 0; j < taps[i].n; ++j) {
      std::vector<int64_t> idx(taps[i].idx[j].begin() + o_begin,
                               taps[i].idx[j].begin() + o_begin + o_count);
      for (auto& v : idx) v -= lo;
      at::Tensor it = at::tensor(idx, at::kLong).to(g.device());
      at::Tensor picked = g.index_select(d, it);
      if (taps[i].n == 1) {
        acc = picked;
        break;
      }
      std::vector<double> w(taps[i].w[j].begin() + o_begin,
                            taps[i].w[j].begin() + o_begin + o_count);
      at::Tensor wt = at::tensor(w, at::kDouble).to(g.options()).view(view);
      at::Tensor term = picked * wt;
      acc = acc.defined() ? acc + term : term;
    }
    g = acc;
  }
  stack->push_back(wrap(g.contiguous(), out_spec));
}

Rule interp(Mode m, int64_t nd, bool has_align) {
  return [=](const c10::OperatorHandle& op, Stack* stack) {
    interpolate_rule(op, stack, InterpOp{m, nd, has_align});
  };
}

const RuleRegistrar r_n1({"upsample_nearest1d"}, interp(Mode::Nearest, 1, false));
const RuleRegistrar r_n2({"upsample_nearest2d"}, interp(Mode::Nearest, 2, false));
const RuleRegistrar r_n3({"upsample_nearest3d"}, interp(Mode::Nearest, 3, false));
const RuleRegistrar r_e1({"_upsample_nearest_exact1d"}, interp(Mode::NearestExact, 1, false));
const RuleRegistrar r_e2({"_upsample_nearest_exact2d"}, interp(Mode::NearestExact, 2, false));
const RuleRegistrar r_e3({"_upsample_nearest_exact3d"}, interp(Mode::NearestExact, 3, false));
const RuleRegistrar r_l1({"upsample_linear1d"}, interp(Mode::Linear, 1, true));
const RuleRegistrar r_l2({"upsample_bilinear2d"}, interp(Mode::Linear, 2, true));
const RuleRegistrar r_l3({"upsample_trilinear3d"}, interp(Mode::Linear, 3, true));
const RuleRegistrar r_c2({"upsample_bicubic2d"}, interp(Mode::Cubic, 2, true));

}  // namespace
}  // namespace shardtensor::ops
