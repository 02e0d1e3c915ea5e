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
// of the source: an in-place op on it raises (Note [view write-back]). Along
// an unsharded dim unfold is a true view of the local piece.
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
#include "ops/common.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

std::string str(c10::IntArrayRef v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Marks a rule's result that is not a view of its source, for a view op.
void refuse_inplace(const at::Tensor& result, const std::string& why) {
  auto* impl = detail::shard_impl(result);
  if (!impl) return;
  auto wb = std::make_shared<detail::WriteBack>();
  wb->refusal = why;
  impl->set_write_back(std::move(wb));
}

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
  at::Tensor x = sp->has_partial() ? to_layout(self, s, s) : local_of(self);
  const int64_t m = s.ndim() > 0 ? s.mesh_dim_of(dim) : -1;
  if (m < 0) {
    // Unsharded dim: a view of the local piece (windows never cross pieces).
    at::Tensor out = x.unfold(dim, size, step);
    if (copy) out = out.clone(at::MemoryFormat::Contiguous);
    stack->push_back(
        wrap(out, make_spec(s.mesh(), s.placements(), out_shape, s.all_shard_sizes())));
    return;
  }
  if (shard_count(s, dim) > 1) fail(op, args, "the dim is sharded by several mesh dims");
  const auto& in_sizes = s.shard_sizes(m);
  const int64_t nwin = out_shape[dim];
  const auto out_sizes = unfold_out_sizes(in_sizes, nwin, step);
  const auto ranges = stencil::window_ranges(out_sizes, size, step, 1, 0);
  at::Tensor ext = comm::gather_range(x, s.mesh(), m, dim, in_sizes, ranges);
  const int64_t cnt = out_sizes[s.mesh().coordinate()[m]];
  ShardSizes sizes = s.all_shard_sizes();
  sizes[m] = out_sizes;
  SpecPtr spec = make_spec(s.mesh(), s.placements(), out_shape, sizes);
  at::Tensor out;
  if (cnt == 0 || ext.numel() == 0) {
    // No window here (or an empty piece): an empty result that stays
    // connected to the exchange, so backward runs its adjoint here too.
    out = ext.reshape(spec->local_shape());
  } else {
    out = ext.unfold(dim, size, step);
  }
  at::Tensor result = wrap(out, spec);
  if (!copy) {
    refuse_inplace(result,
                   "unfold along a sharded dim returns windows copied from several pieces, not "
                   "a view: in-place ops on it would be lost");
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
                 ", got " + str(*v[i]));
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
         "the kernel " + str(w.kernel) + " with dilation " + str(w.dilation) + " and padding " +
             str(w.padding) + " does not fit the input's spatial size [" + std::to_string(g[hdim]) +
             ", " + std::to_string(g[wdim]) + "]");
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
             std::to_string(ow) + " for output_size " + str(osize));
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

const RuleRegistrar unfold_ops({"unfold", "unfold_copy."}, unfold_rule);
const RuleRegistrar im2col_ops({"im2col."}, im2col_rule);
const RuleRegistrar col2im_ops({"col2im."}, col2im_rule);

}  // namespace
}  // namespace shardtensor::ops
