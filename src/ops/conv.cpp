// Convolution on inputs sharded along spatial (and batch) dims: conv1d/2d/3d
// (integer padding and 'same'/'valid'), convolution, _convolution,
// _convolution_mode. See DESIGN.md "Halo arithmetic" and Note [output-first halos].
// convolution / _convolution with transposed=true go to the transposed
// convolution rule (src/ops/conv_transpose.cpp, transposed_convolution_rule).
//
// Note [conv layout]: the computation keeps the input's Shard placements on
// the batch dim (data parallel, purely local) and on spatial dims (halo
// exchange); Partial is resolved to Replicate first. A channel-sharded input
// is not gathered (Note [channel-sharded conv]). The output is
// partitioned first (stencil::window_plans); each rank gathers exactly the
// input range its output block reads, zero-filled past the global edges, so
// the local convolution runs with padding 0 on sharded dims and the original
// padding on unsharded ones (asymmetric 'same' padding adds the extra zeros on
// the right, as libtorch does). Weight and bias are replicated: to_layout
// marks them with comm::use_replicated so that their gradients are summed over
// every mesh dim on which the input is sharded (Note [replicated gradients]).
//
// Note [channel-sharded conv]: with the input channels split over mesh dim m
// (groups == 1), each rank convolves its channels with the matching slice of
// the weight's input channels (w[:, c0:c1], a local slice whose gradient is
// all-gathered over m in backward). That is this rank's share of a sum over m
// (a Partial output with every output channel), which comm::reduce_scatter
// sums and splits along the output channels (balanced): the output is
// Shard(channel) on m. The bias is added after the sum, to this rank's output
// channels. Cost on m: a reduce-scatter of the (P-1)/P output volume instead
// of an all-gather of the input, no operand replicated (no gathered bytes,
// allowed in strict mode). Grouped convolutions over a channel-sharded input
// still replicate the channels (a visible gather, Note [visible gathers]).
// The layouts, the weight slice and the reduce-scatter with the bias live in
// ops/channel_conv.h, shared with the transposed convolution (Note
// [channel-sharded transposed convolution], src/ops/conv_transpose.cpp).
//
// Note [conv memory]: a rule built from gather + at::convolution would keep
// the gathered (halo-extended) copy of the input alive for backward, on top of
// the local input that the previous layer already holds: twice the activation
// memory. ConvFn instead saves only the local input and the weight. On the
// general path, forward still builds the gathered copy transiently (one
// input-sized temporary per conv, even at P = 1), and backward rebuilds it on
// a fresh graph (one more halo exchange), runs at::convolution_backward, and
// sends the halo part of the input gradient back to its owners through the
// adjoint of gather_range (torch::autograd::grad through the rebuilt graph).
// The fast path (Note [conv overlap]) makes no input-sized copy at all: it
// saves the local input, the weight and the received halo blocks (h rows per
// side and sharded dim, plus corners), and its temporaries are boundary strips
// of 3h rows.
//
// Note [conv overlap]: the fast path, for the common same-size convolution:
// every sharded spatial dim has stride 1, symmetric padding h and
// dilation*(k-1) = 2h (k=3 p=1, k=5 p=2, 'same' with an odd kernel, ...), the
// output partition equal to the input partition and every piece at least
// max(h, 1) wide (single-hop halos, no empty pieces); no extra right padding
// on unsharded dims. Any number of spatial dims may be sharded: the halo of a
// piece is then a 3^D arrangement of blocks, the corners coming straight from
// the diagonal neighbours (one exchange over the whole mesh communicator).
// Every rank decides it from global shapes and the spec (decide_fast_path),
// so all agree; SHARDTENSOR_CONV_OVERLAP=0 turns it off (the general path
// above is then used everywhere).
//  - forward: post the exchange of the edge blocks with every neighbour
//    (comm::BlockExchange, split phase); while it is in flight run
//    at::convolution on the local piece with the ORIGINAL padding h. That
//    output is exact except in the h rows next to an internal shard boundary
//    (they read zeros instead of the neighbour's rows; at the global edges the
//    zeros are right). Finish the exchange and recompute only those rows from
//    a strip [a - h, b + h) of the halo-extended piece with padding 0 on the
//    sharded dims, copying them into the output (if a piece is narrower than
//    2h the two boundary ranges merge into one). With several sharded dims
//    the wrong rows are split into disjoint boxes (boundary_boxes: along dim
//    i the boundary rows, crossed with the non-boundary rows of earlier dims
//    and all rows of later ones), so every output element is recomputed at
//    most once.
//  - backward: the interior at::convolution_backward (original padding) on
//    the full output gradient gives every local-output -> local-input term of
//    grad_input and weight gradients that used zeros for the halo rows. For
//    each boundary range, one small convolution_backward on the strip with its
//    LOCAL rows zeroed gives (a) the gradient w.r.t. the halo rows, sent back
//    to their owners (the adjoint exchange, started before and overlapped with
//    the interior backward) and added to their edge rows, and (b) by linearity
//    of the weight gradient in the input, exactly the halo terms that the
//    interior weight gradient missed; each output element is thus counted
//    once. The bias gradient is the plain sum of the output gradient. The
//    halo rows for (b) are the ones saved in forward, so backward exchanges
//    only once (the gradients).
// Everything else (strided, multi-hop, empty pieces, changed extents,
// asymmetric 'same') takes the general path.
//
// Note [conv double backward]: both backward paths above compute the
// gradient outside autograd. Under create_graph (GradMode enabled in
// backward) ConvFn::backward instead rebuilds the forward of the general
// path from the saved input, weight and bias as a differentiable graph
// (gather_range, whose backward is a Function too, then at::convolution) and
// returns torch::autograd::grad of it with create_graph=true, whatever path
// the forward took. An empty piece gets a zero output that still depends on
// every input, so every rank runs the same halo adjoints in both backward
// passes (Note [collective discipline]). This keeps the gathered input alive
// for the second pass: Note [conv memory] does not hold under create_graph.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>

