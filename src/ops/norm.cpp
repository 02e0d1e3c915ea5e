// Normalizations: batch_norm, instance_norm, group_norm, layer_norm.
//
// In libtorch (1.13 and 2.13 alike) torch::nn::BatchNorm{1,2,3}d, F::batch_norm
// and torch::batch_norm all reach the dispatcher as aten::batch_norm (the
// module and the functional both call torch::batch_norm); InstanceNorm*d and
// F::instance_norm as aten::instance_norm; GroupNorm as aten::group_norm;
// LayerNorm as aten::layer_norm. These four are CompositeImplicitAutograd (on
// 2.13 that is their only kernel: torch._C._dispatch_has_kernel_for_dispatch_key),
// so they reach our AutogradPrivateUse1 kernel whole (Note [dispatch]) and are
// handled here before they would decompose into _batch_norm_impl_index /
// native_batch_norm / native_group_norm / native_layer_norm (which have no
// rule and so fail naming the op, should user code call them directly).
//
// Each rule picks one of two paths from the input's spec alone:
//  - local: no mesh dim shards a dim the statistics reduce over. The op runs
//    unchanged on the local piece (exactly libtorch's numerics, including the
//    running-stat update of batch_norm and eval mode), with replicated
//    weight/bias marked by to_layout() so their gradients are summed.
//  - sharded: the statistics are merged over the mesh dims that shard a
//    reduced dim (Note [sharded moments]) and the normalization runs in
//    NormFn (Note [norm backward]).
// The channel dim (dim 1) of batch/instance/group norm must not be sharded.
//
// Note [sharded moments]: each rank first computes its LOCAL moments with the
// corrected two-pass algorithm on its piece (n_r elements per statistic):
//   m = mean(x);  d = x - m;  s1 = sum d;  s2 = sum d^2;
//   mean_r = m + s1 / n_r;  M2_r = s2 - s1^2 / n_r   (mean_r, M2_r in float64)
// which sums deviations from a value already close to the mean, so nothing
// cancels catastrophically. The ranks' moments are then merged with ONE
// all-reduce, in float64, of (n_r mean_r, M2_r + n_r mean_r^2):
//   mean = sum(n_r mean_r) / N;  M2 = sum(M2_r + n_r mean_r^2) - N mean^2.
// The subtraction in the merge cancels only relative to mean^2 in float64
// (a field with mean 1e4 and a standard deviation of 1 keeps its variance to
// ~1e-8 relative), and mean is exact to float64. For the output, mean is split
// into shift = float(mean) and delta = mean - shift, and the output is formed
// as (x - shift) * (rstd w) + (b - delta rstd w), where x - shift is exact for
// x near shift (Sterbenz), so the normalized values are accurate to a few ulps
// of the standard deviation rather than of the mean. N is the global count
// (from global shapes); empty pieces contribute zeros. One all-reduce of twice
// the statistic's size in forward.
//
// Note [norm backward]: with xhat = (x - mean) * rstd and g = dy * w,
//   dx = rstd * (g - mean_R(g) - xhat * mean_R(g * xhat)),
//   dw = sum(dy * xhat), db = sum(dy) over the dims where w broadcasts,
// where mean_R is the GLOBAL mean over the reduced dims: the two sums are
// all-reduced together (one all-reduce of twice the statistic's size). dw and
// db are this rank's partial sums; the weight went through to_layout(), whose
// use_replicated sums them over the sharded mesh dims (Note [replicated
// gradients]). NormFn saves the input, the weight and the per-statistic
// (shift, delta, rstd), as libtorch's own kernels save the input, weight and
// (mean, rstd): xhat is recomputed in backward, no full-size copy is kept.
//
// Note [norm double backward]: the closed form treats the saved statistics as
// constants, which is right for the gradient but not for its derivative. Under
// create_graph (GradMode enabled in backward) NormFn::backward instead
// recomputes y from x, w, b with differentiable pieces: the mean and the
// variance from local sums through use_replicated(all_reduce(.)) (Note
// [replicated gradients]), then y = (x - mean) rstd w + b; and returns
// torch::autograd::grad(y, {x, w, b}, dy, create_graph=true). Every rank
// recomputes the same graph (empty pieces take part with zero sums), so the
// backward collectives match. Costs two all-reduces more and autograd's
// intermediates, only when create_graph is set.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>

#include "comm/function_output.h"
#include "ops/common.h"

namespace shardtensor::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct NormPlan {
  std::vector<int64_t> dims;       // reduced dims of the (viewed) local input
  DeviceMesh mesh;                 // mesh of the input
  std::vector<int64_t> mesh_dims;  // mesh dims that shard a reduced dim
  double count = 1;                // global elements per statistic
  bool has_w = false, has_b = false;
  double eps = 0;
  bool precomputed = false;     // NormFn receives y (Note [group norm fast forward])
  bool group_backward = false;  // Note [group norm fast backward]
};

struct PlanHolder : torch::CustomClassHolder {
  explicit PlanHolder(std::shared_ptr<const NormPlan> p) : plan(std::move(p)) {}
  std::shared_ptr<const NormPlan> plan;
};

at::Tensor sum_mesh(const at::Tensor& t, const NormPlan& p) {
  if (p.mesh_dims.empty()) return t;
  return comm::all_reduce_nograd(t.contiguous(), p.mesh, p.mesh_dims, ReduceOp::Sum);
}

// The global sum over the reduced dims, differentiable, for use in per-rank
// compute (Note [norm double backward]). Collective over p.mesh_dims.
at::Tensor sum_mesh_differentiable(const at::Tensor& t, const NormPlan& p) {
  if (p.mesh_dims.empty()) return t;
  return comm::use_replicated(comm::all_reduce(t.contiguous(), p.mesh, p.mesh_dims), p.mesh,
                              p.mesh_dims);
}

// Note [norm double backward]: NormFn's forward as a differentiable graph.
at::Tensor norm_recompute(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                          const NormPlan& p) {
  const at::Tensor mean = sum_mesh_differentiable(x.sum(p.dims, true), p) / p.count;
  const at::Tensor d = x - mean;
  const at::Tensor var = sum_mesh_differentiable((d * d).sum(p.dims, true), p) / p.count;
  at::Tensor y = d * (var + p.eps).rsqrt();
  if (p.has_w) y = y * w;
  if (p.has_b) y = y + b;
  return y;
}

