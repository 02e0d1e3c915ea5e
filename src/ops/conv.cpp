// Convolution on inputs sharded along spatial (and batch) dims: conv1d/2d/3d
// (integer padding and 'same'/'valid'), convolution, _convolution,
// _convolution_mode. See DESIGN.md "Halo arithmetic" and Note [output-first halos].
//
// Note [conv layout]: the computation keeps the input's Shard placements on
// the batch dim (data parallel, purely local) and on spatial dims (halo
// exchange); Shard on the channel dim and Partial are resolved to Replicate
// first (the weight contracts over all input channels). The output is
// partitioned first (stencil::window_plans); each rank gathers exactly the
// input range its output block reads, zero-filled past the global edges, so
// the local convolution runs with padding 0 on sharded dims and the original
// padding on unsharded ones (asymmetric 'same' padding adds the extra zeros on
// the right, as libtorch does). Weight and bias are replicated: to_layout
// marks them with comm::use_replicated so that their gradients are summed over
// every mesh dim on which the input is sharded (Note [replicated gradients]).
//
// Note [conv memory]: a rule built from gather + at::convolution would keep
// the gathered (halo-extended) copy of the input alive for backward, on top of
// the local input that the previous layer already holds: twice the activation
// memory. ConvFn instead saves only the local input and the weight, and in
// backward rebuilds the gathered input on a fresh graph (one more halo
// exchange), runs at::convolution_backward, and sends the halo part of the
// input gradient back to its owners through the adjoint of gather_range
// (torch::autograd::grad through the rebuilt graph).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>

#include "comm/transport.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ConvPlan {
  DeviceMesh mesh;
  std::vector<stencil::DimPlan> plans;
  bool batched = true;
  int64_t nsp = 0;
  std::vector<int64_t> stride, dilation;
  std::vector<int64_t> local_padding;  // padding passed to the local convolution
  std::vector<int64_t> extra_right;    // zeros added on the right first (unsharded 'same')
  int64_t groups = 1;
  bool has_bias = false;
  std::vector<int64_t> out_local_shape;  // batched
  // Note [conv overlap]: the fast path, set when it applies.
  bool fast = false;
  int64_t fast_dim = 0;               // batched tensor dim that is sharded
  int64_t fast_halo = 0;              // halo width on both sides (= the symmetric padding)
  int64_t fast_mesh_dim = 0;          // the mesh dim that shards it
  std::vector<int64_t> fast_padding;  // original padding on every spatial dim
};

struct PlanHolder : torch::CustomClassHolder {
  explicit PlanHolder(std::shared_ptr<const ConvPlan> p) : plan(std::move(p)) {}
  std::shared_ptr<const ConvPlan> plan;
};

// Collective over the planned mesh dims. The local input extended to the
// ranges its output block reads, batched.
at::Tensor gather_input(const at::Tensor& local, const ConvPlan& p) {
  at::Tensor x = stencil::gather_plans(local, p.mesh, p.plans, PadMode::Constant, 0.0);
  bool extra = false;
  std::vector<int64_t> pad(2 * p.nsp, 0);
  for (int64_t i = 0; i < p.nsp; ++i) {
    pad[2 * (p.nsp - 1 - i) + 1] = p.extra_right[i];
    extra = extra || p.extra_right[i] != 0;
  }
  if (extra) x = at::constant_pad_nd(x, pad, 0);
  if (!p.batched) x = x.unsqueeze(0);
  return x;
}

bool has_zero(c10::IntArrayRef s) {
  for (int64_t v : s) {
    if (v == 0) return true;
  }
  return false;
}

// Note [conv overlap]: helpers of the fast path (one sharded spatial dim,
// stride 1, output partition = input partition, symmetric padding p, every
// piece at least p wide). Rows are indices along p.fast_dim of the local piece
// extended by the halos: [-h, 0) left halo, [0, n) local, [n, n + h) right halo.
constexpr int kConvHaloTag = 7211;

