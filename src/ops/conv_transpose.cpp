// Sharding rule for transposed convolution: conv_transpose1d,
// conv_transpose2d.input, conv_transpose3d.input (composite ops, intercepted
// before they decompose into aten::convolution).
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
// (via to_layout) so their gradients are summed over the sharded mesh dims.
#include <ATen/ATen.h>

#include "ops/common.h"
#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

std::vector<int64_t> expand(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                            std::vector<int64_t> v, int64_t nd, const char* what) {
  if (v.size() == 1) return std::vector<int64_t>(nd, v[0]);
  if (static_cast<int64_t>(v.size()) != nd) {
    fail(op, args, std::string(what) + " must have 1 or " + std::to_string(nd) + " elements");
  }
  return v;
}

void conv_transpose_rule(const c10::OperatorHandle& op, Stack* stack, int64_t nd) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& w = args[1].toTensor();
  const at::Tensor b = args[2].isNone() ? at::Tensor() : args[2].toTensor();
  const ShardSpec* xs = spec_of(x);
  if (!xs) fail(op, args, "the input must be a ShardTensor (sharded weights are not supported)");
  // Note [reduced precision]: libtorch's verdict on these dtypes, before any
  // communication. libtorch 1.13's CPU conv_transpose in bfloat16 runs a plain
  // convolution instead (a wrong shape, or wrong values when the channel
  // counts agree); the probe checks its result against float64.
  check_dtype_support(
      op, args, nd == 1 ? "conv_transpose1d" : (nd == 2 ? "conv_transpose2d" : "conv_transpose3d"),
      {x.scalar_type(), w.scalar_type(), dtype_or_none(b)},
      will_backward(x) || will_backward(w) || will_backward(b),
      [nd](c10::ArrayRef<at::ScalarType> t, bool rg) {
        std::vector<int64_t> xs{1, 2}, ws{2, 2};
        int64_t n = 2, m = 4;
        for (int64_t i = 0; i < nd; ++i) {
          xs.push_back(2);
          ws.push_back(2);
          n *= 2;
          m *= 2;
        }
        const at::Tensor xin = at::arange(1, n + 1, at::kDouble).view(xs);
        const at::Tensor win = at::arange(1, m + 1, at::kDouble).view(ws).div_(m);
        const std::vector<int64_t> one(nd, 1), zero(nd, 0);
        at::Tensor y = at::convolution(xin.to(t[0]).requires_grad_(rg), win.to(t[1]),
                                       probe_ones({2}, t[2]), one, zero, one, true, zero, 1);
        const at::Tensor ref = at::convolution(
            xin, win, t[2] == at::ScalarType::Undefined ? at::Tensor() : at::ones({2}, at::kDouble),
            one, zero, one, true, zero, 1);
        TORCH_CHECK(y.sizes() == ref.sizes() && at::allclose(y.detach().to(at::kDouble), ref, 0.05),
                    "its transposed convolution returns a wrong result (shape ", y.sizes(),
                    " where ", ref.sizes(), " is expected, or wrong values)");
        return y;
      });
  const auto stride = expand(op, args, int_list(args[3]), nd, "stride");
  const auto pad = expand(op, args, int_list(args[4]), nd, "padding");
  const auto opad = expand(op, args, int_list(args[5]), nd, "output_padding");
  const int64_t groups = args[6].toInt();
  const auto dil = expand(op, args, int_list(args[7]), nd, "dilation");

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
  ShardSpec in_spec = without_partial(*xs);
  if (in_spec.mesh_dim_of(cdim) >= 0) {
    fail(op, args, "sharding the channel dim of a transposed convolution is not supported");
  }
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

  at::Tensor local = xs->has_partial() ? to_layout(x, in_spec, in_spec) : local_of(x);
  const DeviceMesh& mesh = in_spec.mesh();
  const Placements rep(mesh.ndim(), Replicate{});
  at::Tensor wl = to_layout(w, ShardSpec(mesh, rep, w.sizes().vec()), in_spec);
  at::Tensor bl =
      b.defined() ? to_layout(b, ShardSpec(mesh, rep, b.sizes().vec()), in_spec) : at::Tensor();
  at::Tensor g = stencil::gather_plans(local, mesh, plans, PadMode::Constant, 0.0);

  std::vector<int64_t> oshape = shape;
  oshape[cdim] = cout;
  for (int64_t i = 0; i < nd; ++i) oshape[spatial[i]] = out_ext[i];
  SpecPtr out_spec = stencil::output_spec(in_spec, oshape, plans);
  const auto out_local = out_spec->local_shape();
  const auto out_off = out_spec->local_offsets();
  int64_t out_numel = 1;
  for (int64_t v : out_local) out_numel *= v;

  at::Tensor out;
  if (out_numel == 0) {
    // Stay connected to the gathered input, weight and bias so that their
    // backward collectives run on this rank too.
    at::Tensor z = g.sum() * 0 + wl.sum() * 0;
    if (bl.defined()) z = z + bl.sum() * 0;
    out = z.expand(out_local).contiguous();
  } else {
    std::vector<int64_t> lpad = pad, lopad = opad;
    for (const auto& pl : plans) {
      const int64_t i = pl.dim - (ndim - nd);
      lpad[i] = 0;
      lopad[i] = 0;
    }
    if (nd == 1) {
      out = at::conv_transpose1d(g, wl, bl, stride, lpad, lopad, groups, dil);
    } else if (nd == 2) {
      out = at::conv_transpose2d(g, wl, bl, stride, lpad, lopad, groups, dil);
    } else {
      out = at::conv_transpose3d(g, wl, bl, stride, lpad, lopad, groups, dil);
    }
    for (const auto& pl : plans) {
      const int64_t i = pl.dim - (ndim - nd);
      const int64_t lo = stencil::my_range(pl, mesh).first;
      const int64_t start = out_off[pl.dim] - (lo * stride[i] - pad[i]);
      out = out.narrow(pl.dim, start, out_local[pl.dim]);
    }
  }
  stack->push_back(wrap(out, out_spec));
}

const RuleRegistrar r1({"conv_transpose1d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, s, 1);
});
const RuleRegistrar r2({"conv_transpose2d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, s, 2);
});
const RuleRegistrar r3({"conv_transpose3d"}, [](const c10::OperatorHandle& op, Stack* s) {
  conv_transpose_rule(op, s, 3);
});

}  // namespace
}  // namespace shardtensor::ops
