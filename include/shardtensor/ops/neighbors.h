#pragma once
/// \file Neighbour search on row-sharded point clouds
/// (Note [ring neighbour search], src/comm/neighbors.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace shardtensor {

/// What one search moved and what the bounding-box pre-filter saved (this rank).
struct NeighborStats {
  int64_t pieces_fetched = 0;  ///< foreign point pieces received
  int64_t pieces_skipped = 0;  ///< non-empty foreign pieces never sent (box too far)
  int64_t bytes_fetched = 0;   ///< point bytes received
  int64_t bytes_skipped = 0;   ///< point bytes that the pre-filter saved
};

/// The `k` nearest points of every query: returns (index, distance), both
/// [num_queries, k]: global point ids (int64) and Euclidean distances (the
/// points' dtype), ordered by distance, ties broken by the smaller global id;
/// id -1 and distance +inf where fewer than k points exist.
///
/// `queries` [Nq, d] and `points` [Np, d] are both ShardTensors sharded
/// Shard(0) along the same one mesh dim (others Replicate; a Partial mesh
/// dim is summed first, Note [pending partial sums]), any sizes
/// including empty pieces; the results are ShardTensors laid out like
/// `queries`. Both plain: a single-process search. **Collective** over every
/// rank of the mesh (argument check) and the mesh dim that shards the rows
/// (the ring). Not differentiable. Memory per rank: the local pieces plus one
/// foreign piece at a time. `stats`, when given, receives this rank's counts.
///
/// Throws c10::Error on every rank, before any communication, if k < 1, the
/// tensors are not 2-D with the same d, or are not sharded as described.
std::pair<at::Tensor, at::Tensor> knn(const at::Tensor& queries, const at::Tensor& points,
                                      int64_t k, NeighborStats* stats = nullptr);

/// Like knn() with k = `max_neighbors`, keeping only points within distance
/// `r` (inclusive): the up to max_neighbors nearest points within r of every
/// query. Throws also if r < 0.
std::pair<at::Tensor, at::Tensor> radius_search(const at::Tensor& queries, const at::Tensor& points,
                                                double r, int64_t max_neighbors,
                                                NeighborStats* stats = nullptr);

}  // namespace shardtensor