// Note [sharded moments]. Collective over p.mesh_dims (one all-reduce). Not differentiable.
struct Moments {
  at::Tensor shift, delta, m2;  // keepdim shapes
  at::Tensor mean64;            // the merged mean in float64
  at::Tensor mean() const { return shift + delta; }
};

// Note [group norm fast forward]: this rank's piece normalized with its own
// moments by libtorch's fused kernel. The sharded GroupNorm forward otherwise
// makes about eight passes over the piece (the corrected two-pass moments of
// Note [sharded moments], five; the shifted normalization, three) where
// libtorch's kernel makes two. at::native_group_norm (no affine, eps = 0) on
// the local piece returns y_l = (x - mean_l) rstd_l with the local (mean_l,
// rstd_l); they enter the merge as (n mean_l, n / rstd_l^2 + n mean_l^2), the
// same pack as the two-pass moments, so ranks on either path all-reduce alike.
// With the merged (mean, rstd) the output is an affine map of y_l per
// (n, channel), two in-place passes on y_l:
//   y = y_l (rstd / rstd_l) w + ((mean_l - mean) rstd w + b),
// coefficients formed in float64. y_l is libtorch's x*scale + bias form,
// accurate to a few ulps of |mean_l| rstd_l, so it is used only where that
// ratio is at most kFastNormRatio for every local statistic (and finite: a
// constant group has rstd_l = inf); elsewhere (a field whose mean is large
// against its spread, LargeMeanStability) this rank takes the two-pass path.
// The choice is per rank and changes no communication. Backward (Note [norm
// backward]) is the same either way: NormFn saves x and the merged statistics.
// float32 and float64 only.
constexpr double kFastNormRatio = 16.0;

struct LocalNorm {
  at::Tensor y;           // (x - mean_l) * rstd_l, shaped like the viewed input
  at::Tensor mean, rstd;  // keepdim statistic shapes
};

// `local` is the (N, C, *S) piece, `xv` its (N, G, C/G, *S) view. Local.
std::optional<LocalNorm> group_norm_local(const at::Tensor& local, const at::Tensor& xv,
                                          int64_t groups) {
  const auto dt = local.scalar_type();
  if ((dt != at::kFloat && dt != at::kDouble) || local.numel() == 0) return std::nullopt;
  at::NoGradGuard no_grad;
  const int64_t N = local.size(0), C = local.size(1);
  const int64_t hw = local.numel() / (N * C);
  // libtorch's CPU kernel reads the input as a contiguous buffer.
  auto r = at::native_group_norm(local.detach().contiguous(), {}, {}, N, C, hw, groups, 0.0);
  const at::Tensor &mean = std::get<1>(r), &rstd = std::get<2>(r);
  const double ratio = (mean.abs() * rstd).max().item<double>();
  if (!(ratio <= kFastNormRatio)) return std::nullopt;  // also NaN / inf
  std::vector<int64_t> stat(xv.dim(), 1);
  stat[0] = N;
  stat[1] = groups;
  return LocalNorm{std::get<0>(r).view(xv.sizes()), mean.view(stat), rstd.view(stat)};
}

Moments moments(const at::Tensor& x, const NormPlan& p, const LocalNorm* fast = nullptr) {
  at::NoGradGuard no_grad;
  // Note [reduced precision]: float16/bfloat16 statistics in float32.
  const at::Tensor xd = x.detach().to(acc_dtype(x.scalar_type()));
  double n = 1;
  for (int64_t d : p.dims) n *= static_cast<double>(xd.size(d));
  at::Tensor pack;
  if (fast) {
    // Note [group norm fast forward]: M2_r = n / rstd_l^2 (eps = 0).
    const at::Tensor mean_r = fast->mean.to(at::kDouble);
    const at::Tensor r = fast->rstd.to(at::kDouble);
    pack = at::stack({mean_r * n, n / (r * r) + mean_r * mean_r * n});
  } else if (n > 0) {
    const at::Tensor lm = xd.mean(p.dims, true);
    at::Tensor d = xd - lm;  // the only full-size temporary
    const at::Tensor s1 = d.sum(p.dims, true).to(at::kDouble);
    const at::Tensor s2 = d.mul_(d).sum(p.dims, true).to(at::kDouble);
    const at::Tensor mean_r = lm.to(at::kDouble) + s1 / n;
    const at::Tensor m2_r = s2 - s1 * s1 / n;
    pack = at::stack({mean_r * n, m2_r + mean_r * mean_r * n});
  } else {
    auto shape = xd.sum(p.dims, true).sizes().vec();
    shape.insert(shape.begin(), 2);
    pack = at::zeros(shape, xd.options().dtype(at::kDouble));
  }
  pack = sum_mesh(pack, p);
  const at::Tensor mean = pack[0] / p.count;
  Moments m;
  m.shift = mean.to(xd.scalar_type());
  m.delta = (mean - m.shift.to(at::kDouble)).to(xd.scalar_type());
  m.m2 = (pack[1] - mean * mean * p.count).clamp_min(0).to(xd.scalar_type());
  m.mean64 = mean;
  return m;
}

