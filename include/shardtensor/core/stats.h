#pragma once
/// \file Observability: deterministic counters so that tests can assert on
/// bytes instead of seconds. All functions here are **local**.

#include <cstdint>

namespace shardtensor {

/// Bytes and messages moved by this rank through the library's transport,
/// all primitives together. See docs/architecture.md ("Traffic accounting")
/// for how each collective is counted.
struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t messages = 0;
  /// Wall-clock seconds this rank spent inside the transport's MPI calls
  /// (blocking collectives, and posting plus waiting for point-to-point
  /// exchanges). Unlike the byte counters this is a timing, not deterministic;
  /// it includes time spent waiting for slower ranks. Always on (one
  /// steady_clock read before and after each call).
  double comm_seconds = 0.0;
  /// Bytes this rank received beyond its own piece because an op was run on
  /// gathered (replicated) data: the generic fallback, or a rule that
  /// replicates more than a rank's piece (Note [visible gathers] in
  /// <shardtensor/core/policy.h>). Also counted in bytes_received.
  int64_t gathered_bytes = 0;
};

/// Local. Counters since the last reset_comm_stats().
CommStats comm_stats();
/// Local. Sets all counters to zero.
void reset_comm_stats();

/// Live CPU tensor memory of this process, seen by a tracking allocator that
/// is installed as libtorch's CPU allocator when the library is loaded.
struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};

/// Local. Current and peak bytes since the last reset_peak_memory_stats().
MemoryStats memory_stats();
/// Local. Sets the peak to the current value.
void reset_peak_memory_stats();

namespace detail {
/// Local. Adds to the communication counters (used by comm/ only).
void record_comm(int64_t bytes_sent, int64_t bytes_received, int64_t messages);
/// Local. Adds to comm_seconds (used by comm/ only).
void record_comm_time(int64_t nanoseconds);
/// Local. Adds to gathered_bytes (Note [visible gathers]).
void record_gathered(int64_t bytes);
}  // namespace detail

}  // namespace shardtensor
