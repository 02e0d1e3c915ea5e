// Note [channel-sharded conv] (src/ops/conv.cpp): helpers shared by the
// convolution and the transposed convolution rules.
#include "ops/channel_conv.h"

namespace shardtensor::ops {

ShardSpec channel_replicated(const ShardSpec& in_spec, int64_t cdim) {
  const DeviceMesh& mesh = in_spec.mesh();
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
  return ShardSpec(mesh, cp, in_spec.global_shape(), csizes);
}

int64_t channel_mesh_dim(const ShardSpec& in_spec, int64_t cdim, int64_t groups) {
  const int64_t m = in_spec.mesh_dim_of(cdim);
  return groups == 1 && m >= 0 && in_spec.mesh().size(m) > 1 ? m : -1;
}

ChannelLayout channel_layout(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                             const ShardSpec& in_spec, int64_t cdim, int64_t groups,
                             int64_t itemsize, const std::string& what) {
  const ShardSpec compute = channel_replicated(in_spec, cdim);
  ChannelLayout l{compute, channel_mesh_dim(in_spec, cdim, groups), compute};
  if (l.ch_dim >= 0) {
    Placements p = l.compute.placements();
    ShardSizes s = l.compute.all_shard_sizes();
    p[l.ch_dim] = Shard{cdim};
    s[l.ch_dim] = in_spec.shard_sizes(l.ch_dim);
    l.input = ShardSpec(in_spec.mesh(), p, in_spec.global_shape(), s);
  }
  const ShardSpec own = without_partial(in_spec);
  if (gathers(own, l.input)) {
    note_gather(op, args, in_spec.mesh(), gathered_bytes(own, l.input, itemsize), what);
  }
  return l;
}

at::Tensor channel_weight(const at::Tensor& weight, const ChannelLayout& layout, int64_t w_in_dim) {
  const DeviceMesh& mesh = layout.input.mesh();
  Placements p(mesh.ndim(), Replicate{});
  ShardSizes s(mesh.ndim());
  p[layout.ch_dim] = Shard{w_in_dim};
  s[layout.ch_dim] = layout.input.shard_sizes(layout.ch_dim);
  return to_layout(weight, ShardSpec(mesh, p, weight.sizes().vec(), s), layout.input);
}

at::Tensor channel_output(const at::Tensor& partial, const at::Tensor& bias,
                          const ShardSpec& out_spec, const ChannelLayout& layout, int64_t cdim) {
  const DeviceMesh& mesh = out_spec.mesh();
  const int64_t m = layout.ch_dim;
  Placements o_p = out_spec.placements();
  ShardSizes o_s = out_spec.all_shard_sizes();
  o_p[m] = Shard{cdim};
  o_s[m] = balanced_sizes(out_spec.global_shape()[cdim], mesh.size(m));
  SpecPtr final_spec = make_spec(mesh, o_p, out_spec.global_shape(), o_s);
  at::Tensor out = comm::reduce_scatter(partial, mesh, m, cdim, o_s[m]);
  if (bias.defined()) {
    Placements b_p(mesh.ndim(), Replicate{});
    ShardSizes b_s(mesh.ndim());
    b_p[m] = Shard{0};
    b_s[m] = o_s[m];
    at::Tensor b = to_layout(bias, ShardSpec(mesh, b_p, bias.sizes().vec(), b_s), *final_spec);
    // [C] against [C, spatial...] (the trailing dims of the batched or unbatched output).
    std::vector<int64_t> bshape(out_spec.global_shape().size() - cdim, 1);
    bshape[0] = -1;
    out = out + b.view(bshape);
  }
  return wrap(out, final_spec);
}

}  // namespace shardtensor::ops
