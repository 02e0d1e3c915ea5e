// Sharding rules for pooling: max_pool{1,2,3}d (and *_with_indices),
// avg_pool{1,2,3}d, adaptive_avg_pool{1,2,3}d (and _adaptive_avg_pool{2,3}d),
// adaptive_max_pool{1,2,3}d. Built on the halo arithmetic of ops/stencil.h.
//
// Note [pool rules]: when no spatial dim is sharded (batch/channel sharding,
// or one rank), the op runs unchanged on the local piece: pooling is
// independent along N and C. When spatial dims are sharded, the output is
// partitioned first (stencil::output_sizes) and each rank gathers exactly the
// input range its output block reads (stencil::gather_plans):
//  * max_pool: halos and the part of the window past the global edge are
//    filled with -inf, the lowest value for integer dtypes (extreme_identity:
//    the value libtorch's implicit padding never beats),
//    then the local pool runs with padding 0 on the sharded dims; with that
//    range, floor and ceil mode both give exactly the block's extent. Indices
//    are converted from the gathered window to global flat indices.
//  * avg_pool: halos are zeros; the local op returns window *sums*
//    (divisor_override=1) which are divided by a divisor computed
//    arithmetically per global output index with libtorch's formula
//    (Note [avg_pool divisor]). sum / divisor is the very float operation
//    libtorch performs, so results match to the last bit up to summation order.
//  * adaptive pools: the windows [floor(i*n/out), ceil((i+1)*n/out)) are not a
//    sliding window, so each rank gathers [start(o0), end(o1-1)) and pools
//    window by window along the sharded dims (Note [adaptive windows]).
// All decisions depend on global shapes, specs and op args only.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

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

enum class Kind { Max, Avg, AdaptiveAvg, AdaptiveMax };

struct PoolOp {
  Kind kind;
  int64_t nd;
  bool with_indices;  // returns (values, indices)
};

// libtorch's pooling_output_shape (ATen/native/Pool.h).
int64_t pool_out(int64_t n, int64_t k, int64_t pad, int64_t s, int64_t d, bool ceil_mode) {
  int64_t out = div_floor(n + 2 * pad - d * (k - 1) - 1 + (ceil_mode ? s - 1 : 0), s) + 1;
  if (ceil_mode && (out - 1) * s >= n + pad) --out;
  return out;
}

// A per-dim parameter list as the pooling ops accept it: one value or nd values
// (an empty stride means "= kernel").
std::vector<int64_t> expand(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                            std::vector<int64_t> v, int64_t nd, const char* what,
                            const std::vector<int64_t>& if_empty = {}) {
  if (v.empty() && !if_empty.empty()) return if_empty;
  if (v.size() == 1) return std::vector<int64_t>(nd, v[0]);
  if (static_cast<int64_t>(v.size()) != nd) {
    fail(op, args,
         std::string(what) + " must be a single int or a tuple of " + std::to_string(nd) + " ints");
  }
  return v;
}

// Note [avg_pool divisor]: libtorch (avg_pool2d/3d CPU kernels) divides the
// window sum by, per spatial dim, start = o*s - p, end = min(start + k, n + p),
// pool = end - start (padding counted, the ceil_mode overhang not), and, for
// count_include_pad=false, by the clamped extent min(end, n) - max(start, 0);
// the divisor is the product over dims. This is the 1-D factor for outputs
// [o0, o0 + cnt) of one dim.
at::Tensor divisor_1d(int64_t o0, int64_t cnt, int64_t n, int64_t k, int64_t s, int64_t p,
                      bool count_include_pad) {
  std::vector<double> v(cnt);
  for (int64_t i = 0; i < cnt; ++i) {
    int64_t start = (o0 + i) * s - p;
    int64_t end = std::min(start + k, n + p);
    const int64_t pool = end - start;
    start = std::max<int64_t>(start, 0);
    end = std::min(end, n);
    v[i] = static_cast<double>(count_include_pad ? pool : end - start);
  }
  return at::tensor(v, at::kDouble);
}

// Converts flat indices over the spatial extents `local_ext` (of a window whose
// first element is at global coordinates `offset`) into flat indices over the
// global spatial extents `global_ext`.
at::Tensor globalize(const at::Tensor& idx, const std::vector<int64_t>& local_ext,
                     const std::vector<int64_t>& offset, const std::vector<int64_t>& global_ext) {
  at::Tensor rem = idx;
  at::Tensor out = at::zeros_like(idx);
  int64_t gstride = 1;
  for (int64_t i = static_cast<int64_t>(local_ext.size()) - 1; i >= 0; --i) {
    at::Tensor c = at::remainder(rem, local_ext[i]);
    rem = at::div(rem, local_ext[i], "floor");
    out = out + (c + offset[i]) * gstride;
    gstride *= global_ext[i];
  }
  return out;
}

struct Setup {
  at::Tensor local;                      // Partial resolved
  ShardSpec spec;                        // of `local`
  std::vector<int64_t> spatial;          // tensor dims
  std::vector<int64_t> in_ext, out_ext;  // global, per spatial dim
};

Setup setup(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, const PoolOp& p) {
  for (const auto& a : op.schema().arguments()) {
    if (a.alias_info() && a.alias_info()->isWrite()) {
      fail(op, args, "out= variants of pooling are not supported on ShardTensors");
    }
  }
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  if (!s) fail(op, args, "only the input may be a ShardTensor");
  const int64_t ndim = static_cast<int64_t>(s->global_shape().size());
  if (ndim != p.nd + 1 && ndim != p.nd + 2) {
    fail(op, args,
         "expected a " + std::to_string(p.nd + 1) + "-d or " + std::to_string(p.nd + 2) +
             "-d input");
  }
  Setup st{at::Tensor(), without_partial(*s), {}, {}, {}};
  st.local = s->has_partial() ? to_layout(x, st.spec, st.spec) : local_of(x);
  for (int64_t i = 0; i < p.nd; ++i) {
    const int64_t d = ndim - p.nd + i;
    st.spatial.push_back(d);
    st.in_ext.push_back(s->global_shape()[d]);
    int64_t nshard = 0;
    for (const auto& pl : s->placements()) nshard += shard_dim(pl) == d ? 1 : 0;
    if (nshard > 1) fail(op, args, "a spatial dim sharded over several mesh dims is not supported");
  }
  return st;
}

