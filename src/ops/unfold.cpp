// Sharding rules for sliding-window extraction and its adjoint: Tensor.unfold
// (aten::unfold), im2col (F::unfold) and col2im (F::fold). Built on the halo
// arithmetic of ops/stencil.h (Note [output-first halos]).
//
// Note [unfold windows]: Tensor.unfold(dim, size, step) along a sharded dim
// gives window w (start w * step) to the coordinate that owns its start
// element; windows that start past the last element (only possible for
// size 0) go to the last coordinate. The output's window dim is therefore
// sharded by the same mesh dim, with sizes computed arithmetically (uneven,
// possibly empty). Each coordinate then needs the input range
// [w0 * step, (w1 - 1) * step + size) of its windows [w0, w1): its own rows
// minus the ones before its first window start, plus a right halo of at most
// size - 1 rows (more hops when a neighbour is thinner), fetched exactly with
// comm::gather_range. libtorch's unfold on that extended piece is exactly the
// block of windows; backward is libtorch's unfold_backward followed by the halo
// accumulate (the adjoint of gather_range). The result is a copy, not a view
// of the source: an in-place op on it raises (Note [view write-back]), and it
// follows the source (Note [stale copy views]): after a write into the source,
// its next use makes the windows anew by the same exchange. Along an
// unsharded dim unfold is a true view of the local piece.
//
// Note [im2col layout]: im2col ([N,] C, H, W) -> ([N,] C*kh*kw, L) with
// L = oh * ow in row-major order. Sharded H and W are stencil dims: the
// output blocks are partitioned first (stencil::window_plans: the input's
// sizes when the extent is unchanged, else balanced), every rank gathers
// exactly the input rows/cols its output block reads (zero padding only at
// the global edge), and runs libtorch's im2col with padding 0 on those dims.
//  * H sharded (mesh dim m), W not: the local columns are whole rows of
//    output blocks, i.e. a contiguous run of L, so the output is Shard(L) on
//    m with sizes oh_c * ow. No other communication than the halo.
//  * W sharded (mesh dim m'): a local block [oh_c, ow_c'] is not contiguous
//    in L. One all-to-all over m' moves the ow split elsewhere: onto the oh
//    dim (balanced over oh) when H is not sharded, so the output is again
//    Shard(L) on m' with sizes oh_c' * ow; otherwise (H sharded by another
//    mesh dim, the 2x2 case) onto the C*kh*kw dim, split in whole channels
//    (balanced over C, times kh*kw): the output is Shard(L) on m and
//    Shard(1) on m'. No rank ever holds more than its share.
//  * N and C sharded: local (C sizes scale by kh*kw).
//
// Note [col2im accumulate]: col2im (F::fold) is im2col's adjoint. The input
// ([N,] C*kh*kw, L) is first brought, if needed, to pieces of whole output
// block rows along L (sizes multiples of ow; comm::repartition to balanced
// rows otherwise) and whole channels along C*kh*kw (multiples of kh*kw).
// Each rank runs libtorch's col2im for its block rows [o0, o1) onto the image
// rows [o0*s - p, (o1-1)*s - p + d*(k-1) + 1) (padding 0 along H), and
// comm::accumulate_range sums the overlapping rows into their owners: the
// image's H is split balanced over the mesh dim that sharded L, rows in the
// padding are dropped. Backward: gather_range of the gradient (a halo
// exchange) then libtorch's im2col.
#include <ATen/ATen.h>

#include <string>

#include "comm/accumulate.h"
#include "comm/agree.h"
#include "ops/common.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

// Number of mesh dims that shard tensor dim `d`.
int64_t shard_count(const ShardSpec& s, int64_t d) {
  int64_t n = 0;
  for (const auto& pl : s.placements()) n += shard_dim(pl) == d ? 1 : 0;
  return n;
}

// ---------------------------------------------------------------- Tensor.unfold

// Note [unfold windows]: the windows each coordinate owns.
std::vector<int64_t> unfold_out_sizes(const std::vector<int64_t>& in_sizes, int64_t nwin,
                                      int64_t step) {
  const auto off = offsets_of(in_sizes);
  const int64_t p = static_cast<int64_t>(in_sizes.size());
  // Windows with start < x.
  auto before = [&](int64_t x) { return std::clamp<int64_t>(div_ceil(x, step), 0, nwin); };
  std::vector<int64_t> out(p);
  for (int64_t c = 0; c < p; ++c) {
    const int64_t hi = c + 1 < p ? before(off[c] + in_sizes[c]) : nwin;
    out[c] = hi - before(off[c]);
  }
  return out;
}

