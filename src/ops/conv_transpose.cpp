// Sharding rule for transposed convolution: conv_transpose1d,
// conv_transpose2d.input, conv_transpose3d.input (composite ops, intercepted
// before they decompose into aten::convolution), and aten::convolution /
// aten::_convolution with transposed=true (handed over by src/ops/conv.cpp).
//
// Note [transposed convolution halos]: output o receives input i through tap j
// when o = i*s - p + j*d. The output is partitioned first
// (stencil::output_sizes); the block [o0, o1) needs the inputs
// [floor((o0 + p - d(k-1))/s), ceil((o1 - 1 + p)/s)], one more on each side
// than strictly needed at most, so that the local transposed convolution of
// that range (padding 0, output_padding 0: its index 0 is the global output
// i_lo*s - p) covers the block without output_padding; the block is then
// narrowed out. Inputs outside [0, n) are gathered as zeros and contribute
// nothing. Each output element is computed on exactly one rank, so the bias is
// added once; weight and bias are replicated and marked with use_replicated
// (via to_layout) so their gradients are summed over the sharded mesh dims
// (a channel-sharded input: Note [channel-sharded transposed convolution]).
//
// Note [channel-sharded transposed convolution]: as Note [channel-sharded
// conv] (src/ops/conv.cpp), with the helpers of ops/channel_conv.h. The
// weight is [C_in, C_out/groups, k...]: with the input channels split over
// mesh dim m (groups == 1), each rank runs the transposed convolution above
// (spatial halos, split-phase or general path) on its channels with the
// matching slice w[c0:c1] (a local slice of the replicated weight; its
// gradient is all-gathered over m in backward) and no bias. That is this
// rank's share of a sum over m, with every output channel;
// comm::reduce_scatter sums it and splits the output channels (balanced):
// the output is Shard(channel) on m, the input's placements elsewhere. The
// bias is added after the sum, to this rank's output channels. An empty
// channel piece convolves nothing (a zero share, general path). Cost on m
// per rank, for a local output block of V = C_out x (spatial block) elements:
// forward a reduce-scatter of (P-1)/P V, backward its adjoint (an all-gather
// of the output gradient, the same bytes) and the all-gather of the weight
// (and bias) gradient slices; no operand is replicated, so nothing is
// counted in gathered_bytes and strict mode allows it. A transposed
// convolution upsamples: V is about C_out/C_in x prod(stride) times the
// input's spatial block over all C_in channels, so for C_out/C_in x
// prod(stride) > 1 (a U-Net up-convolution, C_out = C_in/2, stride 2 in 2-D:
// 2) this moves more bytes than replicating the input channels would (an
// all-gather of (P-1)/P of that block), in exchange for activation memory
// that stays 1/P and no gather. A grouped transposed convolution over a
// channel-sharded input
// replicates the channels instead (a visible gather, Note [visible gathers]:
// counted, refused in strict mode).
//
// Note [transposed convolution memory]: the general path (everything that
// Note [split-phase transposed convolution] does not take). As for the
// convolution (Note [conv memory]), a rule built from gather +
// at::conv_transpose under autograd would keep the gathered (halo-extended)
// input alive until backward, and the block returned would be a view that
// keeps the whole over-computed local output alive. ConvTransposeFn saves
// only the local input, the weight and the bias; forward builds the gathered
// copy transiently and returns the block as its own tensor; backward
// rebuilds the gathered input on a fresh graph (one more halo exchange),
// places the block's gradient into the over-computed output's shape, runs
// at::convolution_backward (transposed) and sends the halo part of the input
// gradient back to its owners through the adjoint of the gather. Under
// create_graph it differentiates the rebuilt forward instead, so gradients
// of any order stay exact (Note [differentiable adjoints]).
//
// Note [transposed convolution weight gradient]: both paths over-compute:
// the general one convolves the halo-extended input (zeros past the global
// edges) into a window wider than the block and gives the rows outside the
// block a zero gradient; the split-phase one discards the piece's boundary
// rows and reads zero rows in its strips. The weight gradient, the sum over
// the pairs (input i, output o) of x[i] * g[o], then holds products that
// libtorch's single call does not form: an Inf/NaN input times a zero
// gradient (NaN where libtorch has +-Inf; fuzz seed 210033, a
// conv_transpose3d weight gradient NaN at 8 vs 7 positions) and a zero
// input times an Inf gradient. On the general path, ConvTransposeFn gives
// the weight no first-order gradient and TconvWeightGradFn (the identity on
// the output) computes it pairing by input ownership instead: this rank's
// piece [off, off + n) with the output gradient over the whole window it
// writes, [off*s - p, (off + n - 1)*s - p + d(k-1) + 1), gathered from the
// block owners and zero past [0, N_out) (libtorch's kernel multiplies the
// cropped positions by zero too: an Inf at x[0] with p = 1 gives NaN there
// as well), through at::convolution_backward with padding 0 on the sharded
// dims. Every pair is formed exactly once, on the input's owner, as in
// libtorch's one call; the gradient is then summed over the mesh as before
// (use_replicated). Cost: one more halo exchange of the output gradient in
// backward (the forward's reach, transposed) and a weight-gradient
// convolution of the piece instead of the halo-extended one. Under
// create_graph it steps aside (ConvTransposeFn's rebuilt forward gives the
// weight gradient, as before, so second derivatives stay exact); in any
// pass without create_graph, the second-order one included, it is the one
// that gives the weight its share of the output's gradient. Open: the split
// path keeps its own weight gradient. Dropping it (an identity on the
// weight) also drops the second-order term d(grad_x)/d(weight), which
// reaches the weight through the same node in the second pass
// (DoubleBackward.ConvTransposeAndPool1d failed that way), so its non-finite
// positions can still differ from libtorch's (tests run the general path
// with SHARDTENSOR_TCONV_SPLIT=0).
//
// Note [split-phase transposed convolution]: where it applies, the forward
// makes no copy of the input piece and over-computes nothing beyond a few
// boundary rows (issue 13). Decided from global metadata only (split_plan:
// the spec, the shard sizes and the op's arguments), so every rank takes the
// same path: every piece of every sharded dim (batch included) and every
// output block non-empty, and along every sharded spatial dim every output
// block with a non-empty interior. Any number of spatial dims may be sharded
// (the 2x2 mesh with {S2, S3}: below). Along a sharded dim, with the piece
// [off, off + n) and its block [o0, o0 + cnt), libtorch's transposed kernel
// on the piece alone (padding q, output_padding t) computes the window
// [off*s - p + q, (off + n - 1)*s - p + d(k-1) + 1 - q + t) of the global
// output, each value summed over the LOCAL inputs only; the interior
// [ia, ib) is where that sum is the whole sum: outputs whose inputs
// [ceil((o + p - d(k-1))/s), floor((o + p)/s)] all lie in the piece (or past
// a global edge). Then:
//  - post comm::gather_range_start of the halo rows only: left of the piece
//    [min(lo, off), off) and right [off + n, max(hi, off + n)), with [lo, hi)
//    the inputs the block reads (clamped to [0, N)); none when no coordinate
//    needs any (stride = kernel, padding 0: ConvTranspose2d(k=2, s=2) with a
//    block that is s times the piece, no exchange at all);
//  - while they travel, run libtorch's kernel on the local piece. When
//    q = o0 - (off*s - p) >= 0 and some valid t make its window exactly the
//    block (k=2 s=2 p=0, k=3 s=1 p=1, k=4 s=2 p=1 on s-times blocks), that
//    output IS the block and the boundary rows are written into it in place;
//    otherwise q = min(ia - window start, window end - ib) crops what it can
//    and the interior rows are copied into a block-sized output;
//  - finish, and compute the boundary rows [o0, ia) and [ib, o0 + cnt) from
//    strips: the input rows they read (halo rows + the local edge rows,
//    zero rows past what they read so that the strip's window starts on the
//    global grid), through libtorch's kernel with padding 0 on that dim;
//    the strip output's rows are copied into the block.
// With D sharded spatial dims (as the split-phase pool, Note [split-phase
// pool]) the halo-extended piece is a 3^D arrangement of blocks: level 1
// (a halo on one dim) gathered from the piece, the corners (level l) from a
// level l-1 block once it arrived; the wrong outputs are split into disjoint
// boxes: along sharded dim j its boundary rows, crossed with all rows of
// earlier sharded dims and the interior rows of later ones (box j reads only
// blocks of levels <= j + 1, so it runs while the next level travels).
// Backward is libtorch's own: the forward above runs under autograd
// (convolution on the piece, on the strips, gather_range_start's result
// differentiable through the halo adjoint), which saves the piece itself,
// the weight and the small strips, never a halo-extended copy; the
// over-computed interior output is not kept (copy_ into slices saves
// nothing). Double backward follows from libtorch's. Every output element is
// written once, so the bias is added once. A halo block that no strip of
// this rank reads is still attached to the output by an empty in-place copy,
// so its adjoint (collective over the mesh dim) runs on every rank.
// SHARDTENSOR_TCONV_SPLIT=0 turns the split path off (for comparisons; the
// tests SplitPhaseTconvHoldsNoPieceCopy and TconvStrideEqualsKernelSendsNothing
// then fail). Measured (a tiny driver, [1,32,512,512] -> ConvTranspose2d(32,
// 16, k, s, p) with bias, H sharded, P = 2, float32, per rank; before = off):
//   k=2 s=2 p=0: forward sends 65536 -> 0 B, backward 139328 -> 8256 B (the
//     weight/bias all-reduce only); forward peak 86.7 -> 69.2 MB, backward
//     peak 101.5 -> 50.3 MB;
//   k=3 s=1 p=1: forward 65536 B both, backward 149568 -> 84032 B (no
//     rebuilt gather); forward peak 102.0 -> 84.6 MB;
//   k=4 s=2 p=1: same bytes as k=3; forward peak 188.2 -> 170.1 MB;
// saved for backward beyond the output: 0 -> 0.20 MB (the strips). Times at
// load 13-14 on 2 shared cores, indicative only: forward 396-454 -> 230-276
// ms (k=2), 514-540 -> 399-421 ms (k=3), 755-947 -> 615-895 ms (k=4);
// backward within noise (k=2 653-678 -> 382-491 ms). On the 2x2 mesh with
// {S2, S3} (P = 4 on the 2 cores, oversubscribed): k=2 forward 65792 -> 0 B,
// backward 143968 -> 12384 B, forward peak 43.7 -> 34.6 MB, backward peak
// 51.1 -> 25.2 MB; k=3 backward 159328 -> 93408 B; the k=3/k=4 backward
// looked slower (745-892 vs 490-694 ms, k=3), not yet measured on a quiet
// machine: the autograd graph has more nodes (a CopySlices per boundary
// box, one piece-sized adjoint gradient per halo block).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>

