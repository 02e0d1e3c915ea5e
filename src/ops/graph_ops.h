#pragma once
// Private: the GhostPlan cache of the message-passing rules (index_select,
// gather, index_add, scatter_add, scatter_reduce on row-sharded nodes and
// edges; Note [index plan cache] in ops/graph_ops.cpp), exposed for tests.
#include <cstddef>
#include <cstdint>

namespace shardtensor::ops {

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