// This coordinate's windows (Note [unfold windows]) of `self` along `dim`,
// sharded by one mesh dim, with `s` its layout without Partial and `spec` the
// result's: its piece (summed first where Partial) and the halo, unfolded.
// Collective over that mesh dim (and the Partial ones).
at::Tensor unfold_windows(const at::Tensor& self, const ShardSpec& s, int64_t dim, int64_t size,
                          int64_t step, const std::vector<int64_t>& out_sizes,
                          const ShardSpec& spec) {
  const int64_t m = s.mesh_dim_of(dim);
  at::Tensor x = spec_of(self)->has_partial() ? to_layout(self, s, s) : local_of(self);
  const auto ranges = stencil::window_ranges(out_sizes, size, step, 1, 0);
  at::Tensor ext = comm::gather_range(x, s.mesh(), m, dim, s.shard_sizes(m), ranges);
  if (out_sizes[s.mesh().coordinate()[m]] == 0 || ext.numel() == 0) {
    // No window here (or an empty piece): an empty result that stays
    // connected to the exchange, so backward runs its adjoint here too.
    return ext.reshape(spec.local_shape());
  }
  return ext.unfold(dim, size, step);
}

void unfold_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = args[0].toTensor();
  const ShardSpec* sp = spec_of(self);
  if (!sp) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  int64_t dim = int_arg(args[1]);
  const int64_t size = int_arg(args[2]), step = int_arg(args[3]);
  // Validate on metadata (every rank agrees) with libtorch's own checks.
  std::vector<int64_t> out_shape;
  try {
    out_shape = at::empty(s.global_shape(), self.options().device(at::kMeta))
                    .unfold(dim, size, step)
                    .sizes()
                    .vec();
  } catch (const c10::Error& e) {
    fail(op, args, e.what_without_backtrace());
  }
  dim = at::maybe_wrap_dim(dim, std::max<int64_t>(s.ndim(), 1));
  const bool copy = op.operator_name().name == "aten::unfold_copy";
  const int64_t m = s.ndim() > 0 ? s.mesh_dim_of(dim) : -1;
  if (m < 0) {
    // Unsharded dim: a view of the local piece (windows never cross pieces).
    at::Tensor x = sp->has_partial() ? to_layout(self, s, s) : local_of(self);
    at::Tensor out = x.unfold(dim, size, step);
    if (copy) out = out.clone(at::MemoryFormat::Contiguous);
    stack->push_back(
        wrap(out, make_spec(s.mesh(), s.placements(), out_shape, s.all_shard_sizes())));
    return;
  }
  if (shard_count(s, dim) > 1) fail(op, args, "the dim is sharded by several mesh dims");
  const int64_t nwin = out_shape[dim];
  const auto out_sizes = unfold_out_sizes(s.shard_sizes(m), nwin, step);
  ShardSizes sizes = s.all_shard_sizes();
  sizes[m] = out_sizes;
  SpecPtr spec = make_spec(s.mesh(), s.placements(), out_shape, sizes);
  at::Tensor result = wrap(unfold_windows(self, s, dim, size, step, out_sizes, *spec), spec);
  if (!copy) {
    // The windows follow `self` (Note [stale copy views]): made anew by the
    // same exchange after a write into it.
    const std::string what = "unfold(" + std::to_string(dim) + ", " + std::to_string(size) + ", " +
                             std::to_string(step) + ") of " + sp->to_string() +
                             " (windows copied from several pieces, laid out as " +
                             spec->to_string() + ")";
    refuse_in_place_following(
        {result},
        "unfold along a sharded dim returns windows copied from several pieces, not a view: "
        "in-place ops on it would be lost",
        self, what, [self, s, dim, size, step, out_sizes, spec] {
          return std::vector<at::Tensor>{
              unfold_windows(self, s, dim, size, step, out_sizes, *spec)};
        });
  }
  stack->push_back(result);
}

// ---------------------------------------------------------------- im2col / col2im

struct Window2d {
  std::vector<int64_t> kernel, dilation, padding, stride;
};

// Parses and validates the four int[2] arguments starting at args[first];
// fails (naming the op) like libtorch would.
Window2d window_args(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     size_t first) {
  Window2d w{int_list(args[first]), int_list(args[first + 1]), int_list(args[first + 2]),
             int_list(args[first + 3])};
  const char* names[4] = {"kernel_size", "dilation", "padding", "stride"};
  const std::vector<int64_t>* v[4] = {&w.kernel, &w.dilation, &w.padding, &w.stride};
  for (int i = 0; i < 4; ++i) {
    if (v[i]->size() != 2) fail(op, args, std::string(names[i]) + " must have 2 elements");
    for (int64_t e : *v[i]) {
      if (i == 2 ? e < 0 : e <= 0) {
        fail(op, args,
             std::string(names[i]) + " must be " + (i == 2 ? "non-negative" : "positive") +
                 ", got " + shape_str(*v[i]));
      }
    }
  }
  return w;
}