struct FastGeom {
  int64_t n = 0, h = 0;
  int me = 0, nranks = 1;
  bool left = false, right = false;  // has a neighbour on that side
  MPI_Comm comm = MPI_COMM_NULL;
  // Output row ranges [a, b) that the interior convolution gets wrong (next to
  // an internal shard boundary), disjoint and sorted.
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

FastGeom fast_geom(const at::Tensor& x, const ConvPlan& p) {
  FastGeom g;
  g.n = x.size(p.fast_dim);
  g.h = p.fast_halo;
  g.nranks = static_cast<int>(p.mesh.size(p.fast_mesh_dim));
  if (g.nranks > 1) {
    g.comm = p.mesh.comm(p.fast_mesh_dim);
    g.me = comm::transport::comm_rank(g.comm);
  }
  g.left = g.me > 0 && g.h > 0;
  g.right = g.me + 1 < g.nranks && g.h > 0;
  std::pair<int64_t, int64_t> l{0, 0}, r{g.n, g.n};
  if (g.left) l = {0, std::min(g.h, g.n)};
  if (g.right) r = {std::max<int64_t>(g.n - g.h, 0), g.n};
  if (g.left && g.right && l.second >= r.first) {
    g.ranges.push_back({0, g.n});
  } else {
    if (g.left) g.ranges.push_back(l);
    if (g.right) g.ranges.push_back(r);
  }
  return g;
}

// Starts the exchange of `send_left` / `send_right` (to the neighbours) and
// the receives into `recv_left` / `recv_right`; absent sides are skipped.
comm::transport::PendingExchange start_halo_exchange(const FastGeom& g, const at::Tensor& send_left,
                                                     const at::Tensor& send_right,
                                                     const at::Tensor& recv_left,
                                                     const at::Tensor& recv_right) {
  std::vector<comm::transport::PeerBuffer> sends, recvs;
  if (g.left) {
    sends.push_back({g.me - 1, send_left});
    recvs.push_back({g.me - 1, recv_left});
  }
  if (g.right) {
    sends.push_back({g.me + 1, send_right});
    recvs.push_back({g.me + 1, recv_right});
  }
  if (sends.empty()) return comm::transport::PendingExchange();
  return comm::transport::start_exchange(sends, recvs, g.comm, kConvHaloTag);
}

at::Tensor contiguous_rows(const at::Tensor& x, int64_t dim, int64_t start, int64_t len) {
  return x.narrow(dim, start, len).contiguous();
}

at::Tensor empty_rows(const at::Tensor& x, int64_t dim, int64_t len) {
  auto shape = x.sizes().vec();
  shape[dim] = len;
  return at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

// Rows [lo, hi) of the halo-extended piece (-h <= lo <= hi <= n + h). Missing
// halos (global edges) read as zeros; `zero_local` replaces the local rows by
// zeros too (used for the weight-gradient correction).
at::Tensor strip(const at::Tensor& x, const at::Tensor& halo_l, const at::Tensor& halo_r,
                 const FastGeom& g, int64_t dim, int64_t lo, int64_t hi, bool zero_local) {
  std::vector<at::Tensor> parts;
  auto zeros = [&](int64_t len) {
    auto shape = x.sizes().vec();
    shape[dim] = len;
    return at::zeros(shape, x.options());
  };
  if (lo < 0) {
    const int64_t e = std::min<int64_t>(hi, 0);
    parts.push_back(g.left ? halo_l.narrow(dim, lo + g.h, e - lo) : zeros(e - lo));
  }
  const int64_t a = std::max<int64_t>(lo, 0), b = std::min(hi, g.n);
  if (b > a) parts.push_back(zero_local ? zeros(b - a) : x.narrow(dim, a, b - a));
  if (hi > g.n) {
    const int64_t s = std::max(lo, g.n);
    parts.push_back(g.right ? halo_r.narrow(dim, s - g.n, hi - s) : zeros(hi - s));
  }
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, dim);
}

std::vector<int64_t> strip_padding(const ConvPlan& p) {
  std::vector<int64_t> pad = p.fast_padding;
  pad[p.fast_dim - 2] = 0;
  return pad;
}

// Note [conv overlap]: forward of the fast path on the batched local piece.
// Returns the output and the received halos (saved for backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fast_forward(const at::Tensor& x,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& bias,
                                                            const ConvPlan& p) {
  const FastGeom g = fast_geom(x, p);
  const int64_t d = p.fast_dim;
  at::Tensor send_l, send_r, halo_l, halo_r;
  if (g.left) {
    send_l = contiguous_rows(x, d, 0, g.h);
    halo_l = empty_rows(x, d, g.h);
  }
  if (g.right) {
    send_r = contiguous_rows(x, d, g.n - g.h, g.h);
    halo_r = empty_rows(x, d, g.h);
  }
  auto pending = start_halo_exchange(g, send_l, send_r, halo_l, halo_r);
  const bool empty = has_zero(p.out_local_shape) || has_zero(x.sizes());
  const std::vector<int64_t> no_out_pad(p.nsp, 0);
  const at::Tensor b = p.has_bias ? bias : at::Tensor();
  at::Tensor out;
  if (empty) {
    out = at::zeros(p.out_local_shape, x.options());
  } else {
    // Interior: the local piece with the original padding; correct except in
    // g.ranges (which read zeros where the neighbours' rows belong).
    pending.test();
    out = at::convolution(x, weight, b, p.stride, p.fast_padding, p.dilation, false, no_out_pad,
                          p.groups);
  }
  pending.finish();
  if (!empty) {
    const auto spad = strip_padding(p);
    for (const auto& r : g.ranges) {
      at::Tensor s = strip(x, halo_l, halo_r, g, d, r.first - g.h, r.second + g.h, false);
      at::Tensor o =
          at::convolution(s, weight, b, p.stride, spad, p.dilation, false, no_out_pad, p.groups);
      out.narrow(d, r.first, r.second - r.first).copy_(o);
    }
  }
  return {out, halo_l, halo_r};
}

