#pragma once
/// \file Host-side cost of the dispatcher boundary (Note [dispatch stats] in
/// src/dispatch/dispatcher.cpp): how many aten calls on ShardTensors were
/// intercepted, how each was handled, and the wall time the interception
/// itself took outside the rule, the decomposition and the fallback. All
/// functions here are **local** (no communication) and never throw.

#include <cstdint>

namespace shardtensor {

/// Counters since the last reset_dispatch_stats(), over all threads.
struct DispatchStats {
  /// Aten calls intercepted (at the autograd or the backend key), every
  /// nesting level counted: a decomposed op counts once, and its pieces
  /// count again.
  int64_t calls = 0;
  int64_t rule_calls = 0;      ///< handled by a sharding rule (src/ops/)
  int64_t decompositions = 0;  ///< re-dispatched into a CompositeImplicitAutograd decomposition
  int64_t fallbacks = 0;       ///< run through the generic fallback (Note [generic fallback])
  /// Wall seconds spent finding the handler (rule lookup): after the first
  /// call of an op this is a cached pointer read (Note [rule cache]).
  double lookup_seconds = 0.0;
  /// Wall seconds the interception spent outside the handler: lookup,
  /// argument scan for write-backs and view sources, write-back afterwards,
  /// and the SHARDTENSOR_DEBUG agreement check when enabled. Includes
  /// lookup_seconds.
  double boundary_seconds = 0.0;
  /// Wall seconds inside handlers whose call was not nested in another
  /// intercepted call (the rule's own work, its local kernels and its
  /// communication). Step time minus this is time spent outside ShardTensor ops.
  double handler_seconds = 0.0;
};

/// Local. Counters since the last reset_dispatch_stats().
DispatchStats dispatch_stats();
/// Local. Sets all counters to zero.
void reset_dispatch_stats();

}  // namespace shardtensor