// Number of sliding blocks along one dim (libtorch's formula).
int64_t blocks(int64_t n, int64_t k, int64_t d, int64_t p, int64_t s) {
  return div_floor(n + 2 * p - d * (k - 1) - 1, s) + 1;
}

void im2col_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = args[0].toTensor();
  const ShardSpec* sp = spec_of(self);
  if (!sp) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  const int64_t nd = s.ndim();
  if (nd != 3 && nd != 4) fail(op, args, "expected a 3-d or 4-d input ([N,] C, H, W)");
  const Window2d w = window_args(op, args, 1);
  const auto& g = s.global_shape();
  const int64_t b = nd - 3, cdim = b, hdim = b + 1, wdim = b + 2;
  for (int64_t d = 0; d < nd; ++d) {
    if (d != 0 && g[d] == 0) fail(op, args, "expected non-empty C, H and W");
    if (shard_count(s, d) > 1) fail(op, args, "a dim sharded by several mesh dims");
  }
  const int64_t oh = blocks(g[hdim], w.kernel[0], w.dilation[0], w.padding[0], w.stride[0]);
  const int64_t ow = blocks(g[wdim], w.kernel[1], w.dilation[1], w.padding[1], w.stride[1]);
  if (oh < 1 || ow < 1) {
    fail(op, args,
         "the kernel " + shape_str(w.kernel) + " with dilation " + shape_str(w.dilation) +
             " and padding " + shape_str(w.padding) + " does not fit the input's spatial size [" +
             std::to_string(g[hdim]) + ", " + std::to_string(g[wdim]) + "]");
  }
  const int64_t kk = w.kernel[0] * w.kernel[1];
  const DeviceMesh& mesh = s.mesh();
  const int64_t mh = s.mesh_dim_of(hdim), mw = s.mesh_dim_of(wdim), mc = s.mesh_dim_of(cdim);
  if (mw >= 0 && mh >= 0 && mc >= 0) {
    fail(op, args,
         "C, H and W all sharded: the W split has no free dim to move to; redistribute C or W "
         "first");
  }
  const auto plans =
      stencil::window_plans(s, {hdim, wdim}, w.kernel, w.stride, w.dilation, w.padding, {oh, ow});
  at::Tensor x = sp->has_partial() ? to_layout(self, s, s) : local_of(self);
  at::Tensor ext = stencil::gather_plans(x, mesh, plans, PadMode::Constant, 0.0);
  std::vector<int64_t> pad = w.padding;
  for (const auto& p : plans) pad[p.dim - hdim] = 0;

  // Local output block as [.., C_loc*kk, oh_loc, ow_loc].
  const auto lshape = x.sizes().vec();
  auto out_rows = [&](const stencil::DimPlan* p, int64_t full) {
    return p ? p->out_sizes[mesh.coordinate()[p->mesh_dim]] : full;
  };
  const stencil::DimPlan *ph = nullptr, *pw = nullptr;
  for (const auto& p : plans) (p.dim == hdim ? ph : pw) = &p;
  const int64_t oh_loc = out_rows(ph, oh), ow_loc = out_rows(pw, ow);
  std::vector<int64_t> block(lshape.begin(), lshape.begin() + b);
  block.push_back(lshape[cdim] * kk);
  block.push_back(oh_loc);
  block.push_back(ow_loc);
  at::Tensor cols;
  if (ext.numel() == 0 || oh_loc == 0 || ow_loc == 0) {
    cols = ext.reshape(block);  // empty, connected to the exchange
  } else {
    cols = at::im2col(ext, w.kernel, w.dilation, pad, w.stride).view(block);
  }

  // The output layout over the 4-d (3-d) block view [.., CK, OH, OW].
  Placements pl = s.placements();
  ShardSizes sizes = s.all_shard_sizes();
  std::vector<int64_t> bshape(g.begin(), g.begin() + b);
  bshape.push_back(g[cdim] * kk);
  bshape.push_back(oh);
  bshape.push_back(ow);
  if (mc >= 0) {
    for (auto& n : sizes[mc]) n *= kk;
  }
  if (ph) sizes[mh] = ph->out_sizes;
  if (pw) {
    // Note [im2col layout]: move the ow split onto oh (or onto C*kk).
    const int64_t to = mh < 0 ? hdim : cdim;
    const int64_t parts = mesh.size(mw);
    std::vector<int64_t> dst =
        to == hdim ? balanced_sizes(oh, parts) : balanced_sizes(g[cdim], parts);
    if (to == cdim) {
      for (auto& n : dst) n *= kk;
    }
    cols = comm::all_to_all(cols, mesh, mw, wdim, pw->out_sizes, to, dst);
    pl[mw] = Shard{to};
    sizes[mw] = dst;
  }
  // Merge (OH, OW) into L: every dim that shards OH holds whole rows.
  std::vector<int64_t> out_shape(bshape.begin(), bshape.begin() + b + 1);
  out_shape.push_back(oh * ow);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (shard_dim(pl[m]) == hdim) {
      for (auto& n : sizes[m]) n *= ow;
    }
  }
  SpecPtr spec = make_spec(mesh, pl, out_shape, sizes);
  stack->push_back(wrap(cols.reshape(spec->local_shape()), spec));
}