#include "comm/exchange.h"
#include "comm/function_output.h"
#include "comm/settings.h"
#include "ops/channel_conv.h"
#include "ops/common.h"
#include "ops/conv_transpose.h"
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
  std::vector<int64_t> fast_dims;       // batched tensor dims that are sharded
  std::vector<int64_t> fast_halos;      // halo width on both sides (= the symmetric padding)
  std::vector<int64_t> fast_mesh_dims;  // the mesh dims that shard them
  std::vector<int64_t> fast_padding;    // original padding on every spatial dim
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
  if (extra) x = constant_pad_piece(x, pad, 0);
  if (!p.batched) x = x.unsqueeze(0);
  return x;
}

bool has_zero(c10::IntArrayRef s) {
  for (int64_t v : s) {
    if (v == 0) return true;
  }
  return false;
}

// Note [conv overlap]: helpers of the fast path. Along each sharded dim i
// (batched tensor dim dims[i], halo h[i], local extent n[i]) the piece is
// extended to [-h, n + h): a 3^D arrangement of blocks indexed by an offset
// o in {-1, 0, 1}^D; block 0...0 is the local piece, block o != 0 comes from
// the neighbour at mesh offset o (corners from diagonal neighbours) or, past
// a global edge, is zeros.
constexpr int kConvHaloTag = 7211;

using Range1 = std::pair<int64_t, int64_t>;
using Box = std::vector<Range1>;  // per sharded dim

struct FastGeom {
  int64_t D = 0;
  std::vector<int64_t> dims, h, n;
  std::vector<bool> lo, hi;    // has a neighbour below / above along dim i
  std::vector<int64_t> coord;  // this rank's mesh coordinate
  std::vector<int64_t> mesh_dims;
  const DeviceMesh* mesh = nullptr;
};