// Note [norm backward], fused: the same closed form in seven passes over the
// piece instead of about fourteen. With xc = x - shift (centred, so products
// stay well conditioned, Note [sharded moments]) every sum the gradients need
// comes from A = sum(dy * xc) and B = sum(dy) over the reduced dims where the
// weight is broadcast (per statistic and weight element, as libtorch's kernels
// do per (n, c)): sum(g) = sum(w B), sum(g xhat) = rstd (sum(w A) - delta
// sum(w B)), dw = sum(rstd (A - delta B)), db = sum(B); then
//   dx = (rstd w) dy + c1 xc + c0,
//   c1 = -rstd^2 sum(g xhat) / count, c0 = -rstd sum(g) / count - delta c1,
// three passes. w and b (if defined) have x's rank. Collective over p.mesh_dims when
// need_x (one all-reduce of two statistics).
variable_list fused_backward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& shift,
                             const at::Tensor& delta, const at::Tensor& rstd, const at::Tensor& dy,
                             const NormPlan& p, bool need_x, bool need_w, bool need_b,
                             const std::vector<int64_t>& b_shape, at::ScalarType b_dtype) {
  std::vector<int64_t> inner, outer;  // reduced dims where w and b are broadcast / are not
  for (int64_t d : p.dims) {
    const bool varies = (w.defined() && w.size(d) != 1) || (p.has_b && b_shape[d] != 1);
    (varies ? outer : inner).push_back(d);
  }
  auto sum_over = [](const at::Tensor& t, const std::vector<int64_t>& dims) {
    return dims.empty() ? t : t.sum(dims, true);
  };
  at::Tensor xc = x - shift;
  at::Tensor A;
  if (need_x || need_w) A = sum_over(dy * xc, inner);
  const at::Tensor B = sum_over(dy, inner);
  at::Tensor dx, dw, db;
  if (need_w) dw = (rstd * (A - delta * B)).sum_to_size(w.sizes()).to(w.scalar_type());
  if (need_b) db = B.sum_to_size(b_shape).to(b_dtype);
  if (need_x) {
    const at::Tensor wa = w.defined() ? A * w : A, wb = w.defined() ? B * w : B;
    const at::Tensor s = sum_mesh(at::stack({sum_over(wb, outer), sum_over(wa, outer)}), p);
    const at::Tensor sg = s[0], sgx = rstd * (s[1] - delta * s[0]);
    const at::Tensor c1 = -(rstd * rstd * sgx) / p.count;
    const at::Tensor c0 = -(rstd * sg) / p.count - delta * c1;
    dx = dy * (w.defined() ? rstd * w : rstd);
    dx.addcmul_(xc, c1).add_(c0);
    dx = dx.to(x.scalar_type());
  }
  return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

// Note [group norm fast backward]: the sums of the fused backward, A =
// sum(dy (x - shift)) and B = sum(dy) per (n, channel), come from libtorch's
// group norm backward kernel (two reads of the piece, vectorized): run on the
// piece viewed as a batch of one with N*C channels in N*G groups, with mean :=
// shift and rstd := 1, its dgamma is ds - shift db = A and its dbeta is db = B.
// dx = (rstd w) dy + c1 x + (c0 - c1 shift) is then one fused per-channel
// affine pass (batch_norm's inference kernel, with mean 0, variance 1 and
// eps 0, is exactly dy * weight + bias) and one addcmul_. Four to five passes
// instead of seven. Like libtorch's own kernel it forms ds - shift db and
// c0 - c1 shift uncentred, so it runs only where that cancels by at most a few
// bits: the forward's local fast path held (|mean_l| rstd_l <= kFastNormRatio)
// and |shift| rstd <= kFastNormRatio for every statistic; otherwise the
// centred fused backward below runs. Group norm, float32/float64.
variable_list group_norm_fast_backward(const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& shift, const at::Tensor& delta,
                                       const at::Tensor& rstd, const at::Tensor& dy,
                                       const NormPlan& p, bool need_x, bool need_w, bool need_b,
                                       const std::vector<int64_t>& b_shape,
                                       at::ScalarType b_dtype) {
  // x is the (N, G, C/G, *S) view; the statistics are (N, G, 1, ...).
  const int64_t N = x.size(0), G = x.size(1), cg = x.size(2);
  const int64_t C = G * cg, hw = x.numel() / (N * C);
  // libtorch's CPU kernels read these as contiguous buffers.
  const at::Tensor x1 = x.reshape({1, N * C, hw}).contiguous();
  const at::Tensor dy1 = dy.reshape({1, N * C, hw}).contiguous();
  // gamma must be defined for dgamma to be allocated; it does not enter dgamma.
  auto r = at::native_group_norm_backward(
      dy1, x1, shift.reshape({1, N * G}), at::ones({1, N * G}, rstd.options()),
      at::ones({N * C}, rstd.options()), 1, N * C, hw, N * G, {false, true, true});
  std::vector<int64_t> per_channel(x.dim(), 1);
  per_channel[0] = N;
  per_channel[1] = G;
  per_channel[2] = cg;
  const at::Tensor A = std::get<1>(r).view(per_channel), B = std::get<2>(r).view(per_channel);
  at::Tensor dx, dw, db;
  if (need_w) dw = (rstd * (A - delta * B)).sum_to_size(w.sizes()).to(w.scalar_type());
  if (need_b) db = B.sum_to_size(b_shape).to(b_dtype);
  if (need_x) {
    const at::Tensor wa = w.defined() ? A * w : A, wb = w.defined() ? B * w : B;
    const at::Tensor s = sum_mesh(at::stack({wb.sum(2, true), wa.sum(2, true)}), p);
    const at::Tensor sg = s[0], sgx = rstd * (s[1] - delta * s[0]);
    const at::Tensor c1 = -(rstd * rstd * sgx) / p.count;
    const at::Tensor c0 = -(rstd * sg) / p.count - delta * c1 - c1 * shift;
    const at::Tensor a = (w.defined() ? rstd * w : rstd).expand(per_channel).reshape({N * C});
    dx = at::batch_norm(dy1, a, c0.expand(per_channel).reshape({N * C}),
                        at::zeros({N * C}, a.options()), at::ones({N * C}, a.options()),
                        /*training=*/false, 0.0, /*eps=*/0.0, /*cudnn_enabled=*/false);
    dx.addcmul_(x1, c1.expand(per_channel).reshape({1, N * C, 1}));
    dx = dx.view(x.sizes()).to(x.scalar_type());
  }
  return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

// y = ((x - shift) - delta) * rstd * w + b on local tensors; w and b
// broadcast against x. libtorch custom Functions cannot take undefined tensors
// (1.13 and 2.13: Function<T>::apply builds a VariableInfo of each input, which
// throws "tensor does not have a device" for an undefined one): an absent w or b
// is passed as an empty placeholder and flagged in the plan.
// Note [norm backward].
// Hand-written: autograd through the merged two-pass moments would save every intermediate and
// all-reduce each of them; the closed form needs two all-reduced sums (comm/ primitives).
struct NormFn : torch::autograd::Function<NormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, const at::Tensor& shift, const at::Tensor& delta,
                            const at::Tensor& rstd, const at::Tensor& y_pre,
                            std::shared_ptr<const NormPlan> plan) {
    at::Tensor y;
    if (plan->precomputed) {
      // Note [group norm fast forward]: y_pre is the output, made by the
      // caller for this call only. A new tensor over its storage, so that
      // autograd does not take the output for one of the inputs.
      y = at::empty({0}, y_pre.options());
      y.set_(y_pre.storage(), y_pre.storage_offset(), y_pre.sizes(), y_pre.strides());
    } else {
      // ((x - shift) - delta) * rstd * w + b as (x - shift) * scale + offset,
      // scale and offset of the statistics' size (times the weight's).
      // Note [reduced precision]: shift, delta and rstd are float32 for a
      // float16/bfloat16 x; y is formed in float32 and rounded once.
      const at::Tensor scale = plan->has_w ? rstd * w : rstd;
      at::Tensor offset = -delta * scale;
      if (plan->has_b) offset = offset + b;
      y = x - shift;
      y.mul_(scale).add_(offset);
      y = y.to(x.scalar_type());
    }
    ctx->save_for_backward(
        {x, plan->has_w ? w : at::Tensor(), shift, delta, rstd, plan->has_b ? b : at::Tensor()});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan));
    ctx->saved_data["b_shape"] = b.sizes().vec();
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
    return comm::function_output(y, {x, w, b});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("NormFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &shift = saved[2], &delta = saved[3],
                     &rstd = saved[4];
    const auto& p = *static_cast<PlanHolder*>(ctx->saved_data.at("plan").toCapsule().get())->plan;
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_w = w.defined() && ctx->needs_input_grad(1);
    const bool need_b = p.has_b && ctx->needs_input_grad(2);
    // Note [reduced precision]: in the statistics' dtype (float32 for
    // float16/bfloat16), each gradient rounded once to its input's dtype.
    const at::ScalarType acc = rstd.scalar_type();
    at::Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros_like(x);
    if (at::GradMode::is_enabled()) {
      // Note [norm double backward]. The flags are the same on every rank.
      const at::Tensor& b = saved[5];
      std::vector<at::Tensor> inputs;
      if (need_x) inputs.push_back(x);
      if (need_w) inputs.push_back(w);
      if (need_b) inputs.push_back(b);
      at::Tensor dx, dw, db;
      if (!inputs.empty()) {
        at::Tensor y = norm_recompute(x, w, b, p);
        auto g = torch::autograd::grad({y}, inputs, {dy}, /*retain_graph=*/true,
                                       /*create_graph=*/true, /*allow_unused=*/true);
        size_t i = 0;
        if (need_x) dx = g[i++];
        if (need_w) dw = g[i++];
        if (need_b) db = g[i++];
      }
      return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    dy = dy.to(acc);
    const std::vector<int64_t> b_shape = ctx->saved_data.at("b_shape").toIntVector();
    if (p.group_backward) {
      return group_norm_fast_backward(x, w, shift, delta, rstd, dy, p, need_x, need_w, need_b,
                                      b_shape,
                                      c10::ScalarType(ctx->saved_data.at("b_dtype").toInt()));
    }
    if ((!w.defined() || w.dim() == x.dim()) &&
        (!p.has_b || static_cast<int64_t>(b_shape.size()) == x.dim())) {
      return fused_backward(x, w, shift, delta, rstd, dy, p, need_x, need_w, need_b, b_shape,
                            c10::ScalarType(ctx->saved_data.at("b_dtype").toInt()));
    }
    at::Tensor xhat = (x - shift).sub_(delta).mul_(rstd);
    at::Tensor dx, dw, db;
    if (need_w) dw = (dy * xhat).sum_to_size(w.sizes()).to(w.scalar_type());
    if (need_b) {
      db = dy.sum_to_size(ctx->saved_data.at("b_shape").toIntVector())
               .to(c10::ScalarType(ctx->saved_data.at("b_dtype").toInt()));
    }
    if (need_x) {
      at::Tensor g = w.defined() ? dy * w : dy;
      at::Tensor s = sum_mesh(at::stack({g.sum(p.dims, true), (g * xhat).sum(p.dims, true)}), p);
      xhat.mul_(s[1] / p.count);
      dx = (g - s[0] / p.count).sub_(xhat).mul_(rstd).to(x.scalar_type());
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Collective over plan.mesh_dims. Normalizes the local `x` over plan.dims with
// merged moments; returns (y, moments).
// `fast` (group norm only): Note [group norm fast forward].
std::pair<at::Tensor, Moments> sharded_norm(const at::Tensor& x, const at::Tensor& w,
                                            const at::Tensor& b, double eps, NormPlan plan,
                                            std::optional<LocalNorm> fast = std::nullopt) {
  plan.has_w = w.defined();
  plan.has_b = b.defined();
  plan.eps = eps;
  plan.precomputed = fast.has_value();
  Moments m = moments(x, plan, fast ? &*fast : nullptr);
  at::Tensor rstd = (m.m2 / plan.count + eps).rsqrt();
  // Note [group norm fast backward]: the global half of its condition.
  plan.group_backward = fast && (m.shift.abs() * rstd).max().item<double>() <= kFastNormRatio;
  auto p = std::make_shared<const NormPlan>(std::move(plan));
  const at::Tensor none = at::empty({0}, x.options().requires_grad(false));
  at::Tensor y_pre = none;
  if (fast) {
    at::NoGradGuard no_grad;
    const at::Tensor r64 = rstd.to(at::kDouble);  // the rstd backward uses
    at::Tensor scale = r64 / fast->rstd.to(at::kDouble);
    at::Tensor offset = (fast->mean.to(at::kDouble) - m.mean64) * r64;
    if (p->has_w) {
      const at::Tensor w64 = w.detach().to(at::kDouble);
      scale = scale * w64;
      offset = offset * w64;
    }
    if (p->has_b) offset = offset + b.detach().to(at::kDouble);
    y_pre = fast->y;
    y_pre.mul_(scale.to(y_pre.scalar_type())).add_(offset.to(y_pre.scalar_type()));
    fast.reset();
  }
  at::Tensor y =
      NormFn::apply(x, p->has_w ? w : none, p->has_b ? b : none, m.shift, m.delta, rstd, y_pre, p);
  return {y, m};
}

// ---------------------------------------------------------------- helpers

// A per-channel parameter (weight, bias, running stat) of `op`, replicated and
// marked for use in `compute` (Note [replicated gradients]); undefined stays undefined.
// With convert = false, only validates (the plain path converts it itself).
at::Tensor channel_param(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                         const at::Tensor& t, int64_t channels, const ShardSpec& compute,
                         const char* what, bool convert = true) {
  if (!t.defined()) return t;
  if (t.dim() != 1 || t.size(0) != channels) {
    std::ostringstream os;
    os << what << " should have shape [" << channels << "] (one entry per channel), got "
       << t.sizes();
    fail(op, args, os.str());
  }
  const ShardSpec* s = spec_of(t);
  if (s && !s->is_replicated()) {
    fail(op, args,
         std::string(what) + " must be a plain (replicated) tensor, got " +
             to_string(s->placements()));
  }
  if (!convert) return t;
  return to_layout(t, replicated_spec(compute.mesh(), t.sizes()), compute);
}

// Running statistics are updated in place on every rank: they must be plain tensors.
void check_running(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                   const at::Tensor& t, int64_t channels, const char* what) {
  if (!t.defined()) return;
  if (spec_of(t)) fail(op, args, std::string(what) + " must be a plain (replicated) tensor");
  if (t.dim() != 1 || t.size(0) != channels) {
    std::ostringstream os;
    os << what << " should have shape [" << channels << "], got " << t.sizes();
    fail(op, args, os.str());
  }
}

// Shape (1, C, 1, ..., 1) of rank `nd`, for per-channel broadcasting.
at::Tensor per_channel(const at::Tensor& t, int64_t nd) {
  if (!t.defined()) return t;
  std::vector<int64_t> shape(nd, 1);
  shape[1] = t.size(0);
  return t.view(shape);
}

// The input's layout (Partial summed) and its local piece in that layout.
std::pair<SpecPtr, at::Tensor> input_of(const at::Tensor& x) {
  auto spec = std::make_shared<const ShardSpec>(without_partial(*spec_of(x)));
  return {spec, to_layout(x, *spec, *spec)};
}

// Validates a (N, C, *) input whose channel dim must not be sharded.
void check_channels(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                    const ShardSpec& in, const char* name) {
  if (in.ndim() < 2) {
    fail(op, args,
         std::string(name) + " expects an input of at least 2 dims (N, C, ...), got " +
             std::to_string(in.ndim()) + " dims");
  }
  if (in.mesh_dim_of(1) >= 0) {
    fail(op, args,
         std::string(name) +
             ": the channel dim (dim 1) is sharded; shard the batch or spatial dims instead "
             "(statistics are per channel and the channel dim must be whole on every rank)");
  }
}

// Mesh dims that shard one of the tensor dims for which `pred(d)` holds.
template <class Pred>
std::vector<int64_t> mesh_dims_where(const ShardSpec& in, Pred pred) {
  std::vector<int64_t> out;
  for (int64_t m = 0; m < in.mesh().ndim(); ++m) {
    const auto& pl = in.placements()[m];
    // A mesh dim of size 1 shards nothing (Note [plain fast path]).
    if (is_shard(pl) && in.mesh().size(m) > 1 && pred(shard_dim(pl))) out.push_back(m);
  }
  return out;
}

// Note [plain fast path] for normalizations: the plain libtorch op runs when
// no reduced dim is sharded across more than one rank (P = 1, or every mesh
// dim sharding a reduced dim has size 1): the op, its kernels, its numerics
// and its memory are libtorch's, bit for bit. (An earlier version ran the
// merged-moments path without communication there, because the two-pass
// moments keep the variance of a field whose mean is large against its
// spread; at P = 1 that made GroupNorm ~2.7x slower than libtorch's kernel in
// the U-Net profile, and a ShardTensor at P = 1 must be what one process
// gives.) reduces_over_shard() below still sees size-1 mesh dims: it picks
// the merged-moments path over the local one once the plain path is ruled out.
bool reduces_over_shard(const ShardSpec& in, const std::function<bool(int64_t)>& reduced) {
  for (const auto& pl : in.placements()) {
    if (is_shard(pl) && reduced(shard_dim(pl))) return true;
  }
  return false;
}

// Whether a reduced dim is sharded across more than one rank (Note [plain fast path]).
template <class Pred>
bool reduces_across_ranks(const ShardSpec& in, Pred reduced) {
  return !mesh_dims_where(in, reduced).empty();
}

NormPlan make_plan(std::vector<int64_t> dims, const ShardSpec& in, std::vector<int64_t> mesh_dims,
                   double count) {
  return NormPlan{std::move(dims), in.mesh(), std::move(mesh_dims), count};
}

// running = (1 - momentum) * running + momentum * value, in place, on every rank.
void update_running(const at::Tensor& running, const at::Tensor& value, double momentum) {
  if (!running.defined()) return;
  at::NoGradGuard no_grad;
  running.mul_(1.0 - momentum)
      .add_(value.reshape(running.sizes()).to(running.scalar_type()), momentum);
}

// The local path on an empty piece: libtorch's kernels are not all defined
// for zero-size inputs (instance_norm reshapes through a zero-channel batch
// norm), so an empty piece gets an empty result directly. The parameters stay
// connected (with zero gradient), so that this rank still takes part in the
// all-reduce of their gradients in backward (Note [collective discipline]).
at::Tensor empty_result(const at::Tensor& local, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor y = local * 1;
  for (const at::Tensor& p : {w, b}) {
    if (p.defined() && p.requires_grad()) y = y + p.sum() * 0;
  }
  return y;
}

// Note [reduced precision]: libtorch's verdict on the input's and the
// parameters' dtypes (every tensor argument, in order, undefined ones as
// Undefined), before any communication; a backward probe when a gradient
// will be computed.
void check_dtypes(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                  const char* family, const DtypeProbe& probe) {
  std::vector<at::ScalarType> dtypes;
  bool backward = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& ty = op.schema().arguments()[i].type();
    const bool tensor =
        args[i].isTensor() ||
        (args[i].isNone() && ty->kind() == c10::TypeKind::OptionalType &&
         ty->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::TensorType);
    if (!tensor) continue;
    const at::Tensor t = opt_tensor(args[i]);
    dtypes.push_back(dtype_or_none(t));
    backward = backward || will_backward(t);
  }
  check_dtype_support(op, args, family, std::move(dtypes), backward, probe);
}

// ---------------------------------------------------------------- batch_norm

// Note [batch_norm strides]: libtorch's CPU batch_norm backward (1.13 and
// 2.13; train and eval; instance_norm runs on it) returns wrong input gradients
// when its input or its incoming gradient is channels-last contiguous while
// suggest_memory_format() says Contiguous: size-1 dims with odd strides, as a
// transposed, permuted or einsum piece has (found by tests/fuzz). Rechecked on
// 2.13 in float64: the [2, 1, 4, 8].transpose(3, 1) input of
// Norm.BatchNormOfTransposedPiece, or a gradient in that layout, gives input
// gradients off by ~5 against the contiguous call and the closed form; over
// every permuted layout of a few shapes with size-1 dims, batch_norm is wrong
// for an odd input and for an odd gradient, instance_norm (which makes its
// input contiguous itself in 2.13) for an odd gradient only. A user of
// plain tensors can call .contiguous() on the input; on a ShardTensor that is a
// no-op (the wrapper is contiguous), and the gradient's layout is the next
// op's choice. So wherever a rule calls libtorch's batch_norm or instance_norm
// on a local piece it passes a contiguous piece and makes the gradient
// reaching that backward contiguous (a hook; a copy only when it is not).
at::Tensor with_contiguous_grad(at::Tensor local_out) {
  if (local_out.requires_grad()) {
    local_out.register_hook([](const at::Tensor& g) { return g.contiguous(); });
  }
  return local_out;
}

// call_plain for batch_norm / instance_norm (Note [batch_norm strides]).
void call_plain_norm(const c10::OperatorHandle& op, std::vector<c10::IValue> args, Stack* stack) {
  call_plain(op, std::move(args), stack);
  with_contiguous_grad(local_of(stack->back().toTensor()));
}

// batch_norm(input, weight?, bias?, running_mean?, running_var?, training,
// momentum, eps, cudnn_enabled). Statistics per channel over N and every
// spatial dim, merged over every mesh dim that shards one of them.
void batch_norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const bool training = args[5].toBool();
  const double momentum = args[6].toDouble();
  const double eps = args[7].toDouble();
  if (!spec_of(args[0].toTensor())) fail(op, args, "the input must be the ShardTensor");
  // Note [batch_norm strides]: the paths below that call libtorch's
  // batch_norm on the local piece get a contiguous one.
  if (!local_of(args[0].toTensor()).is_contiguous()) {
    const at::Tensor& in = args[0].toTensor();
    args[0] = wrap(local_of(in).contiguous(), spec_ptr_of(in));
  }
  const at::Tensor& x = args[0].toTensor();
  check_dtypes(op, args, training ? "batch_norm (training)" : "batch_norm (eval)",
               [training](c10::ArrayRef<at::ScalarType> t, bool rg) {
                 return at::batch_norm(probe_ones({2, 2, 2}, t[0], rg), probe_ones({2}, t[1]),
                                       probe_ones({2}, t[2]), probe_ones({2}, t[3]),
                                       probe_ones({2}, t[4]), training, 0.1, 1e-5, false);
               });
  auto [spec, local] = input_of(x);
  const ShardSpec& in = *spec;
  check_channels(op, args, in, "batch_norm");
  const int64_t nd = in.ndim();
  const int64_t channels = in.global_shape()[1];
  const at::Tensor rm = opt_tensor(args[3]), rv = opt_tensor(args[4]);
  check_running(op, args, rm, channels, "running_mean");
  check_running(op, args, rv, channels, "running_var");
  if (!training && (!rm.defined() || !rv.defined())) {
    fail(op, args, "running_mean and running_var must be defined in evaluation mode");
  }
  channel_param(op, args, opt_tensor(args[1]), channels, in, "weight", false);
  channel_param(op, args, opt_tensor(args[2]), channels, in, "bias", false);
  {
    // Note [plain fast path]: in training the statistics reduce over every dim but C.
    std::vector<int64_t> local_dims;
    for (int64_t d = 0; !training && d < nd; ++d) {
      if (d != 1) local_dims.push_back(d);
    }
    if (!(training && reduces_across_ranks(in, [](int64_t d) { return d != 1; })) &&
        runs_plain(*spec_of(x), local_of(x), local_dims)) {
      return call_plain_norm(op, std::move(args), stack);
    }
  }
  at::Tensor w = channel_param(op, args, opt_tensor(args[1]), channels, in, "weight");
  at::Tensor b = channel_param(op, args, opt_tensor(args[2]), channels, in, "bias");
  auto mdims = mesh_dims_where(in, [](int64_t d) { return d != 1; });
  if (!training || !reduces_over_shard(in, [](int64_t d) { return d != 1; })) {
    // Eval mode (running statistics, elementwise) or nothing reduced is sharded: local.
    at::Tensor y = local.numel() == 0
                       ? empty_result(local, w, b)
                       : with_contiguous_grad(at::batch_norm(local, w, b, rm, rv, training,
                                                             momentum, eps, args[8].toBool()));
    stack->push_back(wrap(y, spec));
    return;
  }
  std::vector<int64_t> dims{0};
  double count = static_cast<double>(in.global_shape()[0]);
  for (int64_t d = 2; d < nd; ++d) {
    dims.push_back(d);
    count *= static_cast<double>(in.global_shape()[d]);
  }
  auto [y, m] = sharded_norm(local, per_channel(w, nd), per_channel(b, nd), eps,
                             make_plan(dims, in, mdims, count));
  // libtorch: running_var uses the unbiased variance M2 / (N - 1).
  update_running(rm, m.mean(), momentum);
  update_running(rv, m.m2 / std::max(count - 1.0, 0.0), momentum);
  stack->push_back(wrap(y, spec));
}

// ---------------------------------------------------------------- instance_norm

// instance_norm(input, weight?, bias?, running_mean?, running_var?,
// use_input_stats, momentum, eps, cudnn_enabled). Statistics per (n, c) over
// the spatial dims; the running statistics (when given and use_input_stats)
// move towards the mean over the batch of the per-instance statistics, as in
// libtorch, with that mean taken over the global batch.
void instance_norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const bool use_input_stats = args[5].toBool();
  const double momentum = args[6].toDouble();
  const double eps = args[7].toDouble();
  if (!spec_of(x)) fail(op, args, "the input must be the ShardTensor");
  check_dtypes(op, args, use_input_stats ? "instance_norm" : "instance_norm (running stats)",
               [use_input_stats](c10::ArrayRef<at::ScalarType> t, bool rg) {
                 return at::instance_norm(probe_ones({2, 2, 2}, t[0], rg), probe_ones({2}, t[1]),
                                          probe_ones({2}, t[2]), probe_ones({2}, t[3]),
                                          probe_ones({2}, t[4]), use_input_stats, 0.1, 1e-5, false);
               });
  auto [spec, local] = input_of(x);
  const ShardSpec& in = *spec;
  check_channels(op, args, in, "instance_norm");
  const int64_t nd = in.ndim();
  const int64_t channels = in.global_shape()[1];
  const at::Tensor rm = opt_tensor(args[3]), rv = opt_tensor(args[4]);
  check_running(op, args, rm, channels, "running_mean");
  check_running(op, args, rv, channels, "running_var");
  if (!use_input_stats && (!rm.defined() || !rv.defined())) {
    fail(op, args,
         "Expected running_mean and running_var to be defined when use_input_stats "
         "is false");
  }
  channel_param(op, args, opt_tensor(args[1]), channels, in, "weight", false);
  channel_param(op, args, opt_tensor(args[2]), channels, in, "bias", false);
  // Note [plain fast path]: the running statistics average over the batch.
  if (!(use_input_stats && reduces_across_ranks(in, [](int64_t d) { return d >= 2; })) &&
      runs_plain(
          *spec_of(x), local_of(x),
          use_input_stats && rm.defined() ? std::vector<int64_t>{} : std::vector<int64_t>{0})) {
    return call_plain_norm(op, std::move(args), stack);
  }
  at::Tensor w = channel_param(op, args, opt_tensor(args[1]), channels, in, "weight");
  at::Tensor b = channel_param(op, args, opt_tensor(args[2]), channels, in, "bias");
  auto spatial = mesh_dims_where(in, [](int64_t d) { return d >= 2; });
  auto batch = mesh_dims_where(in, [](int64_t d) { return d == 0; });
  const bool update = use_input_stats && rm.defined();
  if (!use_input_stats ||
      (!reduces_over_shard(in, [](int64_t d) { return d >= 2; }) && (!update || batch.empty()))) {
    at::Tensor y = local.numel() == 0 ? empty_result(local, w, b)
                                      : with_contiguous_grad(at::instance_norm(
                                            local.contiguous(), w, b, rm, rv, use_input_stats,
                                            momentum, eps, args[8].toBool()));
    stack->push_back(wrap(y, spec));
    return;
  }
  std::vector<int64_t> dims;
  double count = 1;
  for (int64_t d = 2; d < nd; ++d) {
    dims.push_back(d);
    count *= static_cast<double>(in.global_shape()[d]);
  }
  if (dims.empty()) {
    fail(op, args, "instance_norm expects spatial dims (an input of at least 3 dims)");
  }
  auto [y, m] = sharded_norm(local, per_channel(w, nd), per_channel(b, nd), eps,
                             make_plan(dims, in, spatial, count));
  if (update) {
    // Mean over the global batch of the per-instance mean and unbiased variance.
    at::NoGradGuard no_grad;
    const double n = static_cast<double>(in.global_shape()[0]);
    at::Tensor stats = at::stack(
        {m.mean().sum(0).flatten(), (m.m2 / std::max(count - 1.0, 0.0)).sum(0).flatten()});
    if (!batch.empty()) {
      stats = comm::all_reduce_nograd(stats.contiguous(), in.mesh(), batch, ReduceOp::Sum);
    }
    update_running(rm, stats[0] / n, momentum);
    update_running(rv, stats[1] / n, momentum);
  }
  stack->push_back(wrap(y, spec));
}