// Note [plain fast path]: pooling is independent along N and C.
bool plain(const std::vector<c10::IValue>& args, const Setup& st) {
  std::vector<int64_t> lead;
  for (int64_t d = 0; d < st.spatial.front(); ++d) lead.push_back(d);
  return runs_plain(*spec_of(args[0].toTensor()), local_of(args[0].toTensor()), lead);
}

bool any_spatial_sharded(const Setup& st) {
  for (int64_t d : st.spatial) {
    if (st.spec.mesh_dim_of(d) >= 0) return true;
  }
  return false;
}

std::vector<int64_t> out_shape(const Setup& st) {
  std::vector<int64_t> shape = st.spec.global_shape();
  for (size_t i = 0; i < st.spatial.size(); ++i) shape[st.spatial[i]] = st.out_ext[i];
  return shape;
}

// No sharded spatial dim: the op runs as is on the local piece; its indices
// (if any) are already global.
void run_local(const c10::OperatorHandle& op, std::vector<c10::IValue> args, const Setup& st,
               const PoolOp& p, Stack* stack) {
  ShardSizes sizes = st.spec.all_shard_sizes();
  SpecPtr out = make_spec(st.spec.mesh(), st.spec.placements(), out_shape(st), sizes);
  if (st.local.numel() == 0) {
    // libtorch rejects an empty channel dim; the local result is empty anyway.
    const auto shape = out->local_shape();
    stack->push_back(wrap(st.local.reshape(shape), out));
    const bool two = p.with_indices;
    if (two) stack->push_back(wrap(at::empty(shape, st.local.options().dtype(at::kLong)), out));
    return;
  }
  Stack s = std::move(args);
  s[0] = st.local;
  op.callBoxed(&s);
  for (auto& v : s) stack->push_back(wrap(v.toTensor(), out));
}

// An empty local output that stays connected to the gathered input, so that
// backward runs the gather's adjoint (a collective) on this rank too.
at::Tensor empty_connected(const at::Tensor& gathered, const std::vector<int64_t>& shape) {
  TORCH_INTERNAL_ASSERT(gathered.numel() == 0);
  return gathered.reshape(shape);
}

// ---------------------------------------------------------------- max / avg

// Note [reduced precision]: libtorch's verdict on the input's dtype, before
// any communication (an empty piece never calls the kernel).
void check_pool_dtype(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                      const PoolOp& p) {
  static const char* const names[4][3] = {
      {"max_pool1d", "max_pool2d", "max_pool3d"},
      {"avg_pool1d", "avg_pool2d", "avg_pool3d"},
      {"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"},
      {"adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"}};
  if (!args[0].isTensor() || p.nd < 1 || p.nd > 3) return;
  const at::Tensor& x = args[0].toTensor();
  check_dtype_support(
      op, args, names[static_cast<int>(p.kind)][p.nd - 1], {x.scalar_type()}, will_backward(x),
      [p](c10::ArrayRef<at::ScalarType> t, bool rg) {
        std::vector<int64_t> shape{1, 1};
        for (int64_t i = 0; i < p.nd; ++i) shape.push_back(2);
        const at::Tensor in = probe_ones(shape, t[0], rg);
        const std::vector<int64_t> one(p.nd, 1);
        switch (p.kind) {
          case Kind::Max:
            return p.nd == 1 ? at::max_pool1d(in, one)
                             : (p.nd == 2 ? at::max_pool2d(in, one) : at::max_pool3d(in, one));
          case Kind::Avg:
            return p.nd == 1 ? at::avg_pool1d(in, one)
                             : (p.nd == 2 ? at::avg_pool2d(in, one) : at::avg_pool3d(in, one));
          case Kind::AdaptiveAvg:
            return p.nd == 1 ? at::adaptive_avg_pool1d(in, one)
                             : (p.nd == 2 ? at::adaptive_avg_pool2d(in, one)
                                          : at::adaptive_avg_pool3d(in, one));
          case Kind::AdaptiveMax:
            return std::get<0>(p.nd == 1 ? at::adaptive_max_pool1d(in, one)
                                         : (p.nd == 2 ? at::adaptive_max_pool2d(in, one)
                                                      : at::adaptive_max_pool3d(in, one)));
        }
        return in;
      });
}

// Note [pool saves no halo copy]: the sliding pools run libtorch's kernel on
// the halo-extended piece g, a copy the size of the input piece. Called
// through autograd, libtorch would save g for backward (max pooling and
// average pooling both take `self` in their backward), keeping a second
// input-sized tensor alive from forward to backward for every pooling layer.
// Their CPU backward kernels read only self's sizes (max: the saved indices
// place the gradient; avg: the window arithmetic), so PoolFn saves the
// indices (max) or nothing (avg) and hands the backward kernel a zero-strided
// stand-in of g's shape. g itself is freed when the rule returns. The
// backward calls libtorch's differentiable backward ops, so double backward
// (Note [differentiable adjoints]) stays exact. 1-D pooling runs as 2-D with
// a unit height, as libtorch's own 1-D pooling does.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct PoolArgs {
  bool is_max = false;
  int64_t nd = 2;  // 2 or 3 after the 1-D lift
  std::vector<int64_t> kernel, stride, pad, dil;
  bool ceil_mode = false;
  int64_t divisor = 1;  // avg: libtorch's divisor_override (1: window sums)
};

