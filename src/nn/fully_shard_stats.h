#pragma once
/// \file Counters of fully_shard's overlap (private; Note [fully_shard
/// prefetch] in nn/fully_shard.cpp), for tests and benchmarks.

#include <cstdint>

namespace shardtensor::detail {

/// Process-wide counts since the process started. Local.
struct FullyShardOverlapStats {
  int64_t forward_prefetches = 0;        ///< gathers started ahead, for the next unit in forward
  int64_t backward_prefetches = 0;       ///< gathers started ahead, for the unit before in backward
  int64_t prefetches_used = 0;           ///< started gathers whose result was installed
  int64_t stale_prefetches = 0;          ///< started gathers dropped: the shard changed meanwhile
  int64_t reductions_started = 0;        ///< non-blocking gradient reduce-scatters started
  int64_t reductions_finished_late = 0;  ///< of those, finished when the next unit's started
};

/// Local.
FullyShardOverlapStats fully_shard_overlap_stats();

}  // namespace shardtensor::detail