void col2im_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = args[0].toTensor();
  const ShardSpec* sp = spec_of(self);
  if (!sp) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  const int64_t nd = s.ndim();
  if (nd != 2 && nd != 3) fail(op, args, "expected a 2-d or 3-d input ([N,] C*kh*kw, L)");
  const auto osize = int_list(args[1]);
  if (osize.size() != 2 || osize[0] <= 0 || osize[1] <= 0) {
    fail(op, args, "output_size must have 2 positive elements");
  }
  const Window2d w = window_args(op, args, 2);
  const auto& g = s.global_shape();
  const int64_t b = nd - 2, ckdim = b, ldim = b + 1;
  const int64_t kk = w.kernel[0] * w.kernel[1];
  const int64_t oh = blocks(osize[0], w.kernel[0], w.dilation[0], w.padding[0], w.stride[0]);
  const int64_t ow = blocks(osize[1], w.kernel[1], w.dilation[1], w.padding[1], w.stride[1]);
  if (g[ckdim] == 0 || g[ckdim] % kk != 0) {
    fail(op, args,
         "the input's dim " + std::to_string(ckdim) + " (" + std::to_string(g[ckdim]) +
             ") must be a positive multiple of kernel_size's product " + std::to_string(kk));
  }
  if (oh < 1 || ow < 1 || g[ldim] != oh * ow) {
    fail(op, args,
         "the input's dim " + std::to_string(ldim) + " (" + std::to_string(g[ldim]) +
             ") must be the number of sliding blocks " + std::to_string(oh) + " * " +
             std::to_string(ow) + " for output_size " + shape_str(osize));
  }
  const DeviceMesh& mesh = s.mesh();
  const int64_t C = g[ckdim] / kk;
  // Note [col2im accumulate]: whole channels and whole block rows per piece.
  ShardSizes mid = s.all_shard_sizes();
  const int64_t mc = s.mesh_dim_of(ckdim), ml = s.mesh_dim_of(ldim);
  auto align = [&](int64_t m, int64_t unit, int64_t units) {
    if (m < 0) return;
    const auto& sz = mid[m];
    if (std::all_of(sz.begin(), sz.end(), [&](int64_t n) { return n % unit == 0; })) return;
    mid[m] = balanced_sizes(units, mesh.size(m));
    for (auto& n : mid[m]) n *= unit;
  };
  align(mc, kk, C);
  align(ml, ow, oh);
  at::Tensor x = sp->has_partial() ? to_layout(self, s, s) : local_of(self);
  SpecPtr mid_spec = make_spec(mesh, s.placements(), g, mid);
  if (*mid_spec != s) x = detail::redistribute_local(x, s, *mid_spec);

  std::vector<int64_t> out_shape(g.begin(), g.begin() + b);
  out_shape.push_back(C);
  out_shape.push_back(osize[0]);
  out_shape.push_back(osize[1]);
  const int64_t hdim = b + 1;
  ShardSizes sizes = mid;
  if (mc >= 0) {
    for (auto& n : sizes[mc]) n /= kk;
  }
  std::vector<int64_t> pad = w.padding;
  std::vector<int64_t> img{osize[0], osize[1]};
  std::vector<int64_t> hsizes;
  std::vector<stencil::Range> ranges;
  if (ml >= 0) {
    std::vector<int64_t> rows = mid[ml];
    for (auto& n : rows) n /= ow;
    ranges = stencil::window_ranges(rows, w.kernel[0], w.stride[0], w.dilation[0], w.padding[0]);
    hsizes = balanced_sizes(osize[0], mesh.size(ml));
    const auto r = ranges[mesh.coordinate()[ml]];
    img[0] = r.second - r.first;
    pad[0] = 0;
    sizes[ml] = hsizes;
  }
  std::vector<int64_t> yshape(x.sizes().begin(), x.sizes().begin() + b);
  yshape.push_back(x.size(ckdim) / kk);
  yshape.push_back(img[0]);
  yshape.push_back(img[1]);
  at::Tensor y;
  if (x.numel() == 0) {
    // No blocks here (or no channels): the image range is empty too.
    const int64_t numel = c10::multiply_integers(yshape);
    // An empty sum is 0: the zeros stay connected to x (backward must run here too).
    y = numel == 0 ? x.reshape(yshape) : at::zeros(yshape, x.options()) + x.sum();
  } else {
    y = at::col2im(x, img, w.kernel, w.dilation, pad, w.stride);
  }
  if (ml >= 0) y = comm::accumulate_range(y, mesh, ml, hdim, hsizes, ranges);
  Placements pl = s.placements();
  if (ml >= 0) pl[ml] = Shard{hdim};
  stack->push_back(wrap(y, make_spec(mesh, pl, out_shape, sizes)));
}