FastGeom fast_geom(const at::Tensor& x, const ConvPlan& p) {
  FastGeom g;
  g.D = static_cast<int64_t>(p.fast_dims.size());
  g.dims = p.fast_dims;
  g.h = p.fast_halos;
  g.mesh_dims = p.fast_mesh_dims;
  g.mesh = &p.mesh;
  g.coord = p.mesh.coordinate();
  for (int64_t i = 0; i < g.D; ++i) {
    g.n.push_back(x.size(g.dims[i]));
    const int64_t c = g.coord[g.mesh_dims[i]], P = p.mesh.size(g.mesh_dims[i]);
    g.lo.push_back(c > 0 && g.h[i] > 0);
    g.hi.push_back(c + 1 < P && g.h[i] > 0);
  }
  return g;
}

// Offsets o != 0 with an existing neighbour, as index (base 3, digit o_i + 1).
std::vector<std::vector<int64_t>> neighbour_offsets(const FastGeom& g) {
  std::vector<std::vector<int64_t>> out;
  int64_t total = 1;
  for (int64_t i = 0; i < g.D; ++i) total *= 3;
  for (int64_t code = 0; code < total; ++code) {
    std::vector<int64_t> o(g.D);
    int64_t c = code;
    bool zero = true, ok = true;
    for (int64_t i = 0; i < g.D; ++i) {
      o[i] = c % 3 - 1;
      c /= 3;
      zero = zero && o[i] == 0;
      if ((o[i] < 0 && !g.lo[i]) || (o[i] > 0 && !g.hi[i])) ok = false;
    }
    if (!zero && ok) out.push_back(o);
  }
  return out;
}

int64_t offset_code(const std::vector<int64_t>& o) {
  int64_t code = 0;
  for (int64_t i = static_cast<int64_t>(o.size()) - 1; i >= 0; --i) code = code * 3 + o[i] + 1;
  return code;
}

int neighbour_rank(const FastGeom& g, const std::vector<int64_t>& o) {
  std::vector<int64_t> c = g.coord;
  for (int64_t i = 0; i < g.D; ++i) c[g.mesh_dims[i]] += o[i];
  return g.mesh->rank_of(c);
}

// The local slice that neighbour o reads as its halo (my edge rows toward o).
at::Tensor edge_slice(const at::Tensor& x, const FastGeom& g, const std::vector<int64_t>& o) {
  at::Tensor t = x;
  for (int64_t i = 0; i < g.D; ++i) {
    if (o[i] < 0) t = t.narrow(g.dims[i], 0, g.h[i]);
    if (o[i] > 0) t = t.narrow(g.dims[i], g.n[i] - g.h[i], g.h[i]);
  }
  return t;
}

std::vector<int64_t> block_shape(const at::Tensor& x, const FastGeom& g,
                                 const std::vector<int64_t>& o) {
  auto shape = x.sizes().vec();
  for (int64_t i = 0; i < g.D; ++i) {
    if (o[i] != 0) shape[g.dims[i]] = g.h[i];
  }
  return shape;
}

// Posts, for every neighbour o, the send of send[code(o)] and the receive into
// recv[code(o)].
comm::BlockExchange start_blocks(const FastGeom& g, const std::vector<at::Tensor>& send,
                                 const std::vector<at::Tensor>& recv) {
  std::vector<comm::PeerBlock> sends, recvs;
  for (const auto& o : neighbour_offsets(g)) {
    const int r = neighbour_rank(g, o);
    sends.push_back({r, send[offset_code(o)]});
    recvs.push_back({r, recv[offset_code(o)]});
  }
  return comm::start_block_exchange(*g.mesh, sends, recvs, kConvHaloTag);
}

// One piece of a region of the extended piece: which block, which rows of
// the block, and where in the region.
struct Part {
  std::vector<int64_t> o;
  Box in_block, in_region;
};

