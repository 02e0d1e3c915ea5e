#pragma once
// Note [channel-sharded conv] (src/ops/conv.cpp): the layouts and the
// communication shared by the convolution (src/ops/conv.cpp) and the
// transposed convolution (src/ops/conv_transpose.cpp) when the input's
// channel dim is sharded. Private to the op rules.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "ops/common.h"

namespace shardtensor::ops {

/// Local (metadata only, every rank agrees). The compute layout of a
/// convolution (Note [conv layout]): `in_spec`'s Shard placements on every
/// tensor dim but `cdim` (sizes kept), Replicate elsewhere (the channel dim
/// and Partial mesh dims).
ShardSpec channel_replicated(const ShardSpec& in_spec, int64_t cdim);

/// Local (metadata only). The mesh dim of size > 1 whose Shard(cdim) the
/// convolution keeps, or -1 when the channel dim is not sharded (or only on
/// a mesh dim of size 1) or `groups` > 1 (a grouped convolution replicates
/// the channels instead).
int64_t channel_mesh_dim(const ShardSpec& in_spec, int64_t cdim, int64_t groups);

/// The layouts of a convolution over a possibly channel-sharded input.
struct ChannelLayout {
  ShardSpec compute;    // channel_replicated(in_spec, cdim)
  int64_t ch_dim = -1;  // channel_mesh_dim(in_spec, cdim, groups)
  ShardSpec input;      // the input's layout for the local convolution
};

/// Local (metadata only). The layouts above. With ch_dim >= 0, `input` is
/// `compute` with Shard(cdim) (the input's sizes) on ch_dim; otherwise it is
/// `compute`. When converting the input to `input` replicates more than its
/// piece (groups > 1 on a channel-sharded input), calls note_gather (Note
/// [visible gathers]: counted, or thrown on every rank in strict mode, naming
/// the op, its arguments and `what`; `itemsize`: the input's element size).
/// Call on every rank before any communication.
ChannelLayout channel_layout(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                             const ShardSpec& in_spec, int64_t cdim, int64_t groups,
                             int64_t itemsize, const std::string& what);

/// Collective over the mesh dims on which `weight` must be redistributed
/// (none for a plain replicated weight). The weight piece matching the
/// input channels of `layout.input`: Shard(w_in_dim) on ch_dim with the
/// input's channel sizes (w[:, c0:c1] for a convolution, w_in_dim 1;
/// w[c0:c1] for a transposed one, w_in_dim 0), Replicate elsewhere; its
/// gradient is summed over the other mesh dims that shard the input and
/// all-gathered over ch_dim in backward (to_layout). Differentiable.
at::Tensor channel_weight(const at::Tensor& weight, const ChannelLayout& layout, int64_t w_in_dim);

/// **Collective** over `layout.ch_dim`. `partial` is this rank's share of the
/// sum over the channel pieces (laid out as `out_spec`, every output channel,
/// channel dim `cdim`): comm::reduce_scatter sums it and splits the output
/// channels (balanced) over ch_dim; then `bias` (undefined: none), sharded
/// the same way, is added to this rank's output channels. Returns the
/// wrapped result, Shard(cdim) on ch_dim, `out_spec`'s placements elsewhere.
/// Differentiable.
at::Tensor channel_output(const at::Tensor& partial, const at::Tensor& bias,
                          const ShardSpec& out_spec, const ChannelLayout& layout, int64_t cdim);

}  // namespace shardtensor::ops