// ---------------------------------------------------------------- grid_sample

// Note [grid_sample reach]: grid_sampler (2-D, bilinear or nearest, any
// padding mode, either align_corners) with the input sharded along H and/or
// W. The output [N, C, Ho, Wo] is sharded like the grid: along Ho (Wo) by the
// mesh dim that shards the input's H (W), with the grid's sizes when the grid
// is sharded there, else balanced (a replicated grid is sliced locally). Each
// rank maps its grid piece to global input pixel coordinates with libtorch's
// formulas, applying the padding mode (border clip, reflection) at the GLOBAL
// border, and takes the rows (cols) its samples touch: floor(y) and
// floor(y) + 1 for bilinear, round(y) for nearest, clipped to [0, H). The
// ranges are agreed with one small all-gather of 6 integers per rank (the
// union over the ranks that share a coordinate of the mesh dim, so that the
// exchange along H and then W sees equal extents); comm::gather_range then
// fetches exactly those rows (multi-hop if needed). libtorch's grid_sampler
// runs on the extended piece with the coordinates shifted to local pixels and
// renormalized for align_corners=false and zeros padding (the global padding
// was applied already; what falls outside the global domain reads zeros as in
// zeros mode). Gradients: libtorch's backward for the input piece, then the
// halo accumulate; the grid's through the coordinate map.
// "Halo-bounded" means every rank's range lies within its piece extended by
// the largest piece of that mesh dim on each side (nearest-neighbour reach);
// a grid that reaches further still moves only the rows it samples, but the
// rows beyond the piece are counted as gathered_bytes with the once-per-op
// warning, and strict mode refuses it (Note [visible gathers]). Bicubic
// (whose padding applies per tap), 3-D sampling and a batch-sharded input are
// declined (Note [partial rules]: the exact generic fallback).

at::Tensor unnormalize(const at::Tensor& g, int64_t n, bool align) {
  return align ? (g + 1) / 2 * (n - 1) : ((g + 1) * n - 1) / 2;
}

at::Tensor reflect(const at::Tensor& c, int64_t twice_low, int64_t twice_high) {
  if (twice_low == twice_high) return at::zeros_like(c);
  const double lo = twice_low / 2.0, span = (twice_high - twice_low) / 2.0;
  at::Tensor a = (c - lo).abs();
  at::Tensor extra = at::fmod(a, span);
  at::Tensor flips = at::floor(a / span);
  return at::where(at::fmod(flips, 2) == 0, extra + lo, span - extra + lo);
}

// libtorch's grid_sampler_compute_source_index: global pixel coordinates.
at::Tensor source_index(const at::Tensor& g, int64_t n, int64_t padding, bool align) {
  at::Tensor c = unnormalize(g, n, align);
  if (padding == 1) {
    c = c.clamp(0, n - 1);
  } else if (padding == 2) {
    c = align ? reflect(c, 0, 2 * (n - 1)) : reflect(c, -1, 2 * n - 1);
    c = c.clamp(0, n - 1);
  }
  return c;
}

bool takes_grid_sampler(const c10::OperatorHandle& op, const Stack& stack) {
  const size_t na = op.schema().arguments().size();
  if (na < 5 || stack.size() < na) return false;
  const c10::IValue& in = stack[stack.size() - na];
  const c10::IValue& mode = stack[stack.size() - na + 2];
  if (!in.isTensor() || !mode.isInt()) return false;
  const ShardSpec* s = spec_of(in.toTensor());
  if (!s || s->ndim() != 4 || mode.toInt() > 1) return false;
  return s->mesh_dim_of(0) < 0;
}

