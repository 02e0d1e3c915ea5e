#pragma once
/// \file Load balancing by cost: new row partitions from per-row costs.
///
/// Note [rebalance by cost]
/// ~~~~~~~~~~~~~~~~~~~~~~~~
/// With per-row costs w_i (>= 0; e.g. neighbour counts, or measured seconds
/// spread over a rank's rows), row i sits at the midpoint
/// m_i = sum_{j<i} w_j + w_i / 2 of the global cost line [0, W]. Coordinate c
/// of P gets the rows whose midpoint lies in [W c / P, W (c+1) / P): the cut
/// before coordinate c is #{i : m_i < W c / P}. Each rank counts its own rows
/// for every cut (the midpoints are monotone, so a binary search), and one
/// all-reduce of P-1 counts gives the cuts: no row moves to compute the
/// partition, and the result is the same whatever the current one.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardtensor {

/// **Collective** over every rank of `weights`' mesh. New sizes of the mesh
/// dim that shards the rows of `weights` (a 1-D ShardTensor, Shard(0) along one
/// mesh dim, others Replicate; non-negative, finite), balancing the summed
/// weight per coordinate (Note [rebalance by cost]). Throws c10::Error on every
/// rank if `weights` is not laid out so, or (any rank) holds a negative or
/// non-finite weight.
std::vector<int64_t> balanced_sizes_by_cost(const at::Tensor& weights);

/// **Collective** over every rank of the mesh. Redistributes every ShardTensor
/// of `tensors` (each sharded by rows like `weights`: the same mesh dim and
/// sizes) to balanced_sizes_by_cost(weights); returns them in order
/// (differentiable, ShardTensor::redistribute). `new_sizes`, when given,
/// receives the sizes. Throws like balanced_sizes_by_cost(), and if a tensor
/// is not laid out like `weights`.
std::vector<at::Tensor> rebalance(const std::vector<at::Tensor>& tensors, const at::Tensor& weights,
                                  std::vector<int64_t>* new_sizes = nullptr);

}  // namespace shardtensor