// Hand-written: libtorch's autograd would save the input-sized g (Note [pool saves no halo copy]).
struct PoolFn : torch::autograd::Function<PoolFn> {
  // Max: (values, local indices); avg: (window sums / divisor,).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& g, PoolArgs a) {
    at::AutoDispatchBelowADInplaceOrView guard;
    variable_list out;
    if (a.is_max) {
      auto [v, i] =
          a.nd == 2 ? at::max_pool2d_with_indices(g, a.kernel, a.stride, a.pad, a.dil, a.ceil_mode)
                    : at::max_pool3d_with_indices(g, a.kernel, a.stride, a.pad, a.dil, a.ceil_mode);
      ctx->save_for_backward({i});
      ctx->mark_non_differentiable({i});
      out = {v, i};
    } else {
      out = {a.nd == 2
                 ? at::avg_pool2d(g, a.kernel, a.stride, a.pad, a.ceil_mode, true, a.divisor)
                 : at::avg_pool3d(g, a.kernel, a.stride, a.pad, a.ceil_mode, true, a.divisor)};
    }
    ctx->saved_data["is_max"] = a.is_max;
    ctx->saved_data["nd"] = a.nd;
    ctx->saved_data["kernel"] = a.kernel;
    ctx->saved_data["stride"] = a.stride;
    ctx->saved_data["pad"] = a.pad;
    ctx->saved_data["dil"] = a.dil;
    ctx->saved_data["ceil_mode"] = a.ceil_mode;
    ctx->saved_data["divisor"] = a.divisor;
    ctx->saved_data["shape"] = g.sizes().vec();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("PoolFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    const auto& d = ctx->saved_data;
    PoolArgs a;
    a.is_max = d.at("is_max").toBool();
    a.nd = d.at("nd").toInt();
    a.kernel = d.at("kernel").toIntVector();
    a.stride = d.at("stride").toIntVector();
    a.pad = d.at("pad").toIntVector();
    a.dil = d.at("dil").toIntVector();
    a.ceil_mode = d.at("ceil_mode").toBool();
    a.divisor = d.at("divisor").toInt();
    const auto shape = ctx->saved_data.at("shape").toIntVector();
    at::Tensor go = grads[0];
    if (!go.defined()) return {at::Tensor(), at::Tensor()};
    // Only the sizes of `self` are read by the CPU backward kernels.
    const at::Tensor self = at::empty({}, go.options().requires_grad(false)).expand(shape);
    at::Tensor gi;
    if (a.is_max) {
      const at::Tensor idx = ctx->get_saved_variables()[0];
      gi = a.nd == 2 ? at::max_pool2d_with_indices_backward(go, self, a.kernel, a.stride, a.pad,
                                                            a.dil, a.ceil_mode, idx)
                     : at::max_pool3d_with_indices_backward(go, self, a.kernel, a.stride, a.pad,
                                                            a.dil, a.ceil_mode, idx);
    } else {
      gi = a.nd == 2 ? at::avg_pool2d_backward(go, self, a.kernel, a.stride, a.pad, a.ceil_mode,
                                               true, a.divisor)
                     : at::avg_pool3d_backward(go, self, a.kernel, a.stride, a.pad, a.ceil_mode,
                                               true, a.divisor);
    }
    return {gi, at::Tensor()};
  }
};

// Runs PoolFn on g (nd = 1, 2 or 3 spatial dims). Returns (values, or
// window sums divided by `divisor`; local indices or undefined).
std::pair<at::Tensor, at::Tensor> pool_local(const at::Tensor& g, bool is_max, int64_t nd,
                                             const std::vector<int64_t>& kernel,
                                             const std::vector<int64_t>& stride,
                                             const std::vector<int64_t>& pad,
                                             const std::vector<int64_t>& dil, bool ceil_mode,
                                             int64_t divisor) {
  PoolArgs a;
  a.is_max = is_max;
  a.ceil_mode = ceil_mode;
  a.divisor = divisor;
  if (nd == 1) {
    a.nd = 2;
    a.kernel = {1, kernel[0]};
    a.stride = {1, stride[0]};
    a.pad = {0, pad[0]};
    a.dil = {1, dil[0]};
    auto r = PoolFn::apply(g.unsqueeze(-2), a);
    return {r[0].squeeze(-2), is_max ? r[1].squeeze(-2) : at::Tensor()};
  }
  a.nd = nd;
  a.kernel = kernel;
  a.stride = stride;
  a.pad = pad;
  a.dil = dil;
  auto r = PoolFn::apply(g, a);
  return {r[0], is_max ? r[1] : at::Tensor()};
}

// Note [split-phase pool]: the sliding pools on spatially sharded inputs make
// no copy of the input piece in forward, on two paths decided from the global
// window plans and op args only (so every rank takes the same one):
//  * aligned: every coordinate's window range is exactly its own piece (no
//    window crosses a shard boundary or the global edge: max_pool2d(2) on even
//    pieces at even offsets, the U-Net's pools). libtorch's kernel runs on the
//    local piece itself (padding 0 on the sharded dims): no communication, no
//    copy.
//  * split: per sharded dim, every piece and output block non-empty, the
//    block's interior (outputs whose windows lie inside the piece) non-empty,
//    and a libtorch padding q in [0, k/2] that puts the local kernel's windows
//    on the global grid (q = off + p - o0*s mod s, as close to that as
//    possible). Then (like Note [conv overlap]) the halo strips are posted
//    (comm::gather_range_start of only the rows left / right of each piece:
//    the 3^D blocks of the halo-extended piece, level 1 on the piece, corners
//    on the level-below blocks as those arrive), libtorch's kernel runs on
//    the whole local piece with padding q while they travel (its windows that
//    read the padding or cross a shard boundary are wrong and get replaced),
//    and the boundary outputs are computed from strips: along sharded dim i,
//    the boundary outputs crossed with all outputs of earlier sharded dims
//    and the interior of later ones (every output written once; box i needs
//    only the blocks of dims <= i, so it runs while the next level travels).
//    Strips are assembled from narrowed blocks (halo rows + the local rows the
//    boundary windows read). When the local kernel's output is exactly the
//    block (offset 0, same extent: stride 1 with symmetric padding), it is the
//    output and the boundary values are written into it; otherwise the
//    interior is copied into an output-sized tensor.
// Everything else (multi-hop halos, empty pieces or blocks, no interior)
// takes the general path: gather_plans builds the halo-extended piece.
// Backward: the interior and strip kernels go through PoolFn (Note [pool
// saves no halo copy]: indices or nothing saved), the strip gathers through
// the halo adjoint (one zero-initialised piece-sized gradient per strip
// exchange, summed into the piece's gradient by autograd).
// SHARDTENSOR_POOL_SPLIT=0 turns the split path off (for comparisons; the
// test SplitPhaseHoldsNoPaddedCopy then fails: the general path holds one
// extra piece-sized copy). Measured (bench profile unet2d train 512x512,
// P = 2, the U-Net's three max_pool2d(2), aligned: 0 bytes before and after;
// CPU load ~4 on 2 cores, times indicative): forward 21-23 ms -> 15-20 ms,
// and the pools' gather adjoint in backward (about half of the 23-27 ms
// GatherRangeFn (bwd) row, 6 calls -> 3) is gone.
struct SplitDim {
  int64_t si = 0;  // index into the spatial dims
  int64_t dim = 0, mesh_dim = 0;
  std::vector<int64_t> in_sizes;
  std::vector<stencil::Range> left, right;  // per coordinate: the halo ranges
  int64_t off = 0, n = 0, o0 = 0, cnt = 0, ia = 0, ib = 0, q = 0, t = 0;  // this rank
};