#include "comm/function_output.h"
#include "comm/settings.h"
#include "ops/channel_conv.h"
#include "ops/common.h"
#include "ops/conv_transpose.h"
#include "ops/halo_blocks.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct TransposedPlan {
  DeviceMesh mesh;
  std::vector<stencil::DimPlan> plans;
  bool batched = true;
  std::vector<int64_t> stride, padding, output_padding, dilation;  // of the local call
  int64_t groups = 1;
  bool has_bias = false;
  int64_t bias_size = 0;
  bool exact_w = false;  // Note [transposed convolution weight gradient]: first order elsewhere
  std::vector<int64_t> out_local;                  // the block, as returned
  std::vector<std::pair<int64_t, int64_t>> block;  // (batched dim, start) per sharded dim
};

struct TransposedPlanHolder : torch::CustomClassHolder {
  explicit TransposedPlanHolder(std::shared_ptr<const TransposedPlan> p) : plan(std::move(p)) {}
  std::shared_ptr<const TransposedPlan> plan;
};

bool any_zero(c10::IntArrayRef s) {
  for (int64_t v : s) {
    if (v == 0) return true;
  }
  return false;
}

// Collective over the planned mesh dims: the local input extended to the
// range its output block reads, batched.
at::Tensor gather_batched(const at::Tensor& local, const TransposedPlan& p) {
  at::Tensor g = stencil::gather_plans(local, p.mesh, p.plans, PadMode::Constant, 0.0);
  return p.batched ? g : g.unsqueeze(0);
}

