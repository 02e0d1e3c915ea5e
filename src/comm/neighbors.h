#pragma once
// Private: the ring neighbour search behind shardtensor::knn and
// shardtensor::radius_search (Note [ring neighbour search], src/comm/neighbors.cpp).
#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <vector>

namespace shardtensor::comm {

struct RingStats {
  int64_t pieces_fetched = 0, pieces_skipped = 0, bytes_fetched = 0, bytes_skipped = 0;
};

struct NeighborResult {
  at::Tensor index;  // int64 [m, k], global point ids, -1 where fewer than k
  at::Tensor dist;   // [m, k] Euclidean distances in the points' dtype, +inf where -1
  RingStats stats;
};

/// Collective over `mesh_dim` of `mesh` (local when `mesh` is undefined: one
/// piece). `points` holds point_sizes[me] rows; up to `k` nearest points within
/// `radius` (+inf: none) of every local query, ordered by (distance, id).
NeighborResult ring_neighbors(const at::Tensor& queries, const at::Tensor& points,
                              const DeviceMesh& mesh, int64_t mesh_dim,
                              const std::vector<int64_t>& point_sizes, int64_t k, double radius);

/// Local. Squared distances [m, n] in float64, summed dim by dim in order (so
/// that equal inputs give bitwise equal distances whatever the blocking).
at::Tensor squared_distances(const at::Tensor& q, const at::Tensor& p);

}  // namespace shardtensor::comm