// ---------------------------------------------------------------- group_norm

// group_norm(input, num_groups, weight?, bias?, eps, cudnn_enabled).
// Statistics per (n, group) over the group's channels and the spatial dims.
void group_norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const int64_t groups = args[1].toInt();
  const double eps = args[4].toDouble();
  if (!spec_of(x)) fail(op, args, "the input must be the ShardTensor");
  check_dtypes(op, args, "group_norm", [](c10::ArrayRef<at::ScalarType> t, bool rg) {
    return at::group_norm(probe_ones({1, 2, 2}, t[0], rg), 1, probe_ones({2}, t[1]),
                          probe_ones({2}, t[2]), 1e-5);
  });
  auto [spec, local] = input_of(x);
  const ShardSpec& in = *spec;
  check_channels(op, args, in, "group_norm");
  const int64_t nd = in.ndim();
  const int64_t channels = in.global_shape()[1];
  if (groups <= 0 || channels % groups != 0) {
    fail(op, args,
         "Expected number of channels in input to be divisible by num_groups, but got input of "
         "shape " +
             c10::str(c10::IntArrayRef(in.global_shape())) +
             " and num_groups=" + std::to_string(groups));
  }
  channel_param(op, args, opt_tensor(args[2]), channels, in, "weight", false);
  channel_param(op, args, opt_tensor(args[3]), channels, in, "bias", false);
  // Note [plain fast path]: statistics per (n, group).
  if (!reduces_across_ranks(in, [](int64_t d) { return d >= 2; }) &&
      runs_plain(*spec_of(x), local_of(x), {0})) {
    return call_plain(op, std::move(args), stack);
  }
  at::Tensor w = channel_param(op, args, opt_tensor(args[2]), channels, in, "weight");
  at::Tensor b = channel_param(op, args, opt_tensor(args[3]), channels, in, "bias");
  auto spatial = mesh_dims_where(in, [](int64_t d) { return d >= 2; });
  if (!reduces_over_shard(in, [](int64_t d) { return d >= 2; })) {
    stack->push_back(wrap(local.numel() == 0
                              ? empty_result(local, w, b)
                              : at::group_norm(local, groups, w, b, eps, args[5].toBool()),
                          spec));
    return;
  }
  // View (N, C, *S) as (N, G, C/G, *S) and reduce over (C/G, *S).
  const int64_t cg = channels / groups;
  at::Tensor xv = local.unflatten(1, {groups, cg});
  std::vector<int64_t> dims{2};
  double count = static_cast<double>(cg);
  for (int64_t d = 2; d < nd; ++d) {
    dims.push_back(d + 1);
    count *= static_cast<double>(in.global_shape()[d]);
  }
  auto grouped = [&](const at::Tensor& t) {
    if (!t.defined()) return t;
    std::vector<int64_t> shape(nd + 1, 1);
    shape[1] = groups;
    shape[2] = cg;
    return t.view(shape);
  };
  auto yv = sharded_norm(xv, grouped(w), grouped(b), eps, make_plan(dims, in, spatial, count),
                         group_norm_local(local, xv, groups))
                .first;
  stack->push_back(wrap(yv.flatten(1, 2), spec));
}

