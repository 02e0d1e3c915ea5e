#pragma once
// Halo arithmetic shared by the stencil rules (convolution, pooling,
// interpolation, padding). See DESIGN.md "Halo arithmetic" and
// Note [output-first halos].
#include <shardtensor/comm/primitives.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "ops/common.h"
#include "spec/arith.h"

namespace shardtensor::ops::stencil {

using Range = std::pair<int64_t, int64_t>;  // half-open global index range [lo, hi)

/// Local. The output partition along a sharded dim: the input's sizes when the
/// extent is unchanged (so same-size stencils move only halos), else
/// balanced-block over the same number of coordinates.
std::vector<int64_t> output_sizes(const std::vector<int64_t>& in_sizes, int64_t out_extent);

/// Local. For a sliding window (output o reads input o*stride - pad_left + j*dilation,
/// j in [0, kernel)), the input range each output block needs. Empty blocks get
/// an empty range.
std::vector<Range> window_ranges(const std::vector<int64_t>& out_sizes, int64_t kernel,
                                 int64_t stride, int64_t dilation, int64_t pad_left);

/// One sharded spatial dim of a stencil op.
struct DimPlan {
  int64_t dim = 0;       ///< tensor dim
  int64_t mesh_dim = 0;  ///< the mesh dim that shards it
  std::vector<int64_t> in_sizes, out_sizes;
  std::vector<Range> ranges;  ///< per coordinate: the input range it needs
};

/// Local. For every sharded dim of `spec` among `spatial_dims`, the plan of a
/// sliding window op with the given per-dim parameters (indexed like
/// spatial_dims) and output extents.
std::vector<DimPlan> window_plans(const ShardSpec& spec, const std::vector<int64_t>& spatial_dims,
                                  const std::vector<int64_t>& kernel,
                                  const std::vector<int64_t>& stride,
                                  const std::vector<int64_t>& dilation,
                                  const std::vector<int64_t>& pad_left,
                                  const std::vector<int64_t>& out_extent);

/// Collective over the planned mesh dims. Differentiable. Exchanges halos dim
/// by dim (corners included, since later dims carry earlier halos), so the
/// result covers exactly this rank's planned input ranges; ranges that cross
/// the global edge are filled per `mode`/`value`.
at::Tensor gather_plans(const at::Tensor& local, const DeviceMesh& mesh,
                        const std::vector<DimPlan>& plans, PadMode mode, double value = 0.0);

/// Local. `spec` with a new global shape and, for each planned dim, the output sizes.
SpecPtr output_spec(const ShardSpec& spec, std::vector<int64_t> out_shape,
                    const std::vector<DimPlan>& plans);

/// Local. Per coordinate along a mesh dim, this rank's range: ranges[coordinate].
Range my_range(const DimPlan& plan, const DeviceMesh& mesh);

}  // namespace shardtensor::ops::stencil