// Note [conv overlap]: backward of the fast path. `g_out` is batched.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fast_backward(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& halo_l,
    const at::Tensor& halo_r, const at::Tensor& g_out, const ConvPlan& p, bool need_in, bool need_w,
    bool need_b) {
  const FastGeom g = fast_geom(x, p);
  const int64_t d = p.fast_dim;
  const bool empty = has_zero(p.out_local_shape) || has_zero(x.sizes());
  const std::vector<int64_t> no_out_pad(p.nsp, 0);
  const auto spad = strip_padding(p);
  // 1. The boundary strips: gradient w.r.t. the halo rows (sent to their
  //    owners) and the weight-gradient correction. By linearity in the input,
  //    the strip's weight gradient with the local rows zeroed is exactly what
  //    the interior backward (which read zeros for the halos) misses.
  at::Tensor gh_l, gh_r, gw_corr;
  if (need_in) {
    if (g.left) gh_l = at::zeros_like(halo_l, at::MemoryFormat::Contiguous);
    if (g.right) gh_r = at::zeros_like(halo_r, at::MemoryFormat::Contiguous);
  }
  if (!empty && (need_in || need_w)) {
    for (const auto& r : g.ranges) {
      const int64_t lo = r.first - g.h, hi = r.second + g.h;
      at::Tensor s = strip(x, halo_l, halo_r, g, d, lo, hi, true);
      at::Tensor go = g_out.narrow(d, r.first, r.second - r.first).contiguous();
      at::Tensor gs, gws;
      std::tie(gs, gws, std::ignore) =
          at::convolution_backward(go, s, weight, c10::nullopt, p.stride, spad, p.dilation, false,
                                   no_out_pad, p.groups, {need_in, need_w, false});
      if (need_w) gw_corr = gw_corr.defined() ? gw_corr + gws : gws;
      if (need_in) {
        if (g.left && lo < 0) {
          const int64_t e = std::min<int64_t>(hi, 0);
          gh_l.narrow(d, lo + g.h, e - lo).add_(gs.narrow(d, 0, e - lo));
        }
        if (g.right && hi > g.n) {
          const int64_t st = std::max(lo, g.n);
          gh_r.narrow(d, st - g.n, hi - st).add_(gs.narrow(d, st - lo, hi - st));
        }
      }
    }
  }
  // 2. Send them back (the adjoint of the forward exchange) while 3. the
  //    interior backward runs.
  at::Tensor recv_l, recv_r;
  comm::transport::PendingExchange pending;
  if (need_in) {
    if (g.left) recv_l = empty_rows(x, d, g.h);
    if (g.right) recv_r = empty_rows(x, d, g.h);
    pending = start_halo_exchange(g, gh_l, gh_r, recv_l, recv_r);
  }
  at::Tensor gx, gw, gb;
  if (empty) {
    if (need_in) gx = at::zeros_like(x);
    if (need_w) gw = at::zeros_like(weight);
  } else if (need_in || need_w) {
    pending.test();
    std::tie(gx, gw, std::ignore) =
        at::convolution_backward(g_out, x, weight, c10::nullopt, p.stride, p.fast_padding,
                                 p.dilation, false, no_out_pad, p.groups, {need_in, need_w, false});
  }
  if (need_b) {
    std::vector<int64_t> dims{0};
    for (int64_t i = 2; i < g_out.dim(); ++i) dims.push_back(i);
    gb = empty ? at::zeros({weight.size(0)}, weight.options()) : g_out.sum(dims);
  }
  pending.finish();
  if (need_in && !empty) {
    // My first rows were the left neighbour's right halo, and vice versa.
    if (g.left) gx.narrow(d, 0, g.h).add_(recv_l);
    if (g.right) gx.narrow(d, g.n - g.h, g.h).add_(recv_r);
  }
  if (need_w && gw_corr.defined()) gw.add_(gw_corr);
  return {gx, gw, gb};
}