// ---------------------------------------------------------------- layer_norm

// layer_norm(input, normalized_shape, weight?, bias?, eps, cudnn_enable).
// Statistics over the trailing normalized dims; weight and bias have the
// normalized shape and are sliced like the input where they span a sharded dim.
void layer_norm_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const auto normalized = args[1].toIntVector();
  const double eps = args[4].toDouble();
  if (!spec_of(x)) fail(op, args, "the input must be the ShardTensor");
  check_dtypes(op, args, "layer_norm", [](c10::ArrayRef<at::ScalarType> t, bool rg) {
    return at::layer_norm(probe_ones({1, 2}, t[0], rg), {2}, probe_ones({2}, t[1]),
                          probe_ones({2}, t[2]), 1e-5);
  });
  auto [spec, local] = input_of(x);
  const ShardSpec& in = *spec;
  const int64_t nd = in.ndim();
  const int64_t k = static_cast<int64_t>(normalized.size());
  bool ok = k >= 1 && k <= nd;
  for (int64_t i = 0; ok && i < k; ++i) ok = in.global_shape()[nd - k + i] == normalized[i];
  if (!ok) {
    fail(op, args,
         "Given normalized_shape=" + c10::str(c10::IntArrayRef(normalized)) +
             ", expected input with shape [*, " + c10::str(c10::IntArrayRef(normalized)) +
             "], but got input of size " + c10::str(c10::IntArrayRef(in.global_shape())));
  }
  for (int i : {2, 3}) {
    at::Tensor t = opt_tensor(args[i]);
    if (t.defined() && t.sizes().vec() != normalized) {
      fail(op, args,
           std::string(i == 2 ? "weight" : "bias") + " should have the normalized shape " +
               c10::str(c10::IntArrayRef(normalized)) + ", got " + c10::str(t.sizes()));
    }
  }
  {
    // Note [plain fast path]: statistics over the trailing normalized dims;
    // weight and bias must then be whole on every rank (not sharded over > 1 rank).
    std::vector<int64_t> lead;
    for (int64_t d = 0; d < nd - k; ++d) lead.push_back(d);
    bool params_whole = true;
    for (int i : {2, 3}) {
      const at::Tensor t = opt_tensor(args[i]);
      if (const ShardSpec* ps = t.defined() ? spec_of(t) : nullptr) {
        for (int64_t m = 0; m < ps->mesh().ndim(); ++m) {
          params_whole =
              params_whole && (is_replicate(ps->placements()[m]) || ps->mesh().size(m) == 1);
        }
      }
    }
    if (params_whole && !reduces_across_ranks(in, [&](int64_t d) { return d >= nd - k; }) &&
        runs_plain(*spec_of(x), local_of(x), lead)) {
      return call_plain(op, std::move(args), stack);
    }
  }
  at::Tensor wl, bl;
  for (int i : {2, 3}) {
    at::Tensor t = opt_tensor(args[i]);
    if (!t.defined()) continue;
    (i == 2 ? wl : bl) = to_layout(t, operand_spec(in, t.sizes()), in);
  }
  auto mdims = mesh_dims_where(in, [&](int64_t d) { return d >= nd - k; });
  if (!reduces_over_shard(in, [&](int64_t d) { return d >= nd - k; })) {
    stack->push_back(wrap(local.numel() == 0
                              ? empty_result(local, wl, bl)
                              : at::layer_norm(local, normalized, wl, bl, eps, args[5].toBool()),
                          spec));
    return;
  }
  std::vector<int64_t> dims;
  double count = 1;
  for (int64_t d = nd - k; d < nd; ++d) {
    dims.push_back(d);
    count *= static_cast<double>(in.global_shape()[d]);
  }
  auto y = sharded_norm(local, wl, bl, eps, make_plan(dims, in, mdims, count)).first;
  stack->push_back(wrap(y, spec));
}

const RuleRegistrar r_batch_norm({"batch_norm"}, batch_norm_rule);
const RuleRegistrar r_instance_norm({"instance_norm"}, instance_norm_rule);
const RuleRegistrar r_group_norm({"group_norm"}, group_norm_rule);
const RuleRegistrar r_layer_norm({"layer_norm"}, layer_norm_rule);

}  // namespace
}  // namespace shardtensor::ops
