#pragma once
/// \file The halo accumulate as a forward primitive (private to the library;
/// used by the col2im rule). Kept out of the public primitives header so far.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace shardtensor::comm {

/// Collective over `mesh_dim`: the adjoint of gather_range() (halo
/// accumulate) as a forward op (Note [accumulate range]). `range_local` holds
/// this coordinate's values for the global range ranges[me] along `dim`;
/// every element is sent to the coordinate that owns its index under the
/// partition `sizes` and summed there (elements outside [0, sum(sizes)) are
/// dropped). Returns this rank's piece (sizes[me] along `dim`). Backward:
/// gather_range with fill 0. Throws c10::Error on every rank, before any
/// message, if the sizes or ranges disagree or the extent of `range_local`
/// along `dim` is not the length of its range.
at::Tensor accumulate_range(const at::Tensor& range_local, const DeviceMesh& mesh, int64_t mesh_dim,
                            int64_t dim, const std::vector<int64_t>& sizes,
                            const std::vector<std::pair<int64_t, int64_t>>& ranges);

}  // namespace shardtensor::comm