struct WinArgs {
  std::vector<int64_t> kernel, stride, dil, pad;
  bool ceil_mode = false;
  int64_t eff(int64_t i) const { return dil[i] * (kernel[i] - 1) + 1; }
  // Global input range read by outputs [a, b) of spatial dim i.
  stencil::Range reads(int64_t i, int64_t a, int64_t b) const {
    return {a * stride[i] - pad[i], (b - 1) * stride[i] - pad[i] + eff(i)};
  }
};

std::vector<int64_t> prefix(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size(), 0);
  for (size_t c = 1; c < sizes.size(); ++c) off[c] = off[c - 1] + sizes[c - 1];
  return off;
}

// Aligned: every coordinate reads exactly its own piece (an empty block may
// sit on an empty piece).
bool reads_own_piece(const std::vector<stencil::DimPlan>& plans) {
  for (const auto& pl : plans) {
    const auto off = prefix(pl.in_sizes);
    for (size_t c = 0; c < pl.in_sizes.size(); ++c) {
      if (pl.out_sizes[c] == 0 && pl.in_sizes[c] == 0) continue;
      if (pl.out_sizes[c] == 0 || pl.ranges[c] != stencil::Range{off[c], off[c] + pl.in_sizes[c]}) {
        return false;
      }
    }
  }
  return true;
}

// The split path's per-dim plan, or nothing when it does not apply on some
// coordinate (Note [split-phase pool]). Global data only.
std::optional<std::vector<SplitDim>> split_plan(const std::vector<stencil::DimPlan>& plans,
                                                const Setup& st, const WinArgs& w) {
  // Note [agreed settings]: read where every rank takes the same path.
  if (!comm::use_setting(st.spec.mesh(), Setting::PoolSplit)) return std::nullopt;
  // Leading dims (and unsharded spatial ones) must be non-empty globally.
  for (int64_t e : st.spec.global_shape()) {
    if (e == 0) return std::nullopt;
  }
  const DeviceMesh& mesh = st.spec.mesh();
  std::vector<SplitDim> out;
  for (const auto& pl : plans) {
    SplitDim sd;
    for (size_t i = 0; i < st.spatial.size(); ++i) {
      if (st.spatial[i] == pl.dim) sd.si = static_cast<int64_t>(i);
    }
    const int64_t i = sd.si;
    const int64_t s = w.stride[i], p = w.pad[i], k = w.kernel[i];
    sd.dim = pl.dim;
    sd.mesh_dim = pl.mesh_dim;
    sd.in_sizes = pl.in_sizes;
    const auto in_off = prefix(pl.in_sizes), out_off = prefix(pl.out_sizes);
    const int64_t me = mesh.coordinate()[pl.mesh_dim];
    for (size_t c = 0; c < pl.in_sizes.size(); ++c) {
      const int64_t off = in_off[c], n = pl.in_sizes[c], o0 = out_off[c], cnt = pl.out_sizes[c];
      if (n == 0 || cnt == 0) return std::nullopt;
      const int64_t ia = std::max(o0, div_ceil(off + p, s));
      const int64_t ib = std::min(o0 + cnt, div_floor(off + n + p - w.eff(i), s) + 1);
      if (ia >= ib) return std::nullopt;
      // Local padding q = q0 + t*s in [0, k/2], t as close to 0 as possible.
      const int64_t q0 = off + p - o0 * s;
      int64_t q = q0;
      if (q > k / 2) q -= s * div_ceil(q - k / 2, s);
      if (q < 0) q += s * div_ceil(-q, s);
      if (q < 0 || q > k / 2) return std::nullopt;
      const auto [lo, hi] = w.reads(i, o0, o0 + cnt);
      sd.left.emplace_back(std::min(lo, off), off);
      sd.right.emplace_back(off + n, std::max(hi, off + n));
      if (static_cast<int64_t>(c) == me) {
        sd.off = off;
        sd.n = n;
        sd.o0 = o0;
        sd.cnt = cnt;
        sd.ia = ia;
        sd.ib = ib;
        sd.q = q;
        sd.t = (q - q0) / s;
      }
    }
    out.push_back(std::move(sd));
  }
  return out;
}