struct ConvFn : torch::autograd::Function<ConvFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, const at::Tensor& weight,
                            const at::Tensor& bias, std::shared_ptr<const ConvPlan> plan) {
    const ConvPlan& p = *plan;
    if (p.fast) {
      at::Tensor xb = p.batched ? local : local.unsqueeze(0);
      at::Tensor out, halo_l, halo_r;
      std::tie(out, halo_l, halo_r) = fast_forward(xb, weight, bias, p);
      // Note [conv memory]: only the local input, the weight and the two
      // halo strips are kept.
      ctx->save_for_backward({local, weight, halo_l, halo_r});
      ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan));
      ctx->saved_data["bias"] = p.has_bias;
      ctx->saved_data["bias_size"] = p.has_bias ? bias.size(0) : int64_t(0);
      if (!p.batched) out = out.squeeze(0);
      return out;
    }
    at::Tensor x = gather_input(local, p);
    at::Tensor out;
    if (has_zero(p.out_local_shape) || has_zero(x.sizes())) {
      out = at::zeros(p.out_local_shape, local.options());
    } else {
      const std::vector<int64_t> no_out_pad(p.nsp, 0);
      out = at::convolution(x, weight, p.has_bias ? bias : at::Tensor(), p.stride, p.local_padding,
                            p.dilation, false, no_out_pad, p.groups);
    }
    x = at::Tensor();  // Note [conv memory]: the gathered copy dies here
    ctx->save_for_backward({local, weight});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan));
    ctx->saved_data["bias"] = p.has_bias;
    ctx->saved_data["bias_size"] = p.has_bias ? bias.size(0) : int64_t(0);
    if (!p.batched) out = out.squeeze(0);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& local = saved[0];
    const at::Tensor& weight = saved[1];
    const auto& p = *static_cast<PlanHolder*>(ctx->saved_data.at("plan").toCapsule().get())->plan;
    const bool has_bias = ctx->saved_data.at("bias").toBool();
    const int64_t bias_size = ctx->saved_data.at("bias_size").toInt();
    const bool need_in = ctx->needs_input_grad(0);
    const bool need_w = ctx->needs_input_grad(1);
    const bool need_b = has_bias && ctx->needs_input_grad(2);

    at::Tensor g = grads[0];
    if (!g.defined()) g = at::zeros(p.out_local_shape, local.options());
    if (!p.batched) g = g.unsqueeze(0);

    if (p.fast) {
      at::Tensor xb = p.batched ? local : local.unsqueeze(0);
      at::Tensor gx, gw, gb;
      std::tie(gx, gw, gb) =
          fast_backward(xb, weight, saved[2], saved[3], g.contiguous(), p, need_in, need_w, need_b);
      if (need_in && !p.batched) gx = gx.squeeze(0);
      return {need_in ? gx : at::Tensor(), need_w ? gw : at::Tensor(), need_b ? gb : at::Tensor(),
              at::Tensor()};
    }

    // Rebuild the gathered input (collective on every rank, whatever it needs).
    c10::AutoGradMode enable(true);
    at::Tensor x_in = local.detach();
    if (need_in) x_in.requires_grad_(true);
    at::Tensor x = gather_input(x_in, p);

    at::Tensor gx, gw, gb;
    if (has_zero(p.out_local_shape) || has_zero(x.sizes())) {
      if (need_in) gx = at::zeros_like(x);
      if (need_w) gw = at::zeros_like(weight);
      if (need_b) gb = at::zeros({bias_size}, weight.options());
    } else {
      const std::vector<int64_t> no_out_pad(p.nsp, 0);
      const std::vector<int64_t> bs{bias_size};
      at::OptionalIntArrayRef bias_sizes = c10::nullopt;
      if (has_bias) bias_sizes = at::IntArrayRef(bs);
      std::tie(gx, gw, gb) = at::convolution_backward(
          g.contiguous(), x.detach(), weight.detach(), bias_sizes, p.stride, p.local_padding,
          p.dilation, false, no_out_pad, p.groups, {need_in, need_w, need_b});
    }
    at::Tensor grad_local;
    if (need_in) {
      // The adjoint of the gather: halo gradients go back to their owners.
      grad_local = x.is_same(x_in) ? gx : torch::autograd::grad({x}, {x_in}, {gx})[0];
    }
    return {grad_local, need_w ? gw : at::Tensor(), need_b ? gb : at::Tensor(), at::Tensor()};
  }
};

