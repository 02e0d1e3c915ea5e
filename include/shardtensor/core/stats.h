#pragma once
/// \file Observability: deterministic counters so that tests can assert on
/// bytes instead of seconds. All functions here are **local**.

#include <cstdint>
#include <string>

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
  /// Bytes copied between a device and host memory because the transport
  /// moves host memory only (Note [host staging] in comm/transport_mpi.cpp):
  /// each device buffer of a transport call counted once per copy, into
  /// host memory before the call and back after it. Zero for CPU pieces
  /// (unless SHARDTENSOR_STAGE_HOST=1 forces staging, for tests). Not part
  /// of bytes_sent / bytes_received.
  int64_t staged_bytes = 0;
};

/// Local. Counters since the last reset_comm_stats().
CommStats comm_stats();
/// Local. Sets all counters to zero.
void reset_comm_stats();

/// Live tensor memory of this process. CPU: seen by a tracking allocator
/// that is installed as libtorch's CPU allocator when the library is loaded.
/// CUDA: read from torch's CUDA caching allocator (what
/// torch.cuda.memory_allocated() and max_memory_allocated() report) for the
/// current CUDA device, once CUDA is initialised in this process.
struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  /// "cuda:N", the device the two counts below are for; empty (and both 0)
  /// when torch has no CUDA or has not initialised its CUDA allocator.
  std::string device;
  int64_t device_current_bytes = 0;
  int64_t device_peak_bytes = 0;
};

/// Local. Current and peak bytes since the last reset_peak_memory_stats().
/// Does not throw.
MemoryStats memory_stats();
/// Local. Sets the CPU peak to the current value, and the CUDA allocator's
/// peak on the current device (torch.cuda.reset_peak_memory_stats()).
void reset_peak_memory_stats();

/// Bytes this rank moved between files and memory through the io/ layer
/// (read_hdf5, write_hdf5, checkpoints). Counted per transfer as the number
/// of elements this rank selected times the element size of the dataset's
/// type in the file, so the count is exactly the rank's hyperslab (plus its
/// halo) whatever MPI-IO does underneath, and independent of dtype conversion
/// in memory. Metadata (headers, attributes) is not counted.
struct IoStats {
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  /// Dataset read / write calls this rank took part in (empty selections included).
  int64_t reads = 0;
  int64_t writes = 0;
};

/// Local. Counters since the last reset_io_stats().
IoStats io_stats();
/// Local. Sets all I/O counters to zero.
void reset_io_stats();

namespace detail {
/// Local. Adds to the I/O counters (used by io/ only).
void record_io(int64_t bytes_read, int64_t bytes_written, int64_t reads, int64_t writes);
/// Local. Adds to the communication counters (used by comm/ only).
void record_comm(int64_t bytes_sent, int64_t bytes_received, int64_t messages);
/// Local. Adds to comm_seconds (used by comm/ only).
void record_comm_time(int64_t nanoseconds);
/// Local. Adds to gathered_bytes (Note [visible gathers]).
void record_gathered(int64_t bytes);
/// Local. Adds to staged_bytes (used by comm/ only; Note [host staging]).
void record_staged(int64_t bytes);
}  // namespace detail

}  // namespace shardtensor