// Note [split-phase pool]: the forward of the split path. Returns (values or
// window sums, global indices or undefined) of this rank's output block.
std::pair<at::Tensor, at::Tensor> split_forward(const Setup& st, const std::vector<SplitDim>& sd,
                                                const WinArgs& w, bool is_max, bool want_idx,
                                                int64_t divisor,
                                                const std::vector<int64_t>& out_local) {
  const at::Tensor& x = st.local;
  const DeviceMesh& mesh = st.spec.mesh();
  const int64_t nd = static_cast<int64_t>(st.spatial.size());
  const int64_t D = static_cast<int64_t>(sd.size());
  // -inf for floating dtypes, the lowest value for integer ones (exact as a double:
  // int64's is -2^63).
  const double fill = is_max ? extreme_identity(x.scalar_type(), true).toDouble() : 0.0;
  // Note [halo blocks].
  std::vector<stencil::BlockDim> bd;
  for (const auto& d : sd)
    bd.push_back({d.dim, d.mesh_dim, d.in_sizes, d.left, d.right, d.off, d.n});
  stencil::HaloBlocks hb(x, mesh, std::move(bd), PadMode::Constant, fill);
  // The global input box each boundary strip reads (hb.region(want)).
  std::vector<stencil::Range> want(D);
  std::vector<int64_t> lpad = w.pad;
  for (const auto& d : sd) lpad[d.si] = 0;
  std::vector<int64_t> ext_global = st.in_ext;
  // Pools a region: returns (values or sums, global indices).
  auto pool_region = [&](const at::Tensor& g, const std::vector<int64_t>& pads,
                         const std::vector<int64_t>& offset) {
    auto [v, ix] = pool_local(g, is_max, nd, w.kernel, w.stride, pads, w.dil, w.ceil_mode, divisor);
    if (!want_idx) {
      ix = at::Tensor();
    } else {
      std::vector<int64_t> lext;
      for (int64_t d : st.spatial) lext.push_back(g.size(d));
      ix = globalize(ix, lext, offset, ext_global);
    }
    return std::make_pair(v, ix);
  };

  hb.start_level(1);
  // Interior: the whole piece with padding q on the sharded dims.
  std::vector<int64_t> qpad = w.pad, xoff(nd, 0);
  bool exact = true;
  for (const auto& d : sd) {
    qpad[d.si] = d.q;
    xoff[d.si] = d.off;
  }
  auto [vi, ii] = pool_region(x, qpad, xoff);
  for (const auto& d : sd) exact = exact && d.t == 0 && vi.size(d.dim) == d.cnt;
  at::Tensor out, idx;
  if (exact) {
    out = vi;
    idx = ii;
  } else {
    out = at::empty(out_local, vi.options());
    if (want_idx) idx = at::empty(out_local, ii.options());
    at::Tensor vsrc = vi, isrc = ii, vdst = out, idst = idx;
    for (const auto& d : sd) {
      const int64_t len = d.ib - d.ia;
      TORCH_INTERNAL_ASSERT(d.ia - d.o0 + d.t >= 0 && d.ib - d.o0 + d.t <= vi.size(d.dim));
      vsrc = vsrc.narrow(d.dim, d.ia - d.o0 + d.t, len);
      vdst = vdst.narrow(d.dim, d.ia - d.o0, len);
      if (want_idx) {
        isrc = isrc.narrow(d.dim, d.ia - d.o0 + d.t, len);
        idst = idst.narrow(d.dim, d.ia - d.o0, len);
      }
    }
    vdst.copy_(vsrc);
    if (want_idx) idst.copy_(isrc);
  }
  vi = at::Tensor();
  ii = at::Tensor();
  for (int64_t l = 1; l <= D; ++l) {
    hb.finish_level(l);
    if (l < D) hb.start_level(l + 1);
    // Box l-1: boundary outputs of sharded dim l-1, all outputs of earlier
    // sharded dims, interior outputs of later ones.
    const int64_t j = l - 1;
    const SplitDim& dj = sd[j];
    for (const stencil::Range& ob :
         {stencil::Range{dj.o0, dj.ia}, stencil::Range{dj.ib, dj.o0 + dj.cnt}}) {
      if (ob.first >= ob.second) continue;
      std::vector<stencil::Range> outs(D);
      std::vector<int64_t> goff(nd, 0);
      for (int64_t r = 0; r < D; ++r) {
        outs[r] = r < j    ? stencil::Range{sd[r].o0, sd[r].o0 + sd[r].cnt}
                  : r == j ? ob
                           : stencil::Range{sd[r].ia, sd[r].ib};
        want[r] = w.reads(sd[r].si, outs[r].first, outs[r].second);
        goff[sd[r].si] = want[r].first;
      }
      const at::Tensor strip = hb.region(want);
      auto [v, ix] = pool_region(strip, lpad, goff);
      at::Tensor vdst = out, idst = idx;
      for (int64_t r = 0; r < D; ++r) {
        const int64_t len = outs[r].second - outs[r].first;
        TORCH_INTERNAL_ASSERT(v.size(sd[r].dim) == len);
        vdst = vdst.narrow(sd[r].dim, outs[r].first - sd[r].o0, len);
        if (want_idx) idst = idst.narrow(sd[r].dim, outs[r].first - sd[r].o0, len);
      }
      vdst.copy_(v);
      if (want_idx) idst.copy_(ix);
    }
  }
  // A block that came through an exchange but feeds no strip (an empty halo
  // next to a rank whose neighbour does read from it) must still run its
  // adjoint in backward, which receives that neighbour's halo gradient: it is
  // attached to the output by an empty in-place copy (no data, no cost).
  for (int64_t b = 0; b < hb.count(); ++b) {
    if (!hb.exchanged(b) || hb.used(b)) continue;
    at::Tensor dst = out.narrow(sd[0].dim, 0, 0);
    dst.copy_(hb.block(b).sum().to(dst.scalar_type()).expand(dst.sizes()));
  }
  return {out, idx};
}