// The local transposed convolution of the gathered input: the over-computed
// output (batched).
at::Tensor transposed_full(const at::Tensor& gb, const at::Tensor& w, const at::Tensor& b,
                           const TransposedPlan& p) {
  return at::convolution(gb, w, p.has_bias ? b : at::Tensor(), p.stride, p.padding, p.dilation,
                         true, p.output_padding, p.groups);
}

at::Tensor block_of(at::Tensor full, const TransposedPlan& p) {
  for (const auto& [dim, start] : p.block) {
    full = full.narrow(dim, start, p.out_local[p.batched ? dim : dim - 1]);
  }
  return p.batched ? full : full.squeeze(0);
}

// Hand-written (Note [transposed convolution memory]); it communicates only through the
// gather of ops/stencil.h and its adjoint.
struct ConvTransposeFn : torch::autograd::Function<ConvTransposeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, const at::Tensor& weight,
                            const at::Tensor& bias, std::shared_ptr<const TransposedPlan> plan) {
    const TransposedPlan& p = *plan;
    at::Tensor gb = gather_batched(local, p);
    at::Tensor out;
    if (any_zero(p.out_local) || any_zero(gb.sizes())) {
      out = at::zeros(p.out_local, local.options());
    } else {
      out = block_of(transposed_full(gb, weight, bias, p), p).contiguous();
    }
    ctx->save_for_backward({local, weight, p.has_bias ? bias : at::Tensor()});
    ctx->saved_data["plan"] =
        c10::IValue::make_capsule(c10::make_intrusive<TransposedPlanHolder>(plan));
    // Not a view (Note [function outputs are not views]): the block may be
    // all of the local output, or its unbatched squeeze.
    return comm::function_output(out, {local, weight, bias});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("ConvTransposeFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& local = saved[0];
    const at::Tensor& weight = saved[1];
    const auto& p =
        *static_cast<TransposedPlanHolder*>(ctx->saved_data.at("plan").toCapsule().get())->plan;
    const bool need_in = ctx->needs_input_grad(0);
    // Note [transposed convolution weight gradient]: in first order
    // TconvWeightGradFn gives the weight its gradient.
    const bool need_w = ctx->needs_input_grad(1) && (!p.exact_w || at::GradMode::is_enabled());
    const bool need_b = p.has_bias && ctx->needs_input_grad(2);
    const at::Tensor go = grads[0].defined() ? grads[0] : at::zeros(p.out_local, local.options());

    if (at::GradMode::is_enabled()) {
      // create_graph: differentiate the rebuilt forward (collective on every rank).
      at::Tensor gb = gather_batched(local, p);
      at::Tensor out;
      if (any_zero(p.out_local) || any_zero(gb.sizes())) {
        at::Tensor link = gb.sum() + weight.sum();
        if (p.has_bias) link = link + saved[2].sum();
        out = at::zeros(p.out_local, local.options()) + link * 0;
      } else {
        out = block_of(transposed_full(gb, weight, saved[2], p), p);
      }
      std::vector<at::Tensor> inputs;
      if (need_in) inputs.push_back(local);
      if (need_w) inputs.push_back(weight);
      if (need_b) inputs.push_back(saved[2]);
      at::Tensor gx, gw, gbias;
      if (!inputs.empty()) {
        auto r = torch::autograd::grad({out}, inputs, {go}, /*retain_graph=*/true,
                                       /*create_graph=*/true, /*allow_unused=*/true);
        size_t i = 0;
        if (need_in) gx = r[i++];
        if (need_w) gw = r[i++];
        if (need_b) gbias = r[i++];
      }
      return {gx, gw, gbias, at::Tensor()};
    }

    // Rebuild the gathered input (collective on every rank, whatever it needs).
    c10::AutoGradMode enable(true);
    at::Tensor x_in = local.detach();
    if (need_in) x_in.requires_grad_(true);
    at::Tensor g = stencil::gather_plans(x_in, p.mesh, p.plans, PadMode::Constant, 0.0);
    at::Tensor gb = p.batched ? g : g.unsqueeze(0);
    at::Tensor gx, gw, gbias;
    if (any_zero(p.out_local) || any_zero(gb.sizes())) {
      if (need_in) gx = at::zeros_like(gb);
      if (need_w) gw = at::zeros_like(weight);
      if (need_b) gbias = at::zeros({p.bias_size}, weight.options());
    } else {
      // The block's gradient placed into the over-computed output's shape.
      std::vector<int64_t> full_shape{gb.size(0), weight.size(1) * p.groups};
      for (size_t i = 0; i < p.stride.size(); ++i) {
        full_shape.push_back((gb.size(2 + i) - 1) * p.stride[i] - 2 * p.padding[i] +
                             p.dilation[i] * (weight.size(2 + i) - 1) + p.output_padding[i] + 1);
      }
      at::Tensor gfull = at::zeros(full_shape, go.options());
      block_of(gfull, p).copy_(go);
      const std::vector<int64_t> bs{p.bias_size};
      at::OptionalIntArrayRef bias_sizes = c10::nullopt;
      if (p.has_bias) bias_sizes = at::IntArrayRef(bs);
      std::tie(gx, gw, gbias) = at::convolution_backward(
          gfull, gb.detach(), weight.detach(), bias_sizes, p.stride, p.padding, p.dilation, true,
          p.output_padding, p.groups, {need_in, need_w, need_b});
    }
    at::Tensor grad_local;
    if (need_in) {
      if (!p.batched) gx = gx.squeeze(0);
      // The adjoint of the gather: halo gradients go back to their owners.
      grad_local = g.is_same(x_in) ? gx : torch::autograd::grad({g}, {x_in}, {gx})[0];
    }
    return {grad_local, need_w ? gw : at::Tensor(), need_b ? gbias : at::Tensor(), at::Tensor()};
  }
};