std::vector<Part> split_region(const FastGeom& g, const Box& region) {
  std::vector<Part> parts{Part{}};
  for (int64_t i = 0; i < g.D; ++i) {
    const int64_t lo = region[i].first, hi = region[i].second, n = g.n[i], h = g.h[i];
    std::vector<std::tuple<int64_t, Range1, Range1>> pieces;  // offset, in block, in region
    if (lo < 0) {
      const int64_t e = std::min<int64_t>(hi, 0);
      pieces.push_back({-1, {lo + h, e + h}, {0, e - lo}});
    }
    const int64_t a = std::max<int64_t>(lo, 0), b = std::min(hi, n);
    if (b > a) pieces.push_back({0, {a, b}, {a - lo, b - lo}});
    if (hi > n) {
      const int64_t s = std::max(lo, n);
      pieces.push_back({1, {s - n, hi - n}, {s - lo, hi - lo}});
    }
    std::vector<Part> next;
    for (const auto& pt : parts) {
      for (const auto& pc : pieces) {
        Part q = pt;
        q.o.push_back(std::get<0>(pc));
        q.in_block.push_back(std::get<1>(pc));
        q.in_region.push_back(std::get<2>(pc));
        next.push_back(q);
      }
    }
    parts = std::move(next);
  }
  return parts;
}

at::Tensor narrow_box(at::Tensor t, const FastGeom& g, const Box& box) {
  for (int64_t i = 0; i < g.D; ++i) {
    t = t.narrow(g.dims[i], box[i].first, box[i].second - box[i].first);
  }
  return t;
}

bool has_neighbour(const FastGeom& g, const std::vector<int64_t>& o) {
  for (int64_t i = 0; i < g.D; ++i) {
    if ((o[i] < 0 && !g.lo[i]) || (o[i] > 0 && !g.hi[i])) return false;
  }
  return true;
}

bool is_local(const std::vector<int64_t>& o) {
  for (int64_t v : o) {
    if (v != 0) return false;
  }
  return true;
}

// A region of the extended piece as a fresh tensor. Blocks past a global edge
// read as zeros; `zero_local` makes the local block read as zeros too.
at::Tensor region_tensor(const at::Tensor& x, const std::vector<at::Tensor>& halos,
                         const FastGeom& g, const Box& region, bool zero_local) {
  auto shape = x.sizes().vec();
  for (int64_t i = 0; i < g.D; ++i) shape[g.dims[i]] = region[i].second - region[i].first;
  at::Tensor out = at::zeros(shape, x.options());
  for (const auto& pt : split_region(g, region)) {
    const bool local = is_local(pt.o);
    if (local && zero_local) continue;
    if (!local && !has_neighbour(g, pt.o)) continue;
    const at::Tensor& block = local ? x : halos[offset_code(pt.o)];
    narrow_box(out, g, pt.in_region).copy_(narrow_box(block, g, pt.in_block));
  }
  return out;
}

// The output boxes that the interior convolution gets wrong, disjoint: along
// dim i the rows next to an internal boundary (merged when they overlap),
// crossed with the rows of earlier dims that are not such rows.
std::vector<Box> boundary_boxes(const FastGeom& g) {
  std::vector<std::vector<Range1>> bad(g.D), good(g.D);
  for (int64_t i = 0; i < g.D; ++i) {
    const int64_t n = g.n[i], h = g.h[i];
    Range1 l{0, 0}, r{n, n};
    if (g.lo[i]) l = {0, std::min(h, n)};
    if (g.hi[i]) r = {std::max<int64_t>(n - h, 0), n};
    if (g.lo[i] && g.hi[i] && l.second >= r.first) {
      bad[i].push_back({0, n});
    } else {
      if (g.lo[i]) bad[i].push_back(l);
      if (g.hi[i]) bad[i].push_back(r);
    }
    int64_t pos = 0;
    for (const auto& b : bad[i]) {
      if (b.first > pos) good[i].push_back({pos, b.first});
      pos = b.second;
    }
    if (pos < n) good[i].push_back({pos, n});
  }
  std::vector<Box> out;
  for (int64_t i = 0; i < g.D; ++i) {
    for (const auto& b : bad[i]) {
      std::vector<Box> boxes{Box{}};
      for (int64_t j = 0; j < g.D; ++j) {
        std::vector<Range1> choices;
        if (j < i) choices = good[j];
        if (j == i) choices = {b};
        if (j > i) choices = {{0, g.n[j]}};
        std::vector<Box> next;
        for (const auto& bx : boxes) {
          for (const auto& c : choices) {
            Box q = bx;
            q.push_back(c);
            next.push_back(q);
          }
        }
        boxes = std::move(next);
      }
      out.insert(out.end(), boxes.begin(), boxes.end());
    }
  }
  return out;
}

