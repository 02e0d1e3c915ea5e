#include "ops/stencil.h"

namespace shardtensor::ops::stencil {

// Note [output-first halos]: a stencil rule partitions the *output* first and
// derives, per rank, the exact input range its output block reads. The halo on
// each side is that range minus what the rank owns: it may be asymmetric,
// differ per rank, be zero or negative (a trim), or reach past a neighbour
// (multi-hop); comm::gather_range handles all of these. Nothing here depends
// on local data, so every rank computes every rank's plan identically.

std::vector<int64_t> output_sizes(const std::vector<int64_t>& in_sizes, int64_t out_extent) {
  int64_t in_extent = 0;
  for (int64_t s : in_sizes) in_extent += s;
  if (in_extent == out_extent) return in_sizes;
  return balanced_sizes(out_extent, static_cast<int64_t>(in_sizes.size()));
}

std::vector<Range> window_ranges(const std::vector<int64_t>& out_sizes, int64_t kernel,
                                 int64_t stride, int64_t dilation, int64_t pad_left) {
  std::vector<Range> ranges;
  int64_t o0 = 0;
  for (int64_t n : out_sizes) {
    const int64_t lo = o0 * stride - pad_left;
    if (n == 0) {
      ranges.emplace_back(lo, lo);
    } else {
      const int64_t hi = (o0 + n - 1) * stride - pad_left + dilation * (kernel - 1) + 1;
      ranges.emplace_back(lo, hi);
    }
    o0 += n;
  }
  return ranges;
}

std::vector<DimPlan> window_plans(const ShardSpec& spec, const std::vector<int64_t>& spatial_dims,
                                  const std::vector<int64_t>& kernel,
                                  const std::vector<int64_t>& stride,
                                  const std::vector<int64_t>& dilation,
                                  const std::vector<int64_t>& pad_left,
                                  const std::vector<int64_t>& out_extent) {
  std::vector<DimPlan> plans;
  for (size_t i = 0; i < spatial_dims.size(); ++i) {
    const int64_t d = spatial_dims[i];
    const int64_t m = spec.mesh_dim_of(d);
    if (m < 0) continue;
    DimPlan p;
    p.dim = d;
    p.mesh_dim = m;
    p.in_sizes = spec.shard_sizes(m);
    p.out_sizes = output_sizes(p.in_sizes, out_extent[i]);
    p.ranges = window_ranges(p.out_sizes, kernel[i], stride[i], dilation[i], pad_left[i]);
    plans.push_back(std::move(p));
  }
  return plans;
}

at::Tensor gather_plans(const at::Tensor& local, const DeviceMesh& mesh,
                        const std::vector<DimPlan>& plans, PadMode mode, double value) {
  at::Tensor out = local;
  for (const auto& p : plans) {
    out = comm::gather_range(out, mesh, p.mesh_dim, p.dim, p.in_sizes, p.ranges, mode, value);
  }
  return out;
}

SpecPtr output_spec(const ShardSpec& spec, std::vector<int64_t> out_shape,
                    const std::vector<DimPlan>& plans) {
  ShardSizes sizes = spec.all_shard_sizes();
  for (const auto& p : plans) sizes[p.mesh_dim] = p.out_sizes;
  return make_spec(spec.mesh(), spec.placements(), std::move(out_shape), sizes);
}

Range my_range(const DimPlan& plan, const DeviceMesh& mesh) {
  return plan.ranges[mesh.coordinate()[plan.mesh_dim]];
}

}  // namespace shardtensor::ops::stencil