// Note [transposed convolution weight gradient]: the gradient's gather and
// the local weight-gradient call.
struct WeightGradPlan {
  DeviceMesh mesh;
  std::vector<stencil::DimPlan> plans;  // over the output gradient
  bool batched = true;
  std::vector<int64_t> stride, padding, output_padding, dilation;  // of the local call
  int64_t groups = 1;
  std::vector<int64_t> out_local;  // the block's shape
};

struct WeightGradPlanHolder : torch::CustomClassHolder {
  explicit WeightGradPlanHolder(std::shared_ptr<const WeightGradPlan> p) : plan(std::move(p)) {}
  std::shared_ptr<const WeightGradPlan> plan;
};

// Collective over the planned mesh dims: this rank's share of the weight
// gradient (Note [transposed convolution weight gradient]).
at::Tensor exact_weight_grad(const at::Tensor& go, const at::Tensor& local,
                             const at::Tensor& weight, const WeightGradPlan& p) {
  at::Tensor g = stencil::gather_plans(go, p.mesh, p.plans, PadMode::Constant, 0.0);
  at::Tensor gb = p.batched ? g : g.unsqueeze(0);
  at::Tensor xb = p.batched ? local : local.unsqueeze(0);
  if (any_zero(gb.sizes()) || any_zero(xb.sizes())) return at::zeros_like(weight);
  return std::get<1>(at::convolution_backward(gb, xb, weight, c10::nullopt, p.stride, p.padding,
                                              p.dilation, true, p.output_padding, p.groups,
                                              {false, true, false}));
}