Box input_region(const FastGeom& g, const Box& out_box) {
  Box r;
  for (int64_t i = 0; i < g.D; ++i) {
    r.push_back({out_box[i].first - g.h[i], out_box[i].second + g.h[i]});
  }
  return r;
}

std::vector<int64_t> strip_padding(const ConvPlan& p) {
  std::vector<int64_t> pad = p.fast_padding;
  for (int64_t d : p.fast_dims) pad[d - 2] = 0;
  return pad;
}

int64_t num_codes(const FastGeom& g) {
  int64_t t = 1;
  for (int64_t i = 0; i < g.D; ++i) t *= 3;
  return t;
}

// Note [conv overlap]: forward of the fast path on the batched local piece.
// Returns the output and the received halo blocks (indexed by offset code,
// saved for backward).
std::pair<at::Tensor, std::vector<at::Tensor>> fast_forward(const at::Tensor& x,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& bias,
                                                            const ConvPlan& p) {
  const FastGeom g = fast_geom(x, p);
  std::vector<at::Tensor> send(num_codes(g)), halos(num_codes(g));
  for (const auto& o : neighbour_offsets(g)) {
    send[offset_code(o)] = edge_slice(x, g, o).contiguous();
    halos[offset_code(o)] = at::empty(block_shape(x, g, o), x.options());
  }
  auto pending = start_blocks(g, send, halos);
  const bool empty = has_zero(p.out_local_shape) || has_zero(x.sizes());
  const std::vector<int64_t> no_out_pad(p.nsp, 0);
  const at::Tensor b = p.has_bias ? bias : at::Tensor();
  at::Tensor out;
  if (empty) {
    out = at::zeros(p.out_local_shape, x.options());
  } else {
    // Interior: the local piece with the original padding; correct except in
    // the boundary boxes (which read zeros where the neighbours' rows belong).
    pending.test();
    out = at::convolution(x, weight, b, p.stride, p.fast_padding, p.dilation, false, no_out_pad,
                          p.groups);
  }
  pending.finish();
  send.clear();
  if (!empty) {
    const auto spad = strip_padding(p);
    for (const auto& box : boundary_boxes(g)) {
      at::Tensor s = region_tensor(x, halos, g, input_region(g, box), false);
      at::Tensor o =
          at::convolution(s, weight, b, p.stride, spad, p.dilation, false, no_out_pad, p.groups);
      narrow_box(out, g, box).copy_(o);
    }
  }
  return {out, halos};
}

