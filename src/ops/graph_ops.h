#pragma once
// Private: the GhostPlan cache of the message-passing rules (index_select,
// gather, index_add, scatter_add, scatter_reduce on row-sharded nodes and
// edges; Note [index plan cache] in ops/graph_ops.cpp), exposed for tests.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <shardtensor/comm/ghost.h>
#include <shardtensor/spec/shard_spec.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtensor::ops {

/// A GhostPlan of an index and the index mapped to extended rows.
struct IndexPlan {
  GhostPlan plan;
  at::Tensor rows;  ///< int64, the shape of the ids
};

/// Collective over every rank of `mesh` (one all-reduce; a collective
/// GhostPlan::build when any rank misses the cache). The plan of the global
/// ids `idx` (this rank's ids, any shape, int64 or int32) over mesh dim `m`
/// whose coordinates own `node_sizes` rows, and `idx` mapped to extended rows
/// (Note [index plan cache]). The cache entry is keyed on `key` (the tensor
/// the ids were derived from: the index's local piece, or a replicated index;
/// undefined: not cached) and `extra` (integers that say how: e.g. the dim
/// and the slice taken). Throws on every rank, naming the call in `op` and
/// `args`, if any rank holds an id outside [0, sum(node_sizes)).
IndexPlan index_plan(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     const DeviceMesh& mesh, int64_t m, const std::vector<int64_t>& node_sizes,
                     const at::Tensor& idx, const at::Tensor& key,
                     const std::vector<int64_t>& extra);

/// Note [partial rules]. Local, metadata only. Whether the rules of Note
/// [index ops along any dim] take a call of `name` ("index_select",
/// "index_add" or "index_copy") with the boxed arguments `args` in schema
/// order (index_add's alpha included), for rules that re-express an op as one
/// of these (index.Tensor, index_put_).
bool index_rule_takes(const std::string& name, const std::vector<c10::IValue>& args);

/// Collective over every rank of the mesh of `spec` (Note [index ops along
/// any dim]). `local` is this rank's piece of a tensor laid out as `spec`,
/// whose dim `d` is sharded by a mesh dim; returns, differentiably, the rows
/// along `d` with the global ids `ids` (int64, 1-D, this rank's own list):
/// local.index_select(d, ...) on the global tensor. Only the rows this rank
/// lacks move (one GhostPlan); the backward sums each row's gradient on its
/// owner. Throws on every rank, naming the call, if any rank's id is outside
/// [0, spec.global_shape()[d]).
at::Tensor select_along(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                        const at::Tensor& local, const ShardSpec& spec, int64_t d,
                        const at::Tensor& ids);

struct IndexPlanCacheStats {
  int64_t builds = 0;  ///< plans built (collective GhostPlan::build) since the last clear
  int64_t reuses = 0;  ///< calls that reused a cached plan on every rank
  size_t entries = 0;  ///< plans held now (at most kMaxIndexPlans)
};

/// Local. The cache's counters on this rank.
IndexPlanCacheStats index_plan_cache_stats();

/// Local. Drops every cached plan and zeroes the counters. Call it on every
/// rank of a mesh alike (a rank that kept its plans would skip the rebuild
/// that the others take part in; the agreement of Note [index plan cache]
/// turns that into a rebuild everywhere, so it is safe, only wasteful).
void clear_index_plan_cache();

/// The most plans the cache holds (least recently used ones are dropped).
constexpr size_t kMaxIndexPlans = 16;

}  // namespace shardtensor::ops