void sliding_rule(const c10::OperatorHandle& op, Stack* stack, PoolOp p) {
  auto args = pop_args(op, stack);
  check_pool_dtype(op, args, p);
  Setup st = setup(op, args, p);
  const int64_t nd = p.nd;
  const auto kernel = expand(op, args, int_list(args[1]), nd, "kernel_size");
  const auto stride = expand(op, args, int_list(args[2]), nd, "stride", kernel);
  const auto pad = expand(op, args, int_list(args[3]), nd, "padding");
  std::vector<int64_t> dil(nd, 1);
  bool ceil_mode = false, count_include_pad = true;
  std::optional<int64_t> divisor_override;
  if (p.kind == Kind::Max) {
    dil = expand(op, args, int_list(args[4]), nd, "dilation");
    ceil_mode = args[5].toBool();
  } else {
    ceil_mode = args[4].toBool();
    count_include_pad = args[5].toBool();
    if (args.size() > 6 && !args[6].isNone()) divisor_override = args[6].toInt();
  }
  for (int64_t i = 0; i < nd; ++i) {
    if (kernel[i] <= 0 || stride[i] <= 0 || dil[i] <= 0 || pad[i] < 0 || pad[i] > kernel[i] / 2) {
      fail(op, args, "invalid kernel_size/stride/dilation/padding");
    }
    st.out_ext.push_back(pool_out(st.in_ext[i], kernel[i], pad[i], stride[i], dil[i], ceil_mode));
    if (st.out_ext.back() <= 0) fail(op, args, "output size is too small");
  }
  if (divisor_override && *divisor_override == 0) fail(op, args, "divisor must be not zero");
  if (plain(args, st)) return call_plain(op, std::move(args), stack);
  if (!any_spatial_sharded(st)) return run_local(op, std::move(args), st, p, stack);

  auto plans = stencil::window_plans(st.spec, st.spatial, kernel, stride, dil, pad, st.out_ext);
  const bool is_max = p.kind == Kind::Max;
  SpecPtr out_spec = stencil::output_spec(st.spec, out_shape(st), plans);
  const std::vector<int64_t> out_local = out_spec->local_shape();
  int64_t out_numel = 1;
  for (int64_t v : out_local) out_numel *= v;
  const WinArgs w{kernel, stride, dil, pad, ceil_mode};
  const int64_t divisor = divisor_override.value_or(1);

  // Per spatial dim: output block start and extent (global).
  std::vector<int64_t> o0(nd, 0), ocnt(st.out_ext);
  const auto out_offsets = out_spec->local_offsets();
  for (int64_t i = 0; i < nd; ++i) {
    for (const auto& pl : plans) {
      if (pl.dim != st.spatial[i]) continue;
      o0[i] = out_offsets[st.spatial[i]];
      ocnt[i] = out_local[st.spatial[i]];
    }
  }

  at::Tensor out, idx;
  // Note [split-phase pool]: the aligned path, the split path, or the general one.
  const bool aligned = reads_own_piece(plans);
  std::optional<std::vector<SplitDim>> split;
  if (!aligned) split = split_plan(plans, st, w);
  if (split && out_numel > 0) {
    // out_numel == 0 here means an empty leading dim, the same on every peer.
    std::tie(out, idx) = split_forward(st, *split, w, is_max, p.with_indices, divisor, out_local);
  } else {
    at::Tensor g =
        aligned ? st.local
                : stencil::gather_plans(
                      st.local, st.spec.mesh(), plans, PadMode::Constant,
                      is_max ? extreme_identity(st.local.scalar_type(), true).toDouble() : 0.0);
    // Local padding (0 where sharded), offset of the gathered window (global).
    std::vector<int64_t> lpad = pad, offset(nd, 0);
    for (int64_t i = 0; i < nd; ++i) {
      for (const auto& pl : plans) {
        if (pl.dim != st.spatial[i]) continue;
        lpad[i] = 0;
        offset[i] = stencil::my_range(pl, st.spec.mesh()).first;
      }
    }
    if (out_numel == 0) {
      out = empty_connected(g, out_local);
      if (p.with_indices) idx = at::empty(out_local, g.options().dtype(at::kLong));
    } else {
      // Note [pool saves no halo copy]. Avg: window sums, then libtorch's divisor
      // (Note [avg_pool divisor]).
      std::tie(out, idx) = pool_local(g, is_max, nd, kernel, stride, lpad, dil, ceil_mode, divisor);
      TORCH_INTERNAL_ASSERT(out.sizes() == c10::IntArrayRef(out_local));
      if (!p.with_indices) idx = at::Tensor();
      if (idx.defined()) {
        std::vector<int64_t> lext;
        for (int64_t d : st.spatial) lext.push_back(g.size(d));
        idx = globalize(idx, lext, offset, st.in_ext);
      }
    }
  }
  if (out_numel > 0 && !is_max) {
    if (!divisor_override) {
      // One spatial plane of divisors, in the output's dtype (integer products,
      // exact in float below 2^24 as in double), divided in place: the window
      // sums are not kept (an input-sized tensor at stride 1).
      at::Tensor div = at::ones({}, out.options());
      for (int64_t i = 0; i < nd; ++i) {
        std::vector<int64_t> shape(nd, 1);
        shape[i] = ocnt[i];
        div = div * divisor_1d(o0[i], ocnt[i], st.in_ext[i], kernel[i], stride[i], pad[i],
                               count_include_pad)
                        .to(out.options())
                        .reshape(shape);
      }
      // Integer dtypes: libtorch's kernel divides integer sums by the integer
      // divisor in C++ arithmetic, which truncates toward zero.
      if (at::isIntegralType(out.scalar_type(), /*includeBool=*/false)) {
        out.div_(div, "trunc");
      } else {
        out.div_(div);
      }
    }
  }
  stack->push_back(wrap(out, out_spec));
  if (p.with_indices) stack->push_back(wrap(idx, out_spec));
}

// ---------------------------------------------------------------- adaptive

int64_t astart(int64_t i, int64_t n, int64_t out) { return div_floor(i * n, out); }
int64_t aend(int64_t i, int64_t n, int64_t out) { return div_ceil((i + 1) * n, out); }

// Note [adaptive reduce]: an adaptive average pool whose output along every
// sharded dim is smaller than the number of ranks sharding it
// (AdaptiveAvgPool2d(1) before a classifier head, ...) would send most of the
// input to a few coordinates (O(N) on one rank). Instead every rank pools its
// own piece: the adaptive op itself on the unsharded dims (output extent
// there; its local extent on the sharded dims, where the windows [i, i+1) make
// it the identity), then, along each sharded dim, the weighted window sums of
// its rows as a (out x local) matrix with entries 1/|window| where a global
// row falls in the window; the partial results are summed with one
// all-reduce over the sharded mesh dims (comm::all_reduce: backward identity,
// the gradient of the replicated result being the full one on every rank).
// The output is Replicate on those mesh dims. Decided from global shapes and
// the spec only.
bool small_output(const Setup& st) {
  bool any = false;
  for (size_t i = 0; i < st.spatial.size(); ++i) {
    const int64_t m = st.spec.mesh_dim_of(st.spatial[i]);
    if (m < 0 || st.spec.mesh().size(m) == 1) continue;
    if (st.out_ext[i] >= st.spec.mesh().size(m)) return false;
    any = true;
  }
  return any;
}