std::vector<int64_t> expand_list(const c10::IValue& v, int64_t n) {
  std::vector<int64_t> out = v.toIntVector();
  if (out.size() == 1 && n > 1) out.assign(n, out[0]);
  return out;
}

// The conv1d/2d/3d family, convolution and _convolution, normalized.
struct ConvCall {
  at::Tensor input, weight, bias;
  std::vector<int64_t> stride, dilation, pad_left, pad_right;
  int64_t groups = 1;
};

// Note [conv overlap]: whether the fast path applies. Decided from global
// shapes and the spec only, so every rank agrees. SHARDTENSOR_CONV_OVERLAP=0
// disables it (for comparisons).
void decide_fast_path(ConvPlan& plan, const ConvCall& c, const std::vector<int64_t>& out_ext,
                      int64_t first_sp) {
  plan.fast = false;
  static const bool enabled = [] {
    const char* e = std::getenv("SHARDTENSOR_CONV_OVERLAP");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  if (!enabled || plan.plans.size() != 1) return;
  const stencil::DimPlan& dp = plan.plans[0];
  const int64_t i = dp.dim - first_sp;
  const int64_t k = c.weight.size(2 + i);
  const int64_t h = c.pad_left[i];
  if (c.stride[i] != 1 || c.pad_right[i] != h || c.dilation[i] * (k - 1) != 2 * h) return;
  if (out_ext[i] != c.input.size(dp.dim) || dp.out_sizes != dp.in_sizes) return;
  for (int64_t n : dp.in_sizes) {
    if (n < std::max<int64_t>(h, 1)) return;  // single hop, no empty pieces
  }
  for (int64_t e : plan.extra_right) {
    if (e != 0) return;
  }
  plan.fast = true;
  plan.fast_dim = i + 2;
  plan.fast_halo = h;
  plan.fast_mesh_dim = dp.mesh_dim;
  plan.fast_padding = plan.local_padding;
  plan.fast_padding[i] = h;
}

void conv_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const std::string& name = op.operator_name().name;
  const std::string& overload = op.operator_name().overload_name;
  const DeviceMesh mesh = common_mesh(op, args);

  for (size_t i = 0; i < op.schema().arguments().size(); ++i) {
    const auto* a = op.schema().arguments()[i].alias_info();
    if (a && a->isWrite()) fail(op, args, "out= variants of convolution are not supported");
  }
  ConvCall c;
  c.input = args[0].toTensor();
  c.weight = args[1].toTensor();
  if (args[2].isTensor()) c.bias = args[2].toTensor();
  if (!spec_of(c.input)) fail(op, args, "the input must be the ShardTensor");
  const int64_t wdim = c.weight.dim();
  if (wdim < 3 || wdim > 5) fail(op, args, "expected a 3-d, 4-d or 5-d weight");
  const int64_t nsp = wdim - 2;
  const int64_t idim = c.input.dim();
  if (idim != nsp + 2 && idim != nsp + 1) {
    fail(op, args,
         "expected a " + std::to_string(nsp + 1) + "-d or " + std::to_string(nsp + 2) +
             "-d input for a " + std::to_string(wdim) + "-d weight");
  }
  const bool batched = idim == nsp + 2;
  const int64_t first_sp = batched ? 2 : 1;
  const int64_t cdim = first_sp - 1;

  const bool string_padding = name == "aten::_convolution_mode" || overload == "padding";
  c.stride = expand_list(args[3], nsp);
  std::string padding_str;
  if (string_padding) {
    padding_str = args[4].toStringRef();
    c.dilation = expand_list(args[5], nsp);
    c.groups = args[6].toInt();
  } else {
    c.pad_left = expand_list(args[4], nsp);
    c.dilation = expand_list(args[5], nsp);
    if (name == "aten::convolution" || name == "aten::_convolution") {
      if (args[6].toBool())
        fail(op, args, "transposed convolution is not supported on ShardTensors");
      c.groups = args[8].toInt();
    } else {
      c.groups = args[6].toInt();
    }
    c.pad_right = c.pad_left;
  }
  if (static_cast<int64_t>(c.stride.size()) != nsp ||
      static_cast<int64_t>(c.dilation.size()) != nsp ||
      (!string_padding && static_cast<int64_t>(c.pad_left.size()) != nsp)) {
    fail(op, args, "stride, padding and dilation must have one entry per spatial dim");
  }
  for (int64_t i = 0; i < nsp; ++i) {
    if (c.stride[i] < 1 || c.dilation[i] < 1) {
      fail(op, args, "stride and dilation must be positive");
    }
    if (!string_padding && c.pad_left[i] < 0) fail(op, args, "negative padding is not supported");
  }
  const auto& ws = c.weight.sizes();
  if (string_padding) {
    if (padding_str == "valid") {
      c.pad_left.assign(nsp, 0);
      c.pad_right.assign(nsp, 0);
    } else if (padding_str == "same") {
      for (int64_t i = 0; i < nsp; ++i) {
        if (c.stride[i] != 1)
          fail(op, args, "padding='same' is not supported for strided convolutions");
        const int64_t total = c.dilation[i] * (ws[2 + i] - 1);
        c.pad_left.push_back(total / 2);
        c.pad_right.push_back(total - total / 2);
      }
    } else {
      fail(op, args, "invalid padding string '" + padding_str + "'; expected 'same' or 'valid'");
    }
  }
  if (c.groups < 1 || ws[0] % c.groups != 0) fail(op, args, "invalid groups");
  if (c.input.size(cdim) != ws[1] * c.groups) {
    fail(op, args,
         "expected input with " + std::to_string(ws[1] * c.groups) + " channels, got " +
             std::to_string(c.input.size(cdim)));
  }
  if (c.bias.defined() && (c.bias.dim() != 1 || c.bias.size(0) != ws[0])) {
    fail(op, args, "expected a bias of size [" + std::to_string(ws[0]) + "]");
  }
  std::vector<int64_t> out_shape, spatial_dims, out_ext;
  if (batched) out_shape.push_back(c.input.size(0));
  out_shape.push_back(ws[0]);
  for (int64_t i = 0; i < nsp; ++i) {
    const int64_t n = c.input.size(first_sp + i);
    const int64_t span = c.dilation[i] * (ws[2 + i] - 1) + 1;
    const int64_t padded = n + c.pad_left[i] + c.pad_right[i];
    if (padded < span) {
      fail(op, args,
           "the (padded) input extent " + std::to_string(padded) + " of spatial dim " +
               std::to_string(i) + " is smaller than the dilated kernel (" + std::to_string(span) +
               ")");
    }
    out_ext.push_back((padded - span) / c.stride[i] + 1);
    out_shape.push_back(out_ext.back());
    spatial_dims.push_back(first_sp + i);
  }

  // Note [conv layout]: the compute layout.
  const ShardSpec& in_spec = *spec_of(c.input);
  Placements cp;
  ShardSizes csizes;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& pl = in_spec.placements()[m];
    if (is_shard(pl) && shard_dim(pl) != cdim) {
      cp.push_back(pl);
      csizes.push_back(in_spec.shard_sizes(m));
    } else {
      cp.push_back(Replicate{});
      csizes.push_back({});
    }
  }
  const ShardSpec compute(mesh, cp, c.input.sizes().vec(), csizes);
  const ShardSpec w_rep(mesh, Placements(mesh.ndim(), Replicate{}), c.weight.sizes().vec());

  auto plan = std::make_shared<ConvPlan>();
  plan->mesh = mesh;
  plan->plans =
      stencil::window_plans(compute, spatial_dims, std::vector<int64_t>(ws.begin() + 2, ws.end()),
                            c.stride, c.dilation, c.pad_left, out_ext);
  plan->batched = batched;
  plan->nsp = nsp;
  plan->stride = c.stride;
  plan->dilation = c.dilation;
  plan->groups = c.groups;
  plan->local_padding.assign(nsp, 0);
  plan->extra_right.assign(nsp, 0);
  for (int64_t i = 0; i < nsp; ++i) {
    if (compute.mesh_dim_of(first_sp + i) >= 0) continue;
    plan->local_padding[i] = std::min(c.pad_left[i], c.pad_right[i]);
    plan->extra_right[i] = c.pad_right[i] - plan->local_padding[i];
    if (c.pad_left[i] > c.pad_right[i]) {
      fail(op, args, "padding larger on the left than on the right is not supported");
    }
  }
  decide_fast_path(*plan, c, out_ext, first_sp);
  SpecPtr out_spec = stencil::output_spec(compute, out_shape, plan->plans);
  plan->out_local_shape = out_spec->local_shape();
  if (!batched) plan->out_local_shape.insert(plan->out_local_shape.begin(), 1);

  // Communication starts here (all validation above is metadata only).
  at::Tensor local = to_layout(c.input, compute, compute);
  at::Tensor weight = to_layout(c.weight, w_rep, compute);
  at::Tensor bias;
  if (c.bias.defined()) {
    const ShardSpec b_rep(mesh, Placements(mesh.ndim(), Replicate{}), c.bias.sizes().vec());
    bias = to_layout(c.bias, b_rep, compute);
  }
  // torch::autograd::Function cannot take an undefined tensor: no bias is an
  // empty placeholder (ConvFn reads has_bias from the plan).
  plan->has_bias = bias.defined();
  if (!bias.defined()) bias = at::empty({0}, weight.options());
  at::Tensor out = ConvFn::apply(local, weight, bias, std::shared_ptr<const ConvPlan>(plan));
  stack->push_back(wrap(out, out_spec));
}

const RuleRegistrar conv_ops({"conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                              "_convolution_mode"},
                             conv_rule);

}  // namespace
}  // namespace shardtensor::ops