void grid_sampler_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& input = args[0].toTensor();
  const at::Tensor& grid = args[1].toTensor();
  const int64_t interp = args[2].toInt(), padding = args[3].toInt();
  const bool align = args[4].toBool();
  const ShardSpec* sp = spec_of(input);
  if (!sp) fail(op, args, "the input must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  const auto& g = s.global_shape();
  const std::vector<int64_t> gshape = grid.sizes().vec();
  if (gshape.size() != 4 || gshape[3] != 2 || gshape[0] != g[0]) {
    fail(op, args, "expected a grid of shape [N, Ho, Wo, 2] with N = " + std::to_string(g[0]));
  }
  if (grid.scalar_type() != input.scalar_type()) {
    fail(op, args, "the input and the grid must have the same dtype");
  }
  if (padding < 0 || padding > 2) fail(op, args, "unknown padding mode");
  for (int64_t d = 0; d < 4; ++d) {
    if (shard_count(s, d) > 1) fail(op, args, "a dim sharded by several mesh dims");
  }
  const DeviceMesh& mesh = s.mesh();
  const int64_t nm = mesh.ndim();
  const ShardSpec* gs = spec_of(grid);
  if (gs && !(gs->mesh() == mesh)) fail(op, args, "the input and the grid are on different meshes");
  // The output layout (Note [grid_sample reach]) and the grid's.
  const std::vector<int64_t> out_shape{g[0], g[1], gshape[1], gshape[2]};
  Placements out_p(nm, Replicate{}), grid_p(nm, Replicate{});
  ShardSizes out_sizes(nm), grid_sizes(nm);
  for (int64_t m = 0; m < nm; ++m) {
    const int64_t d = shard_dim(s.placements()[m]);
    const int64_t gd = gs ? shard_dim(gs->placements()[m]) : -1;
    auto follow = [&](int64_t grid_dim) {  // the output dim follows grid dim grid_dim
      const int64_t od = grid_dim == 0 ? 0 : grid_dim + 1;
      out_p[m] = Shard{od};
      grid_p[m] = Shard{grid_dim};
      out_sizes[m] =
          gd == grid_dim ? gs->shard_sizes(m) : balanced_sizes(gshape[grid_dim], mesh.size(m));
      grid_sizes[m] = out_sizes[m];
    };
    if (d == 1) {
      out_p[m] = Shard{1};
      out_sizes[m] = s.shard_sizes(m);
    } else if (d == 2) {
      follow(1);
    } else if (d == 3) {
      follow(2);
    } else if (d < 0 && gd >= 0 && gd <= 2) {
      follow(gd);
    }
  }
  SpecPtr out_spec = make_spec(mesh, out_p, out_shape, out_sizes);
  SpecPtr grid_spec = make_spec(mesh, grid_p, gshape, grid_sizes);
  at::Tensor gl = to_layout(grid, *grid_spec, *out_spec);
  at::Tensor x = sp->has_partial() ? to_layout(input, s, s) : local_of(input);
  const int64_t mh = s.mesh_dim_of(2), mw = s.mesh_dim_of(3);
  if (mh < 0 && mw < 0) {
    // No sharded spatial dim: the op itself on the pieces.
    at::Tensor out;
    if (x.numel() == 0 || gl.numel() == 0) {
      out = at::zeros(out_spec->local_shape(), x.options()) + (x.sum() + gl.sum()) * 0;
    } else {
      out = at::grid_sampler(x, gl, interp, padding, align);
    }
    stack->push_back(wrap(out, out_spec));
    return;
  }
  // Global pixel coordinates of this rank's samples (x: W, y: H).
  const at::ScalarType acc = at::kDouble;
  at::Tensor gx = gl.select(3, 0).to(acc), gy = gl.select(3, 1).to(acc);
  at::Tensor px = source_index(gx, g[3], padding, align);
  at::Tensor py = source_index(gy, g[2], padding, align);
  // The rows/cols the samples touch, clipped to the domain (metadata for the plan).
  auto reach = [&](const at::Tensor& c, int64_t n) -> std::pair<int64_t, int64_t> {
    at::Tensor t = c.detach();
    t = t.masked_select(at::isfinite(t));
    at::Tensor lo_i = interp == 1 ? at::round(t) : at::floor(t);
    at::Tensor hi_i = interp == 1 ? lo_i : lo_i + 1;
    at::Tensor valid_lo = lo_i.clamp(0, n - 1), valid_hi = hi_i.clamp(0, n - 1);
    at::Tensor touched = (hi_i >= 0) & (lo_i <= n - 1);
    if (!touched.any().item<bool>()) return {0, 0};
    valid_lo = valid_lo.masked_select(touched);
    valid_hi = valid_hi.masked_select(touched);
    return {static_cast<int64_t>(valid_lo.min().item<double>()),
            static_cast<int64_t>(valid_hi.max().item<double>()) + 1};
  };
  const auto coord = mesh.coordinate();
  auto [ylo, yhi] = reach(py, g[2]);
  auto [xlo, xhi] = reach(px, g[3]);
  std::vector<int64_t> rec{mh >= 0 ? coord[mh] : 0, mw >= 0 ? coord[mw] : 0, ylo, yhi, xlo, xhi};
  const auto recs = comm::all_gather_records(mesh, rec);
  // Per coordinate of the mesh dim: the union of the ranges of its ranks.
  auto ranges_of = [&](int64_t m, size_t k, size_t lo_at) {
    std::vector<stencil::Range> r(mesh.size(m), {0, 0});
    std::vector<bool> seen(mesh.size(m), false);
    for (const auto& q : recs) {
      const int64_t c = q[k], lo = q[lo_at], hi = q[lo_at + 1];
      if (lo == hi) continue;
      if (!seen[c]) {
        r[c] = {lo, hi};
        seen[c] = true;
      } else {
        r[c] = {std::min(r[c].first, lo), std::max(r[c].second, hi)};
      }
    }
    return r;
  };
  std::vector<stencil::DimPlan> plans;
  int64_t beyond_bytes = 0;  // this rank's elements from beyond its piece, in bytes
  bool far = false;
  std::vector<int64_t> lo_of{0, 0};
  std::vector<int64_t> ext_shape = x.sizes().vec();
  for (int i = 0; i < 2; ++i) {
    const int64_t m = i == 0 ? mh : mw;
    if (m < 0) continue;
    stencil::DimPlan p;
    p.dim = 2 + i;
    p.mesh_dim = m;
    p.in_sizes = s.shard_sizes(m);
    p.ranges = ranges_of(m, i, 2 + 2 * i);
    const auto off = offsets_of(p.in_sizes);
    const int64_t halo = *std::max_element(p.in_sizes.begin(), p.in_sizes.end());
    for (size_t c = 0; c < p.ranges.size(); ++c) {
      const auto [lo, hi] = p.ranges[c];
      if (lo == hi) continue;
      if (lo < off[c] - halo || hi > off[c] + p.in_sizes[c] + halo) far = true;
    }
    const int64_t me = coord[m];
    const auto [lo, hi] = p.ranges[me];
    const int64_t own =
        std::max<int64_t>(0, std::min(hi, off[me] + p.in_sizes[me]) - std::max(lo, off[me]));
    ext_shape[p.dim] = hi - lo;
    beyond_bytes += ((hi - lo) - own) * c10::multiply_integers(ext_shape) /
                    std::max<int64_t>(hi - lo, 1) * x.element_size();
    lo_of[i] = lo;
    plans.push_back(std::move(p));
  }
  if (far) {
    note_gather(op, args, mesh, beyond_bytes,
                "grid_sample's grid reaches beyond the neighbouring pieces, so the input rows it "
                "samples are fetched from distant ranks");
  }
  at::Tensor ext = stencil::gather_plans(x, mesh, plans, PadMode::Constant, 0.0);
  const int64_t eh = ext.size(2), ew = ext.size(3);
  at::Tensor out;
  if (ext.numel() == 0 || gl.numel() == 0) {
    out = at::zeros(out_spec->local_shape(), x.options()) + (ext.sum() + gl.sum()) * 0;
  } else {
    // Local pixels, renormalized for align_corners=false over the extended piece.
    at::Tensor ly = (py - lo_of[0]), lx = (px - lo_of[1]);
    at::Tensor ng = at::stack({(2 * lx + 1) / ew - 1, (2 * ly + 1) / eh - 1}, 3);
    out = at::grid_sampler(ext, ng.to(gl.scalar_type()), interp, /*zeros=*/0, false);
  }
  stack->push_back(wrap(out, out_spec));
}