// Hand-written: the identity on the output, whose backward also gives the
// weight its exact first-order gradient (Note [transposed convolution weight
// gradient]); collective over the planned mesh dims in backward.
struct TconvWeightGradFn : torch::autograd::Function<TconvWeightGradFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& weight,
                            const at::Tensor& local, std::shared_ptr<const WeightGradPlan> plan) {
    ctx->save_for_backward({local, weight});
    ctx->saved_data["plan"] =
        c10::IValue::make_capsule(c10::make_intrusive<WeightGradPlanHolder>(std::move(plan)));
    return out;  // returned input: autograd makes it a view with this node as grad_fn
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return ::shardtensor::ops::carried_backward("TconvWeightGradFn::backward", ctx,
                                                std::move(grads), &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    // The same graph and grad mode, hence the same branch, on every rank.
    if (at::GradMode::is_enabled() || !ctx->needs_input_grad(1)) {
      return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto saved = ctx->get_saved_variables();
    const auto& p =
        *static_cast<WeightGradPlanHolder*>(ctx->saved_data.at("plan").toCapsule().get())->plan;
    const at::Tensor go =
        grads[0].defined() ? grads[0] : at::zeros(p.out_local, saved[0].options());
    at::Tensor gw = exact_weight_grad(go, saved[0], saved[1], p);
    return {grads[0], gw, at::Tensor(), at::Tensor()};
  }
};

// Note [split-phase transposed convolution]: one sharded spatial dim's geometry.
struct SplitTconv {
  int64_t si = 0;        // index among the spatial dims
  int64_t dim = 0;       // batched tensor dim
  int64_t mesh_dim = 0;  // the mesh dim that shards it
  int64_t N = 0;         // global input extent
  std::vector<int64_t> in_sizes;
  std::vector<stencil::Range> left, right;  // per coordinate: halo rows left / right of the piece
  bool any_left = false, any_right = false;
  int64_t me = 0;                                           // this rank's coordinate
  int64_t off = 0, n = 0, o0 = 0, cnt = 0, ia = 0, ib = 0;  // this rank
  // The global input rows [first, second) of side v (0 left halo, 1 piece, 2 right halo).
  stencil::Range span(int64_t v) const {
    return v == 0 ? left[me] : (v == 2 ? right[me] : stencil::Range{off, off + n});
  }
};

struct TconvArgs {
  std::vector<int64_t> stride, pad, opad, dil, kernel;
  int64_t groups = 1;
};

// The window of global outputs that libtorch's transposed kernel on inputs
// [i0, i0 + m) computes with padding 0 and output_padding 0 along dim i:
// [i0*s - p, (i0 + m - 1)*s - p + d(k-1) + 1).
stencil::Range local_window(const TconvArgs& a, int64_t i, int64_t i0, int64_t m) {
  return {i0 * a.stride[i] - a.pad[i],
          (i0 + m - 1) * a.stride[i] - a.pad[i] + a.dil[i] * (a.kernel[i] - 1) + 1};
}

// Global metadata only, so every rank decides alike. One entry per sharded
// spatial dim, in tensor-dim order.
std::optional<std::vector<SplitTconv>> split_plan(const ShardSpec& spec,
                                                  const std::vector<stencil::DimPlan>& plans,
                                                  const TconvArgs& a, int64_t first_sp,
                                                  bool batched) {
  // Note [agreed settings]: read where every rank takes the same path.
  if (plans.empty() || !comm::use_setting(spec.mesh(), Setting::TconvSplit)) return std::nullopt;
  for (int64_t e : spec.global_shape()) {
    if (e == 0) return std::nullopt;
  }
  for (int64_t m = 0; m < spec.mesh().ndim(); ++m) {
    if (!is_shard(spec.placements()[m])) continue;
    for (int64_t sz : spec.shard_sizes(m)) {
      if (sz == 0) return std::nullopt;
    }
  }
  std::vector<SplitTconv> out;
  for (const stencil::DimPlan& pl : plans) {
    SplitTconv sp;
    sp.si = pl.dim - first_sp;
    sp.dim = batched ? pl.dim : pl.dim + 1;
    sp.mesh_dim = pl.mesh_dim;
    sp.in_sizes = pl.in_sizes;
    sp.me = spec.mesh().coordinate()[pl.mesh_dim];
    for (int64_t v : pl.in_sizes) sp.N += v;
    const int64_t i = sp.si, s = a.stride[i], p = a.pad[i], span = a.dil[i] * (a.kernel[i] - 1);
    int64_t off = 0, o0 = 0;
    for (size_t c = 0; c < pl.in_sizes.size(); ++c) {
      const int64_t n = pl.in_sizes[c], cnt = pl.out_sizes[c];
      if (n == 0 || cnt == 0) return std::nullopt;
      const auto [w0, w1] = local_window(a, i, off, n);
      int64_t ia = std::max(o0, w0), ib = std::min(o0 + cnt, w1);
      if (off > 0) ia = std::max(ia, (off - 1) * s + 1 - p + span);  // reads no input < off
      if (off + n < sp.N) ib = std::min(ib, (off + n) * s - p);      // reads no input >= off + n
      if (ia >= ib) return std::nullopt;
      const int64_t lo = std::max<int64_t>(0, div_ceil(o0 + p - span, s));
      const int64_t hi = std::min(sp.N, div_floor(o0 + cnt - 1 + p, s) + 1);
      sp.left.emplace_back(std::min(lo, off), off);
      sp.right.emplace_back(off + n, std::max(hi, off + n));
      sp.any_left = sp.any_left || lo < off;
      sp.any_right = sp.any_right || hi > off + n;
      if (static_cast<int64_t>(c) == sp.me) {
        sp.off = off;
        sp.n = n;
        sp.o0 = o0;
        sp.cnt = cnt;
        sp.ia = ia;
        sp.ib = ib;
      }
      off += n;
      o0 += cnt;
    }
    out.push_back(std::move(sp));
  }
  return out;
}

// Note [split-phase transposed convolution]: the forward, under autograd.
// `x` is the batched local piece; returns the batched block of shape
// `out_shape`. With D sharded dims the halo-extended piece is a 3^D
// arrangement of blocks (Note [halo blocks]): level 1 (one halo side) is
// gathered from the piece, level l from a level l-1 block (the corners), as
// the previous level arrives.
at::Tensor split_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const std::vector<SplitTconv>& sd, const TconvArgs& a,
                         const DeviceMesh& mesh, const std::vector<int64_t>& out_shape) {
  const int64_t D = static_cast<int64_t>(sd.size());
  // Note [halo blocks].
  std::vector<stencil::BlockDim> bd;
  for (const auto& d : sd)
    bd.push_back({d.dim, d.mesh_dim, d.in_sizes, d.left, d.right, d.off, d.n});
  stencil::HaloBlocks hb(x, mesh, std::move(bd), PadMode::Constant, 0.0);
  hb.start_level(1);
  // Interior: libtorch's kernel on the piece, cropped by padding q per dim.
  std::vector<int64_t> pad = a.pad, opad = a.opad, start(D);
  bool exact = true;
  for (int64_t j = 0; j < D; ++j) {
    const SplitTconv& dj = sd[j];
    const int64_t i = dj.si;
    const auto [w0, w1] = local_window(a, i, dj.off, dj.n);
    int64_t q = dj.o0 - w0, t = dj.o0 + dj.cnt - (w1 - q);
    if (!(q >= 0 && t >= 0 && t < std::max(a.stride[i], a.dil[i]) && w1 - w0 - 2 * q >= 1)) {
      exact = false;
      q = std::min(dj.ia - w0, w1 - dj.ib);
      t = 0;
    }
    pad[i] = q;
    opad[i] = t;
    start[j] = w0 + q;
  }
  hb.test();
  at::Tensor inner = at::convolution(x, w, b, a.stride, pad, a.dil, true, opad, a.groups);
  at::Tensor out;
  if (exact) {
    TORCH_INTERNAL_ASSERT(inner.sizes() == at::IntArrayRef(out_shape));
    out = inner;
  } else {
    out = at::empty(out_shape, inner.options());
    at::Tensor dst = out, src = inner;
    for (int64_t j = 0; j < D; ++j) {
      const SplitTconv& dj = sd[j];
      dst = dst.narrow(dj.dim, dj.ia - dj.o0, dj.ib - dj.ia);
      src = src.narrow(dj.dim, dj.ia - start[j], dj.ib - dj.ia);
    }
    dst.copy_(src);
  }
  inner = at::Tensor();
  for (const SplitTconv& dj : sd) {
    pad[dj.si] = 0;
    opad[dj.si] = 0;
  }
  // A strip's rows along each dim: segments of zero rows (side -1) or of a side's rows.
  using Seg = std::pair<int64_t, stencil::Range>;
  std::vector<std::vector<Seg>> segs(D);
  std::vector<Seg> choice(D);
  std::function<at::Tensor(int64_t)> build = [&](int64_t r) -> at::Tensor {
    if (r == D) {
      bool zero = false;
      int64_t blk = 0;
      std::vector<int64_t> shape = x.sizes().vec();
      for (int64_t j = 0; j < D; ++j) {
        zero = zero || choice[j].first < 0;
        blk = blk * 3 + (choice[j].first < 0 ? 1 : choice[j].first);
        shape[sd[j].dim] = choice[j].second.second - choice[j].second.first;
      }
      if (zero) return at::zeros(shape, x.options());
      at::Tensor t = hb.use(blk);
      for (int64_t j = 0; j < D; ++j) {
        const auto& [v, rg] = choice[j];
        t = t.narrow(sd[j].dim, rg.first - sd[j].span(v).first, rg.second - rg.first);
      }
      return t;
    }
    std::vector<at::Tensor> parts;
    for (const Seg& sg : segs[r]) {
      choice[r] = sg;
      parts.push_back(build(r + 1));
    }
    return parts.size() == 1 ? parts[0] : at::cat(parts, sd[r].dim);
  };
  for (int64_t l = 1; l <= D; ++l) {
    hb.finish_level(l);
    if (l < D) hb.start_level(l + 1);
    // Box of dim j = l - 1: its boundary outputs, all outputs of earlier
    // sharded dims, the interior of later ones (each output in one box; it
    // reads only blocks of levels <= l).
    const int64_t j = l - 1;
    for (const stencil::Range& ob :
         {stencil::Range{sd[j].o0, sd[j].ia}, stencil::Range{sd[j].ib, sd[j].o0 + sd[j].cnt}}) {
      if (ob.first >= ob.second) continue;
      std::vector<int64_t> first(D);  // the strip's first global output, per dim
      std::vector<stencil::Range> outs(D);
      for (int64_t r = 0; r < D; ++r) {
        const SplitTconv& dr = sd[r];
        const int64_t i = dr.si, s = a.stride[i], p = a.pad[i];
        const int64_t span = a.dil[i] * (a.kernel[i] - 1);
        outs[r] = r < j    ? stencil::Range{dr.o0, dr.o0 + dr.cnt}
                  : r == j ? ob
                           : stencil::Range{dr.ia, dr.ib};
        const int64_t o0 = outs[r].first, o1 = outs[r].second;
        // Strip rows [ll, hh): its window starts at or before o0 and ends at
        // or after o1; only rows [sl, sh) are read by these outputs, the
        // others are zeros.
        const int64_t ll = div_floor(o0 + p - span, s), hh = div_ceil(o1 - 1 + p, s) + 1;
        int64_t sl = std::max<int64_t>(0, div_ceil(o0 + p - span, s));
        int64_t sh = std::min(dr.N, div_floor(o1 - 1 + p, s) + 1);
        if (sl >= sh) sl = sh = ll;
        TORCH_INTERNAL_ASSERT(sl >= sh || (sl >= dr.span(0).first && sh <= dr.span(2).second));
        segs[r].clear();
        if (sl > ll) segs[r].push_back({-1, {ll, sl}});
        for (int64_t v = 0; v < 3; ++v) {
          const auto sp = dr.span(v);
          const int64_t lo = std::max(sl, sp.first), hi = std::min(sh, sp.second);
          if (lo < hi) segs[r].push_back({v, {lo, hi}});
        }
        if (hh > std::max(sh, ll)) segs[r].push_back({-1, {std::max(sh, ll), hh}});
        first[r] = ll * s - p;
      }
      const at::Tensor strip = build(0);
      const at::Tensor so =
          at::convolution(strip, w, b, a.stride, pad, a.dil, true, opad, a.groups);
      at::Tensor dst = out, src = so;
      for (int64_t r = 0; r < D; ++r) {
        const int64_t len = outs[r].second - outs[r].first;
        TORCH_INTERNAL_ASSERT(first[r] <= outs[r].first &&
                              first[r] + so.size(sd[r].dim) >= outs[r].second);
        dst = dst.narrow(sd[r].dim, outs[r].first - sd[r].o0, len);
        src = src.narrow(sd[r].dim, outs[r].first - first[r], len);
      }
      dst.copy_(src);
    }
  }
  // A received block that no strip read still runs its adjoint in backward
  // (collective over its mesh dim): attached by an empty in-place copy.
  for (int64_t blk = 0; blk < hb.count(); ++blk) {
    if (!hb.exchanged(blk) || hb.used(blk)) continue;
    at::Tensor dst = out.narrow(sd[0].dim, 0, 0);
    dst.copy_(hb.block(blk).sum().to(dst.scalar_type()).expand(dst.sizes()));
  }
  return out;
}