// Note [conv overlap]: backward of the fast path. `g_out` is batched.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fast_backward(
    const at::Tensor& x, const at::Tensor& weight, const std::vector<at::Tensor>& halos,
    const at::Tensor& g_out, const ConvPlan& p, bool need_in, bool need_w, bool need_b) {
  const FastGeom g = fast_geom(x, p);
  const bool empty = has_zero(p.out_local_shape) || has_zero(x.sizes());
  const std::vector<int64_t> no_out_pad(p.nsp, 0);
  const auto spad = strip_padding(p);
  const auto nbrs = neighbour_offsets(g);
  // 1. The boundary boxes: gradient w.r.t. the halo blocks (sent to their
  //    owners) and the weight-gradient correction. By linearity in the input,
  //    the strip's weight gradient with the local block zeroed is exactly what
  //    the interior backward (which read zeros for the halos) misses.
  std::vector<at::Tensor> gsend(num_codes(g)), grecv(num_codes(g));
  if (need_in) {
    for (const auto& o : nbrs) {
      gsend[offset_code(o)] = at::zeros(block_shape(x, g, o), x.options());
      grecv[offset_code(o)] = at::empty(edge_slice(x, g, o).sizes(), x.options());
    }
  }
  at::Tensor gw_corr;
  if (!empty && (need_in || need_w)) {
    for (const auto& box : boundary_boxes(g)) {
      const Box region = input_region(g, box);
      at::Tensor s = region_tensor(x, halos, g, region, true);
      at::Tensor go = narrow_box(g_out, g, box).contiguous();
      at::Tensor gs, gws;
      std::tie(gs, gws, std::ignore) =
          at::convolution_backward(go, s, weight, c10::nullopt, p.stride, spad, p.dilation, false,
                                   no_out_pad, p.groups, {need_in, need_w, false});
      if (need_w) gw_corr = gw_corr.defined() ? gw_corr + gws : gws;
      if (need_in) {
        for (const auto& pt : split_region(g, region)) {
          if (is_local(pt.o) || !has_neighbour(g, pt.o)) continue;
          narrow_box(gsend[offset_code(pt.o)], g, pt.in_block)
              .add_(narrow_box(gs, g, pt.in_region));
        }
      }
    }
  }
  // 2. Send them back (the adjoint of the forward exchange) while 3. the
  //    interior backward runs.
  comm::BlockExchange pending;
  if (need_in) pending = start_blocks(g, gsend, grecv);
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
    // My edge rows toward o were neighbour o's halo: add its gradient.
    for (const auto& o : nbrs) edge_slice(gx, g, o).add_(grecv[offset_code(o)]);
  }
  if (need_w && gw_corr.defined()) gw.add_(gw_corr);
  return {gx, gw, gb};
}

// Note [conv double backward]: the general path's forward as a differentiable
// graph on the saved tensors, differentiated with create_graph=true. The
// output gradient `g` (undefined: zeros) is shaped like the output.
variable_list double_backward_grads(const at::Tensor& local, const at::Tensor& weight,
                                    const at::Tensor& bias, const at::Tensor& g, const ConvPlan& p,
                                    bool need_in, bool need_w, bool need_b) {
  at::Tensor x = gather_input(local, p);  // collective on every rank
  at::Tensor out;
  const at::Tensor b = p.has_bias ? bias : at::Tensor();
  if (has_zero(p.out_local_shape) || has_zero(x.sizes())) {
    // Zero output, still connected to every input (zero gradients everywhere).
    at::Tensor link = x.sum() + weight.sum();
    if (b.defined()) link = link + b.sum();
    out = at::zeros(p.out_local_shape, local.options()) + link * 0;
  } else {
    const std::vector<int64_t> no_out_pad(p.nsp, 0);
    out = at::convolution(x, weight, b, p.stride, p.local_padding, p.dilation, false, no_out_pad,
                          p.groups);
  }
  if (!p.batched) out = out.squeeze(0);
  const at::Tensor go = g.defined() ? g : at::zeros_like(out);
  std::vector<at::Tensor> inputs;
  if (need_in) inputs.push_back(local);
  if (need_w) inputs.push_back(weight);
  if (need_b) inputs.push_back(bias);
  at::Tensor gx, gw, gb;
  if (!inputs.empty()) {
    auto r = torch::autograd::grad({out}, inputs, {go}, /*retain_graph=*/true,
                                   /*create_graph=*/true, /*allow_unused=*/true);
    size_t i = 0;
    if (need_in) gx = r[i++];
    if (need_w) gw = r[i++];
    if (need_b) gb = r[i++];
  }
  return {gx, gw, gb, at::Tensor()};
}