// ---------------------------------------------------------------- diag_embed / diag

// Note [diag_embed rows]: diag_embed(x, offset, dim1, dim2) puts x[..., e] at
// (row e + max(-offset, 0), col e + max(offset, 0)) of an N x N matrix,
// N = n + |offset|. With the last dim of x sharded by mesh dim m, the output's
// row dim (dim1) is sharded by m: coordinate c holds the rows of its own
// elements, the first coordinate also the |offset| leading zero rows of a
// negative offset and the last the trailing zero rows of a positive one. Each
// block is libtorch's diag_embed of the piece, padded with zero columns to the
// global width: no communication at all, forward or backward. Leading dims
// are untouched. diag(x, k) of a 1-D x is diag_embed(x, k, 0, 1); diag of a
// 2-D x is left to the fallback (Note [partial rules]).
void diag_embed_impl(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     const at::Tensor& self, int64_t offset, int64_t dim1, int64_t dim2,
                     Stack* stack) {
  const ShardSpec* sp = spec_of(self);
  if (!sp) fail(op, args, "the input must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  const int64_t nd = s.ndim();
  if (nd < 1) fail(op, args, "expected an input with at least 1 dim");
  const int64_t ond = nd + 1;
  if (dim1 < -ond || dim1 >= ond || dim2 < -ond || dim2 >= ond) {
    fail(op, args, "dim1 or dim2 is out of range for a " + std::to_string(ond) + "-d result");
  }
  dim1 = at::maybe_wrap_dim(dim1, ond);
  dim2 = at::maybe_wrap_dim(dim2, ond);
  if (dim1 == dim2) fail(op, args, "diagonal dimensions cannot be identical");
  const int64_t last = nd - 1, n = s.global_shape()[last];
  const int64_t N = n + std::abs(offset);
  const DeviceMesh& mesh = s.mesh();
  // Output dims: the leading input dims in order, skipping dim1 and dim2.
  std::vector<int64_t> where(nd - 1);
  for (int64_t d = 0, o = 0; d < nd - 1; ++d, ++o) {
    while (o == dim1 || o == dim2) ++o;
    where[d] = o;
  }
  std::vector<int64_t> out_shape(ond);
  for (int64_t d = 0; d < nd - 1; ++d) out_shape[where[d]] = s.global_shape()[d];
  out_shape[dim1] = N;
  out_shape[dim2] = N;
  Placements pl = s.placements();
  ShardSizes sizes = s.all_shard_sizes();
  at::Tensor x = sp->has_partial() ? to_layout(self, s, s) : local_of(self);
  const int64_t m = s.mesh_dim_of(last);
  int64_t col0 = std::max<int64_t>(offset, 0), lead = 0, trail = 0;
  for (int64_t k = 0; k < mesh.ndim(); ++k) {
    const int64_t d = shard_dim(pl[k]);
    if (d < 0) continue;
    if (d == last) {
      if (shard_count(s, d) > 1) fail(op, args, "the last dim is sharded by several mesh dims");
      pl[k] = Shard{dim1};
      auto rows = s.shard_sizes(k);
      if (offset < 0) rows.front() += -offset;
      if (offset > 0) rows.back() += offset;
      sizes[k] = rows;
    } else {
      pl[k] = Shard{where[d]};
    }
  }
  if (m >= 0) {
    const int64_t c = mesh.coordinate()[m], p = mesh.size(m);
    const int64_t off = offsets_of(s.shard_sizes(m))[c];
    col0 += off;
    if (offset < 0 && c == 0) lead = -offset;
    if (offset > 0 && c == p - 1) trail = offset;
  }
  // [..., rows, N] with the diagonal block, then the two dims moved in place.
  const int64_t sz = x.size(-1);
  at::Tensor block = at::diag_embed(x, 0, -2, -1);
  if (m < 0) {
    lead = std::max<int64_t>(-offset, 0);
    trail = std::max<int64_t>(offset, 0);
  }
  const std::vector<int64_t> pad{col0, N - col0 - sz, lead, trail};
  at::Tensor out = constant_pad_piece(block, pad, 0);
  out = out.movedim({-2, -1}, {dim1, dim2});
  stack->push_back(wrap(out, make_spec(mesh, pl, out_shape, sizes)));
}

void diag_embed_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  diag_embed_impl(op, args, args[0].toTensor(), int_arg(args[1]), int_arg(args[2]),
                  int_arg(args[3]), stack);
}

bool takes_diag(const c10::OperatorHandle& op, const Stack& stack) {
  const size_t na = op.schema().arguments().size();
  if (stack.size() < na) return false;
  const c10::IValue& in = stack[stack.size() - na];
  const ShardSpec* s = in.isTensor() ? spec_of(in.toTensor()) : nullptr;
  return s && s->ndim() == 1;
}

void diag_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  diag_embed_impl(op, args, args[0].toTensor(), int_arg(args[1]), 0, 1, stack);
}

// Note [wrapper strides]: the windows' wrapper has libtorch's strides.
const RuleRegistrar unfold_ops({"unfold", "unfold_copy."}, with_torch_strides(unfold_rule));
const RuleRegistrar im2col_ops({"im2col."}, im2col_rule);
const RuleRegistrar col2im_ops({"col2im."}, col2im_rule);
const RuleRegistrar diag_embed_ops({"diag_embed."}, diag_embed_rule);
const RuleRegistrar diag_ops({"diag."}, diag_rule, takes_diag);
const RuleRegistrar grid_sampler_ops({"grid_sampler.", "grid_sampler_2d."}, grid_sampler_rule,
                                     takes_grid_sampler);

}  // namespace
}  // namespace shardtensor::ops