std::vector<int64_t> expand(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                            std::vector<int64_t> v, int64_t nd, const char* what) {
  if (v.size() == 1) return std::vector<int64_t>(nd, v[0]);
  if (static_cast<int64_t>(v.size()) != nd) {
    fail(op, args, std::string(what) + " must have 1 or " + std::to_string(nd) + " elements");
  }
  return v;
}

// Where a transposed convolution's arguments sit: conv_transpose{1,2,3}d
// (input, weight, bias, stride, padding, output_padding, groups, dilation) or
// convolution / _convolution (input, weight, bias, stride, padding, dilation,
// transposed, output_padding, groups, ...).
struct TconvArgIndex {
  size_t stride, pad, opad, groups, dil;
};
constexpr TconvArgIndex kConvTransposeArgs{3, 4, 5, 6, 7};
constexpr TconvArgIndex kConvolutionArgs{3, 4, 7, 8, 5};

void conv_transpose_rule(const c10::OperatorHandle& op, std::vector<c10::IValue> args, Stack* stack,
                         int64_t nd, const TconvArgIndex& ix) {
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& w = args[1].toTensor();
  const at::Tensor b = args[2].isNone() ? at::Tensor() : args[2].toTensor();
  const ShardSpec* xs = spec_of(x);
  if (!xs) fail(op, args, "the input must be a ShardTensor (sharded weights are not supported)");
  // Note [complex convolution] (src/ops/conv.cpp): refused on every rank.
  if (x.is_complex() || w.is_complex() || (b.defined() && b.is_complex())) {
    fail(op, args,
         "complex convolution is not supported on ShardTensors (Note [complex convolution]); "
         "convolve the real and imaginary parts");
  }
  // Note [reduced precision]: libtorch's verdict on these dtypes, before any
  // communication.
  check_dtype_support(
      op, args, nd == 1 ? "conv_transpose1d" : (nd == 2 ? "conv_transpose2d" : "conv_transpose3d"),
      {x.scalar_type(), w.scalar_type(), dtype_or_none(b)},
      will_backward(x) || will_backward(w) || will_backward(b),
      [nd](c10::ArrayRef<at::ScalarType> t, bool rg) {
        std::vector<int64_t> xs{1, 2}, ws{2, 2};
        for (int64_t i = 0; i < nd; ++i) {
          xs.push_back(2);
          ws.push_back(2);
        }
        const std::vector<int64_t> one(nd, 1), zero(nd, 0);
        return at::convolution(probe_ones(xs, t[0], rg), probe_ones(ws, t[1]),
                               probe_ones({2}, t[2]), one, zero, one, true, zero, 1);
      });
  const auto stride = expand(op, args, int_list(args[ix.stride]), nd, "stride");
  const auto pad = expand(op, args, int_list(args[ix.pad]), nd, "padding");
  const auto opad = expand(op, args, int_list(args[ix.opad]), nd, "output_padding");
  const int64_t groups = args[ix.groups].toInt();
  const auto dil = expand(op, args, int_list(args[ix.dil]), nd, "dilation");

  const std::vector<int64_t>& shape = xs->global_shape();
  const int64_t ndim = static_cast<int64_t>(shape.size());
  if (ndim != nd + 1 && ndim != nd + 2) {
    fail(op, args,
         "expected a " + std::to_string(nd + 1) + "-d or " + std::to_string(nd + 2) + "-d input");
  }
  if (w.dim() != nd + 2) fail(op, args, "weight must have " + std::to_string(nd + 2) + " dims");
  const int64_t cdim = ndim - nd - 1;
  if (groups <= 0 || w.size(0) != shape[cdim] || shape[cdim] % groups != 0) {
    fail(op, args, "weight/input channel mismatch");
  }
  const int64_t cout = w.size(1) * groups;
  if (b.defined() && (b.dim() != 1 || b.size(0) != cout)) fail(op, args, "bad bias shape");
  const ShardSpec in_spec = without_partial(*xs);
  std::vector<int64_t> spatial, in_ext, out_ext, kernel;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t d = ndim - nd + i;
    int64_t nshard = 0;
    for (const auto& pl : in_spec.placements()) nshard += shard_dim(pl) == d ? 1 : 0;
    if (nshard > 1) fail(op, args, "a spatial dim sharded over several mesh dims is not supported");
    spatial.push_back(d);
    in_ext.push_back(shape[d]);
    kernel.push_back(w.size(2 + i));
    if (stride[i] <= 0 || dil[i] <= 0 || pad[i] < 0 || opad[i] < 0 ||
        opad[i] >= std::max(stride[i], dil[i])) {
      fail(op, args, "invalid stride/padding/output_padding/dilation");
    }
    const int64_t o =
        (in_ext[i] - 1) * stride[i] - 2 * pad[i] + dil[i] * (kernel[i] - 1) + opad[i] + 1;
    if (o <= 0) fail(op, args, "output size is too small");
    out_ext.push_back(o);
  }

  // Note [plain fast path]: nothing but the batch dim is sharded over more than one rank.
  if (runs_plain(*xs, local_of(x),
                 ndim == nd + 2 ? std::vector<int64_t>{0} : std::vector<int64_t>{})) {
    return call_plain(op, std::move(args), stack);
  }

  // Note [channel-sharded transposed convolution]: the compute layout (the
  // channel dim replicated) and, when the input channels are split and
  // groups == 1, the channel mesh dim; a grouped one replicates the channels
  // (a visible gather).
  const ChannelLayout layout = channel_layout(op, args, in_spec, cdim, groups, x.element_size(),
                                              "conv_transpose replicates a channel-sharded input");
  const ShardSpec& compute = layout.compute;

  // Plans (Note [transposed convolution halos]).
  std::vector<stencil::DimPlan> plans;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t m = in_spec.mesh_dim_of(spatial[i]);
    if (m < 0) continue;
    stencil::DimPlan pl;
    pl.dim = spatial[i];
    pl.mesh_dim = m;
    pl.in_sizes = in_spec.shard_sizes(m);
    pl.out_sizes = stencil::output_sizes(pl.in_sizes, out_ext[i]);
    int64_t o0 = 0;
    for (int64_t cnt : pl.out_sizes) {
      const int64_t lo = div_floor(o0 + pad[i] - dil[i] * (kernel[i] - 1), stride[i]);
      const int64_t hi =
          cnt == 0 ? lo : -div_floor(-(o0 + cnt - 1 + pad[i]), stride[i]) + 1;  // ceil + 1
      pl.ranges.emplace_back(lo, hi);
      o0 += cnt;
    }
    plans.push_back(std::move(pl));
  }

  // Communication starts here (all validation above is metadata only).
  const bool channel = layout.ch_dim >= 0;
  at::Tensor local = to_layout(x, layout.input, layout.input);
  const DeviceMesh& mesh = in_spec.mesh();
  const Placements rep(mesh.ndim(), Replicate{});
  at::Tensor wl = channel ? channel_weight(w, layout, /*w_in_dim=*/0)
                          : to_layout(w, ShardSpec(mesh, rep, w.sizes().vec()), compute);
  // Note [channel-sharded transposed convolution]: the bias is added after the sum.
  at::Tensor bl = b.defined() && !channel
                      ? to_layout(b, ShardSpec(mesh, rep, b.sizes().vec()), compute)
                      : at::Tensor();

  std::vector<int64_t> oshape = shape;
  oshape[cdim] = cout;
  for (int64_t i = 0; i < nd; ++i) oshape[spatial[i]] = out_ext[i];
  // Every output channel (with the channels split: this rank's partial sum).
  SpecPtr out_spec = stencil::output_spec(compute, oshape, plans);
  const auto out_off = out_spec->local_offsets();

  // Note [transposed convolution memory].
  auto plan = std::make_shared<TransposedPlan>();
  plan->mesh = mesh;
  plan->batched = ndim == nd + 2;
  plan->stride = stride;
  plan->padding = pad;
  plan->output_padding = opad;
  plan->dilation = dil;
  plan->groups = groups;
  plan->out_local = out_spec->local_shape();
  for (const auto& pl : plans) {
    const int64_t i = pl.dim - (ndim - nd);
    plan->padding[i] = 0;
    plan->output_padding[i] = 0;
    const int64_t lo = stencil::my_range(pl, mesh).first;
    plan->block.emplace_back(plan->batched ? pl.dim : pl.dim + 1,
                             out_off[pl.dim] - (lo * stride[i] - pad[i]));
  }
  // Note [transposed convolution weight gradient]: the gradient's window
  // per input piece.
  std::shared_ptr<WeightGradPlan> wplan;
  if (at::GradMode::is_enabled() && wl.requires_grad()) {
    wplan = std::make_shared<WeightGradPlan>();
    wplan->mesh = mesh;
    wplan->batched = plan->batched;
    wplan->stride = stride;
    wplan->padding = pad;
    wplan->output_padding = opad;
    wplan->dilation = dil;
    wplan->groups = groups;
    wplan->out_local = plan->out_local;
    for (const auto& pl : plans) {
      const int64_t i = pl.dim - (ndim - nd);
      wplan->padding[i] = 0;
      wplan->output_padding[i] = 0;
      stencil::DimPlan gp;
      gp.dim = pl.dim;
      gp.mesh_dim = pl.mesh_dim;
      gp.in_sizes = pl.out_sizes;
      gp.out_sizes = pl.in_sizes;
      int64_t off = 0;
      for (int64_t n : pl.in_sizes) {
        const int64_t lo = off * stride[i] - pad[i];
        const int64_t hi = n == 0 ? lo : lo + (n - 1) * stride[i] + dil[i] * (kernel[i] - 1) + 1;
        gp.ranges.emplace_back(lo, hi);
        off += n;
      }
      wplan->plans.push_back(std::move(gp));
    }
  }
  // Note [split-phase transposed convolution].
  TconvArgs targs{stride, pad, opad, dil, kernel, groups};
  at::Tensor out;
  if (auto sp = split_plan(layout.input, plans, targs, ndim - nd, plan->batched)) {
    std::vector<int64_t> bshape = plan->out_local;
    if (!plan->batched) bshape.insert(bshape.begin(), 1);
    // Note [transposed convolution weight gradient]: not on this path (yet).
    wplan = nullptr;
    out =
        split_forward(plan->batched ? local : local.unsqueeze(0), wl, bl, *sp, targs, mesh, bshape);
    if (!plan->batched) out = out.squeeze(0);
  } else {
    plan->plans = std::move(plans);
    // torch::autograd::Function cannot take an undefined tensor: no bias is an
    // empty placeholder (the plan says whether there is one).
    plan->has_bias = bl.defined();
    plan->bias_size = bl.defined() ? bl.size(0) : 0;
    if (!bl.defined()) bl = at::empty({0}, wl.options());
    plan->exact_w = wplan != nullptr;
    out = ConvTransposeFn::apply(local, wl, bl, std::shared_ptr<const TransposedPlan>(plan));
  }
  if (wplan) {
    out = TconvWeightGradFn::apply(out, wl, local, std::shared_ptr<const WeightGradPlan>(wplan));
  }
  // Note [channel-sharded transposed convolution]: sum over the channel
  // pieces, split the output channels, then the bias.
  stack->push_back(channel ? channel_output(out, b, *out_spec, layout, cdim) : wrap(out, out_spec));
}

const RuleRegistrar r1({"conv_transpose1d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, pop_args(op, s), s, 1, kConvTransposeArgs);
});
const RuleRegistrar r2({"conv_transpose2d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, pop_args(op, s), s, 2, kConvTransposeArgs);
});
const RuleRegistrar r3({"conv_transpose3d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, pop_args(op, s), s, 3, kConvTransposeArgs);
});

}  // namespace

void transposed_convolution_rule(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                                 Stack* stack) {
  const int64_t wdim = args[1].toTensor().dim();
  if (wdim < 3 || wdim > 5) fail(op, args, "expected a 3-d, 4-d or 5-d weight");
  conv_transpose_rule(op, std::move(args), stack, wdim - 2, kConvolutionArgs);
}

}  // namespace shardtensor::ops