void adaptive_avg_reduce(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                         const Setup& st, Stack* stack) {
  const int64_t nd = static_cast<int64_t>(st.spatial.size());
  const DeviceMesh& mesh = st.spec.mesh();
  const auto offsets = st.spec.local_offsets();
  std::vector<int64_t> call_out(st.out_ext);
  std::vector<int64_t> reduce_dims;
  Placements pl = st.spec.placements();
  ShardSizes sizes = st.spec.all_shard_sizes();
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t m = st.spec.mesh_dim_of(st.spatial[i]);
    if (m < 0) continue;
    call_out[i] = st.local.size(st.spatial[i]);
    reduce_dims.push_back(m);
    pl[m] = Replicate{};
    sizes[m] = {};
  }
  at::Tensor y;
  if (st.local.numel() == 0) {
    // An empty piece contributes zeros (and stays connected for backward).
    std::vector<int64_t> shape = st.local.sizes().vec();
    for (int64_t i = 0; i < nd; ++i) shape[st.spatial[i]] = st.out_ext[i];
    y = st.local.sum() * 0 + at::zeros(shape, st.local.options());
  } else {
    // Note [adaptive mean]: with output extent 1 on every spatial dim,
    // libtorch's adaptive_avg_pool{1,2,3}d is input.mean(spatial dims) (its
    // only path for complex: the kernel refuses complex). The local call here
    // keeps the sharded dims' local extents (an identity along them), which
    // would take the kernel and raise on the ranks with data only (fuzz seed
    // 420577 at np4); so, all ones, the local step is that mean over the
    // unsharded spatial dims, and the weights below average the sharded ones.
    bool all_ones = true;
    std::vector<int64_t> unsharded;
    for (int64_t i = 0; i < nd; ++i) {
      all_ones = all_ones && st.out_ext[i] == 1;
      if (st.spec.mesh_dim_of(st.spatial[i]) < 0) unsharded.push_back(st.spatial[i]);
    }
    if (all_ones) {
      y = unsharded.empty() ? st.local : st.local.mean(unsharded, /*keepdim=*/true);
    } else {
      y = nd == 1   ? at::adaptive_avg_pool1d(st.local, call_out)
          : nd == 2 ? at::adaptive_avg_pool2d(st.local, call_out)
                    : at::adaptive_avg_pool3d(st.local, call_out);
    }
    for (int64_t i = 0; i < nd; ++i) {
      const int64_t d = st.spatial[i];
      if (st.spec.mesh_dim_of(d) < 0) continue;
      const int64_t n = st.in_ext[i], on = st.out_ext[i], nl = y.size(d), o0 = offsets[d];
      std::vector<double> w(on * nl, 0.0);
      for (int64_t o = 0; o < on; ++o) {
        const int64_t a = astart(o, n, on), b = aend(o, n, on);
        for (int64_t j = std::max(a - o0, int64_t{0}); j < std::min(b - o0, nl); ++j) {
          w[o * nl + j] = 1.0 / static_cast<double>(b - a);
        }
      }
      const at::Tensor wt = at::tensor(w, at::kDouble).to(y.options()).view({on, nl});
      y = at::matmul(wt, y.movedim(d, -2)).movedim(-2, d);
    }
  }
  y = comm::all_reduce(y.contiguous(), mesh, reduce_dims);
  std::vector<int64_t> shape = st.spec.global_shape();
  for (int64_t i = 0; i < nd; ++i) shape[st.spatial[i]] = st.out_ext[i];
  (void)op;
  (void)args;
  stack->push_back(wrap(y, make_spec(mesh, std::move(pl), std::move(shape), std::move(sizes))));
}

