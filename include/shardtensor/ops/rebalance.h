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
#include <shardtensor/comm/ghost.h>

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

/// **Collective** over every rank of the mesh. rebalance() from measured
/// time: `measured_seconds` is what this rank spent on its rows in the step
/// being balanced (e.g. a k-NN + message-passing step: its compute time, the
/// wall time minus the growth of comm_stats().comm_seconds, since waiting for
/// slower ranks is not this rank's cost), spread evenly over its
/// rows of `tensors[0]` as per-row cost (replicas along other mesh dims take
/// their slowest time). One call moves the partition towards balance; with
/// costs that are uneven inside a rank, a few steps of measure-and-rebalance
/// converge (the cost inside a rank is only known as its mean). Throws
/// c10::Error on every rank if `measured_seconds` is negative or not finite on
/// any rank, or as rebalance().
std::vector<at::Tensor> rebalance(const std::vector<at::Tensor>& tensors, double measured_seconds,
                                  std::vector<int64_t>* new_sizes = nullptr);

/// A graph moved to a cost-balanced node partition by rebalance_graph().
struct RebalancedGraph {
  std::vector<at::Tensor> nodes;  ///< the node tensors, in order, on the new partition
  at::Tensor edge_index;          ///< edges, each on the rank that owns its destination
  std::vector<at::Tensor> edges;  ///< the edge tensors, moved with their edges
  GhostPlan plan;                 ///< the GhostPlan of the moved edges' endpoints
  std::vector<int64_t> node_sizes, edge_sizes;
};

/// **Collective** over every rank of the mesh. Rebalances a row-sharded graph
/// (Note [rebalance by cost]): the node tensors go to
/// balanced_sizes_by_cost(weights); every edge (a row of the int64 ShardTensor
/// `edge_index` [E, k] of global node ids, sharded by rows along the nodes'
/// mesh dim) moves, in order, to the coordinate that owns its destination node
/// `edge_index[e, dst_column]` under the new partition, with the rows of every
/// `edge_tensors` entry (sharded like edge_index); and the GhostPlan for the
/// moved edges' endpoints is rebuilt (GhostPlan::build). Differentiable for
/// the node and edge tensors (redistribute, repartition). Throws c10::Error on
/// every rank if a tensor is not laid out so or a destination id is out of
/// range, or as rebalance().
RebalancedGraph rebalance_graph(const std::vector<at::Tensor>& node_tensors,
                                const at::Tensor& edge_index,
                                const std::vector<at::Tensor>& edge_tensors,
                                const at::Tensor& weights, int64_t dst_column = 1);

}  // namespace shardtensor