// Hand-written (not gather_range + at::convolution under autograd): that graph would keep the
// halo-extended input alive for backward (Note [conv memory]) and could not overlap the
// exchange (Note [conv overlap]); its backward communicates only through comm/.
struct ConvFn : torch::autograd::Function<ConvFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, const at::Tensor& weight,
                            const at::Tensor& bias, std::shared_ptr<const ConvPlan> plan) {
    const ConvPlan& p = *plan;
    if (p.fast) {
      at::Tensor xb = p.batched ? local : local.unsqueeze(0);
      auto res = fast_forward(xb, weight, bias, p);
      at::Tensor out = res.first;
      // Note [conv memory]: only the local input, the weight and the halo
      // blocks are kept.
      variable_list keep{local, weight};
      keep.insert(keep.end(), res.second.begin(), res.second.end());
      keep.insert(keep.begin() + 2, p.has_bias ? bias : at::Tensor());
      ctx->save_for_backward(keep);
      ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan));
      ctx->saved_data["bias"] = p.has_bias;
      ctx->saved_data["bias_size"] = p.has_bias ? bias.size(0) : int64_t(0);
      if (!p.batched) out = out.squeeze(0);
      return comm::function_output(out, {local, weight, bias});
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
    ctx->save_for_backward({local, weight, p.has_bias ? bias : at::Tensor()});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan));
    ctx->saved_data["bias"] = p.has_bias;
    ctx->saved_data["bias_size"] = p.has_bias ? bias.size(0) : int64_t(0);
    if (!p.batched) out = out.squeeze(0);
    return comm::function_output(out, {local, weight, bias});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("ConvFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& local = saved[0];
    const at::Tensor& weight = saved[1];
    const auto& p = *static_cast<PlanHolder*>(ctx->saved_data.at("plan").toCapsule().get())->plan;
    const bool has_bias = ctx->saved_data.at("bias").toBool();
    const int64_t bias_size = ctx->saved_data.at("bias_size").toInt();
    const bool need_in = ctx->needs_input_grad(0);
    const bool need_w = ctx->needs_input_grad(1);
    const bool need_b = has_bias && ctx->needs_input_grad(2);

    if (at::GradMode::is_enabled()) {
      return double_backward_grads(local, weight, saved[2], grads[0], p, need_in, need_w, need_b);
    }
    at::Tensor g = grads[0];
    if (!g.defined()) g = at::zeros(p.out_local_shape, local.options());
    if (!p.batched) g = g.unsqueeze(0);

    if (p.fast) {
      at::Tensor xb = p.batched ? local : local.unsqueeze(0);
      at::Tensor gx, gw, gb;
      std::vector<at::Tensor> halos(saved.begin() + 3, saved.end());
      std::tie(gx, gw, gb) =
          fast_backward(xb, weight, halos, g.contiguous(), p, need_in, need_w, need_b);
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
                      int64_t first_sp, const DeviceMesh& mesh) {
  plan.fast = false;
  // Note [agreed settings]: read where every rank takes the same path.
  if (plan.plans.empty() || !comm::use_setting(mesh, Setting::ConvOverlap)) return;
  for (int64_t e : plan.extra_right) {
    if (e != 0) return;
  }
  std::vector<int64_t> dims, halos, mesh_dims;
  for (const stencil::DimPlan& dp : plan.plans) {
    const int64_t i = dp.dim - first_sp;
    const int64_t k = c.weight.size(2 + i);
    const int64_t h = c.pad_left[i];
    if (c.stride[i] != 1 || c.pad_right[i] != h || c.dilation[i] * (k - 1) != 2 * h) return;
    if (out_ext[i] != c.input.size(dp.dim) || dp.out_sizes != dp.in_sizes) return;
    for (int64_t n : dp.in_sizes) {
      if (n < std::max<int64_t>(h, 1)) return;  // single hop, no empty pieces
    }
    dims.push_back(i + 2);
    halos.push_back(h);
    mesh_dims.push_back(dp.mesh_dim);
  }
  plan.fast = true;
  plan.fast_dims = dims;
  plan.fast_halos = halos;
  plan.fast_mesh_dims = mesh_dims;
  plan.fast_padding = plan.local_padding;
  for (size_t j = 0; j < dims.size(); ++j) plan.fast_padding[dims[j] - 2] = halos[j];
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
  const bool string_padding = name == "aten::_convolution_mode" || overload == "padding";
  if (!string_padding && (name == "aten::convolution" || name == "aten::_convolution") &&
      args[6].toBool()) {
    return transposed_convolution_rule(op, std::move(args), stack);
  }
  ConvCall c;
  c.input = args[0].toTensor();
  c.weight = args[1].toTensor();
  if (args[2].isTensor()) c.bias = args[2].toTensor();
  if (!spec_of(c.input)) fail(op, args, "the input must be the ShardTensor");
  // Note [complex convolution]: libtorch's conv1d/2d/3d and conv_transpose*
  // decompose a complex convolution into three real ones (Gauss's trick);
  // at::convolution, which the sharded rules call, has no complex CPU kernel.
  // Refused on every rank (metadata only) rather than raised by the ranks that
  // hold data while those with empty pieces enter the exchange.
  if (c.input.is_complex() || c.weight.is_complex() || (c.bias.defined() && c.bias.is_complex())) {
    fail(op, args,
         "complex convolution is not supported on ShardTensors (Note [complex convolution]); "
         "convolve the real and imaginary parts");
  }
  const int64_t wdim = c.weight.dim();
  if (wdim < 3 || wdim > 5) fail(op, args, "expected a 3-d, 4-d or 5-d weight");
  const int64_t nsp = wdim - 2;
  // Note [reduced precision]: libtorch's verdict on these dtypes, before any communication.
  check_dtype_support(op, args, nsp == 1 ? "conv1d" : (nsp == 2 ? "conv2d" : "conv3d"),
                      {c.input.scalar_type(), c.weight.scalar_type(), dtype_or_none(c.bias)},
                      will_backward(c.input) || will_backward(c.weight) || will_backward(c.bias),
                      [nsp](c10::ArrayRef<at::ScalarType> t, bool rg) {
                        std::vector<int64_t> xs{1, 1}, ws{1, 1};
                        for (int64_t i = 0; i < nsp; ++i) {
                          xs.push_back(3);
                          ws.push_back(2);
                        }
                        const std::vector<int64_t> one(nsp, 1), zero(nsp, 0);
                        return at::convolution(probe_ones(xs, t[0], rg), probe_ones(ws, t[1]),
                                               probe_ones({1}, t[2]), one, zero, one, false, zero,
                                               1);
                      });
  const int64_t idim = c.input.dim();
  if (idim != nsp + 2 && idim != nsp + 1) {
    fail(op, args,
         "expected a " + std::to_string(nsp + 1) + "-d or " + std::to_string(nsp + 2) +
             "-d input for a " + std::to_string(wdim) + "-d weight");
  }
  const bool batched = idim == nsp + 2;
  const int64_t first_sp = batched ? 2 : 1;
  const int64_t cdim = first_sp - 1;

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

  // Note [plain fast path]: nothing but the batch dim is sharded over more than one rank.
  const ShardSpec& in_spec = *spec_of(c.input);
  if (runs_plain(in_spec, local_of(c.input),
                 batched ? std::vector<int64_t>{0} : std::vector<int64_t>{})) {
    return call_plain(op, std::move(args), stack);
  }

  // Note [conv layout]: the compute layout; Note [channel-sharded conv]: the
  // channel mesh dim, if the input channels are split over more than one rank
  // and the convolution is not grouped. Otherwise a channel-sharded input is
  // replicated along channels: a visible gather (Note [visible gathers]).
  const ChannelLayout layout =
      channel_layout(op, args, in_spec, cdim, c.groups, c.input.element_size(),
                     "conv replicates a channel-sharded input");
  const ShardSpec& compute = layout.compute;
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
  decide_fast_path(*plan, c, out_ext, first_sp, mesh);
  SpecPtr out_spec = stencil::output_spec(compute, out_shape, plan->plans);
  plan->out_local_shape = out_spec->local_shape();
  if (!batched) plan->out_local_shape.insert(plan->out_local_shape.begin(), 1);

  // Communication starts here (all validation above is metadata only).
  if (layout.ch_dim >= 0) {
    at::Tensor local = to_layout(c.input, layout.input, layout.input);
    at::Tensor weight = channel_weight(c.weight, layout, /*w_in_dim=*/1);
    plan->has_bias = false;
    at::Tensor partial = ConvFn::apply(local, weight, at::empty({0}, weight.options()),
                                       std::shared_ptr<const ConvPlan>(plan));
    stack->push_back(channel_output(partial, c.bias, *out_spec, layout, cdim));
    return;
  }
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