// Note [adaptive windows]: output i of an adaptive pool reads
// [floor(i*n/out), ceil((i+1)*n/out)); an output block [o0, o1) thus reads
// [start(o0), end(o1-1)). These windows are no sliding window (their lengths
// vary), so along the sharded dims the rank pools window by window: the
// adaptive op itself on each window with output extent 1 there (and the global
// output extent on the unsharded dims, whose windows are then the global
// ones), so every value is computed exactly as libtorch computes it.
void adaptive_rule(const c10::OperatorHandle& op, Stack* stack, PoolOp p) {
  auto args = pop_args(op, stack);
  check_pool_dtype(op, args, p);
  Setup st = setup(op, args, p);
  const int64_t nd = p.nd;
  st.out_ext = int_list(args[1]);
  if (static_cast<int64_t>(st.out_ext.size()) != nd) {
    fail(op, args, "output_size must have " + std::to_string(nd) + " elements");
  }
  for (int64_t i = 0; i < nd; ++i) {
    if (st.out_ext[i] <= 0) fail(op, args, "output_size must be positive");
    if (st.in_ext[i] <= 0) fail(op, args, "spatial dims of the input must be non-empty");
  }
  if (plain(args, st)) return call_plain(op, std::move(args), stack);
  if (!any_spatial_sharded(st)) return run_local(op, std::move(args), st, p, stack);

  if (p.kind == Kind::AdaptiveAvg && small_output(st)) {
    return adaptive_avg_reduce(op, std::move(args), st, stack);
  }

  std::vector<stencil::DimPlan> plans;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t d = st.spatial[i];
    const int64_t m = st.spec.mesh_dim_of(d);
    if (m < 0) continue;
    stencil::DimPlan pl;
    pl.dim = d;
    pl.mesh_dim = m;
    pl.in_sizes = st.spec.shard_sizes(m);
    pl.out_sizes = stencil::output_sizes(pl.in_sizes, st.out_ext[i]);
    int64_t o = 0;
    for (int64_t cnt : pl.out_sizes) {
      const int64_t lo = std::min(astart(o, st.in_ext[i], st.out_ext[i]), st.in_ext[i]);
      pl.ranges.emplace_back(lo, cnt == 0 ? lo : aend(o + cnt - 1, st.in_ext[i], st.out_ext[i]));
      o += cnt;
    }
    plans.push_back(std::move(pl));
  }
  at::Tensor g = stencil::gather_plans(st.local, st.spec.mesh(), plans, PadMode::Constant, 0.0);
  SpecPtr out_spec = stencil::output_spec(st.spec, out_shape(st), plans);
  const std::vector<int64_t> out_local = out_spec->local_shape();
  const auto out_offsets = out_spec->local_offsets();
  int64_t out_numel = 1;
  for (int64_t v : out_local) out_numel *= v;
  const bool is_max = p.kind == Kind::AdaptiveMax;

  at::Tensor out, idx;
  if (out_numel == 0) {
    out = empty_connected(g, out_local);
    if (is_max) idx = at::empty(out_local, g.options().dtype(at::kLong));
  } else {
    // Sharded spatial dims: index i into spatial, its gathered range start.
    struct SD {
      int64_t i, lo;
    };
    std::vector<SD> sds;
    for (int64_t i = 0; i < nd; ++i) {
      for (const auto& pl : plans) {
        if (pl.dim == st.spatial[i])
          sds.push_back({i, stencil::my_range(pl, st.spec.mesh()).first});
      }
    }
    std::vector<int64_t> call_out(st.out_ext);
    for (const auto& sd : sds) call_out[sd.i] = 1;
    std::vector<int64_t> offset(nd, 0);
    std::function<std::pair<at::Tensor, at::Tensor>(size_t, at::Tensor)> build =
        [&](size_t level, at::Tensor slice) -> std::pair<at::Tensor, at::Tensor> {
      if (level == sds.size()) {
        at::Tensor v, ix;
        if (is_max) {
          if (nd == 1) {
            std::tie(v, ix) = at::adaptive_max_pool1d(slice, call_out);
          } else if (nd == 2) {
            std::tie(v, ix) = at::adaptive_max_pool2d(slice, call_out);
          } else {
            std::tie(v, ix) = at::adaptive_max_pool3d(slice, call_out);
          }
          std::vector<int64_t> lext;
          for (int64_t d : st.spatial) lext.push_back(slice.size(d));
          ix = globalize(ix, lext, offset, st.in_ext);
        } else if (nd == 1) {
          v = at::adaptive_avg_pool1d(slice, call_out);
        } else if (nd == 2) {
          v = at::adaptive_avg_pool2d(slice, call_out);
        } else {
          v = at::adaptive_avg_pool3d(slice, call_out);
        }
        return {v, ix};
      }
      const SD& sd = sds[level];
      const int64_t d = st.spatial[sd.i];
      const int64_t n = st.in_ext[sd.i], on = st.out_ext[sd.i];
      std::vector<at::Tensor> vs, ixs;
      for (int64_t o = out_offsets[d]; o < out_offsets[d] + out_local[d]; ++o) {
        const int64_t a = astart(o, n, on), b = aend(o, n, on);
        offset[sd.i] = a;
        auto r = build(level + 1, slice.narrow(d, a - sd.lo, b - a));
        vs.push_back(r.first);
        if (is_max) ixs.push_back(r.second);
      }
      return {at::cat(vs, d), is_max ? at::cat(ixs, d) : at::Tensor()};
    };
    std::tie(out, idx) = build(0, g);
  }
  stack->push_back(wrap(out, out_spec));
  if (is_max) stack->push_back(wrap(idx, out_spec));
}

Rule sliding(Kind k, int64_t nd, bool with_indices) {
  return [=](const c10::OperatorHandle& op, Stack* stack) {
    sliding_rule(op, stack, PoolOp{k, nd, with_indices});
  };
}

Rule adaptive(Kind k, int64_t nd) {
  return [=](const c10::OperatorHandle& op, Stack* stack) {
    adaptive_rule(op, stack, PoolOp{k, nd, k == Kind::AdaptiveMax});
  };
}

// Note [pool entry points]: composite entry points (max_pool{1,2,3}d,
// max_pool1d_with_indices, avg_pool1d, adaptive_avg_pool{1,2,3}d,
// adaptive_max_pool1d) arrive before their decomposition, so each gets a rule;
// the non-composite ops they call get the same rule for direct callers.
const RuleRegistrar r_max1({"max_pool1d"}, sliding(Kind::Max, 1, false));
const RuleRegistrar r_max2({"max_pool2d"}, sliding(Kind::Max, 2, false));
const RuleRegistrar r_max3({"max_pool3d"}, sliding(Kind::Max, 3, false));
const RuleRegistrar r_maxi1({"max_pool1d_with_indices"}, sliding(Kind::Max, 1, true));
const RuleRegistrar r_maxi2({"max_pool2d_with_indices"}, sliding(Kind::Max, 2, true));
const RuleRegistrar r_maxi3({"max_pool3d_with_indices"}, sliding(Kind::Max, 3, true));
const RuleRegistrar r_avg1({"avg_pool1d"}, sliding(Kind::Avg, 1, false));
const RuleRegistrar r_avg2({"avg_pool2d"}, sliding(Kind::Avg, 2, false));
const RuleRegistrar r_avg3({"avg_pool3d"}, sliding(Kind::Avg, 3, false));
const RuleRegistrar r_aavg1({"adaptive_avg_pool1d"}, adaptive(Kind::AdaptiveAvg, 1));
const RuleRegistrar r_aavg2({"adaptive_avg_pool2d", "_adaptive_avg_pool2d"},
                            adaptive(Kind::AdaptiveAvg, 2));
const RuleRegistrar r_aavg3({"adaptive_avg_pool3d", "_adaptive_avg_pool3d"},
                            adaptive(Kind::AdaptiveAvg, 3));
const RuleRegistrar r_amax1({"adaptive_max_pool1d"}, adaptive(Kind::AdaptiveMax, 1));
const RuleRegistrar r_amax2({"adaptive_max_pool2d"}, adaptive(Kind::AdaptiveMax, 2));
const RuleRegistrar r_amax3({"adaptive_max_pool3d"}, adaptive(Kind::AdaptiveMax, 3));

}  // namespace
}  // namespace shardtensor::ops
