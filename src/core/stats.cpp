#include <ATen/Context.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/impl/alloc_cpu.h>
#include <shardtensor/core/stats.h>
#include "core/channel.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shardtensor {

namespace {

// Constant-initialized, so they are valid during static initialization and
// destruction of any library (tensors may be freed very late).
std::atomic<int64_t> g_bytes_sent{0};
std::atomic<int64_t> g_bytes_received{0};
std::atomic<int64_t> g_messages{0};
std::atomic<int64_t> g_comm_nanoseconds{0};
std::atomic<int64_t> g_gathered_bytes{0};
std::atomic<int64_t> g_staged_bytes{0};
std::atomic<int64_t> g_current_bytes{0};
std::atomic<int64_t> g_io_bytes_read{0};
std::atomic<int64_t> g_io_bytes_written{0};
std::atomic<int64_t> g_io_reads{0};
std::atomic<int64_t> g_io_writes{0};
std::atomic<int64_t> g_peak_bytes{0};

void raise_peak_to(int64_t value) {
  int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (value > peak &&
         !g_peak_bytes.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
  }
}

// Note [tracking allocator layout]: libtorch's raw_allocate()/raw_deallocate()
// (used by some CPU kernels, e.g. gelu) require the DataPtr's context to be the
// data pointer itself and a plain raw_deleter(). So the size lives in a header
// of kHeader bytes in front of the data; kHeader is a multiple of c10's CPU
// alignment so the data stays aligned.
constexpr size_t kHeader = c10::gAlignment >= sizeof(size_t) ? c10::gAlignment : 64;
static_assert(kHeader % alignof(std::max_align_t) == 0 && kHeader >= sizeof(size_t),
              "the header must keep the data aligned and hold the size");

void delete_tracked(void* data) {
  if (data == nullptr) {
    return;  // zero-byte allocation
  }
  char* base = static_cast<char*>(data) - kHeader;
  size_t nbytes = 0;
  std::memcpy(&nbytes, base, sizeof(nbytes));
  g_current_bytes.fetch_sub(static_cast<int64_t>(nbytes), std::memory_order_relaxed);
  c10::free_cpu(base);
}

/// libtorch's CPU allocator while the library is loaded: c10::alloc_cpu /
/// c10::free_cpu (alignment, OOM errors) plus live and peak byte counters.
/// It does not zero-fill/junk-fill (the caffe2_cpu_allocator_* debug flags)
/// nor report to the profiler.
struct TrackingCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return {nullptr, nullptr, &delete_tracked, c10::Device(c10::DeviceType::CPU)};
    }
    char* base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeader));  // throws on OOM
    std::memcpy(base, &nbytes, sizeof(nbytes));
    const int64_t now =
        g_current_bytes.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
        static_cast<int64_t>(nbytes);
    raise_peak_to(now);
    void* data = base + kHeader;
    return {data, data, &delete_tracked, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_tracked; }

  void copy_data(void* dest, const void* src, size_t count) const override {
    if (count > 0) {
      std::memcpy(dest, src, count);
    }
  }
};

// Wins over libtorch's default CPU allocator (registered with priority 0).
constexpr uint8_t kTrackingAllocatorPriority = 1;

struct InstallTrackingAllocator {
  InstallTrackingAllocator() {
    // Leaked on purpose: tensors may outlive every static object.
    static auto* tracker = new TrackingCPUAllocator();
    c10::SetCPUAllocator(tracker, kTrackingAllocatorPriority);
  }
};

const InstallTrackingAllocator g_install_tracking_allocator;

}  // namespace

CommStats comm_stats() {
  CommStats s;
  s.bytes_sent = g_bytes_sent.load(std::memory_order_relaxed);
  s.bytes_received = g_bytes_received.load(std::memory_order_relaxed);
  s.messages = g_messages.load(std::memory_order_relaxed);
  s.comm_seconds = static_cast<double>(g_comm_nanoseconds.load(std::memory_order_relaxed)) * 1e-9;
  s.gathered_bytes = g_gathered_bytes.load(std::memory_order_relaxed);
  s.staged_bytes = g_staged_bytes.load(std::memory_order_relaxed);
  return s;
}

void reset_comm_stats() {
  g_bytes_sent.store(0, std::memory_order_relaxed);
  g_bytes_received.store(0, std::memory_order_relaxed);
  g_messages.store(0, std::memory_order_relaxed);
  g_comm_nanoseconds.store(0, std::memory_order_relaxed);
  g_gathered_bytes.store(0, std::memory_order_relaxed);
  g_staged_bytes.store(0, std::memory_order_relaxed);
}

namespace {

/// torch's CUDA caching allocator and the current CUDA device, when torch has
/// CUDA and the allocator is initialised (so that asking creates no CUDA
/// context); nullptr otherwise.
c10::DeviceAllocator* cuda_allocator(c10::DeviceIndex* index) {
  try {
    if (!at::hasCUDA()) return nullptr;
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    if (allocator == nullptr || !allocator->initialized()) return nullptr;
    *index = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice().index();
    return allocator;
  } catch (const std::exception&) {
    return nullptr;
  }
}

}  // namespace

MemoryStats memory_stats() {
  MemoryStats s;
  s.current_bytes = g_current_bytes.load(std::memory_order_relaxed);
  s.peak_bytes = std::max(g_peak_bytes.load(std::memory_order_relaxed), s.current_bytes);
  c10::DeviceIndex index = 0;
  if (auto* allocator = cuda_allocator(&index)) {
    try {
      const auto stats = allocator->getDeviceStats(index);
      const auto& all =
          stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      s.device = "cuda:" + std::to_string(index);
      s.device_current_bytes = all.current;
      s.device_peak_bytes = all.peak;
    } catch (const std::exception&) {
      s.device.clear();
    }
  }
  return s;
}

void reset_peak_memory_stats() {
  g_peak_bytes.store(g_current_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
  c10::DeviceIndex index = 0;
  if (auto* allocator = cuda_allocator(&index)) allocator->resetPeakStats(index);
}

IoStats io_stats() {
  IoStats s;
  s.bytes_read = g_io_bytes_read.load(std::memory_order_relaxed);
  s.bytes_written = g_io_bytes_written.load(std::memory_order_relaxed);
  s.reads = g_io_reads.load(std::memory_order_relaxed);
  s.writes = g_io_writes.load(std::memory_order_relaxed);
  return s;
}

void reset_io_stats() {
  g_io_bytes_read.store(0, std::memory_order_relaxed);
  g_io_bytes_written.store(0, std::memory_order_relaxed);
  g_io_reads.store(0, std::memory_order_relaxed);
  g_io_writes.store(0, std::memory_order_relaxed);
}

namespace detail {
void record_io(int64_t bytes_read, int64_t bytes_written, int64_t reads, int64_t writes) {
  g_io_bytes_read.fetch_add(bytes_read, std::memory_order_relaxed);
  g_io_bytes_written.fetch_add(bytes_written, std::memory_order_relaxed);
  g_io_reads.fetch_add(reads, std::memory_order_relaxed);
  g_io_writes.fetch_add(writes, std::memory_order_relaxed);
}
namespace {
thread_local int t_uncounted = 0;  // open UncountedComm scopes on this thread
}  // namespace
UncountedComm::UncountedComm() { ++t_uncounted; }
UncountedComm::~UncountedComm() { --t_uncounted; }
void record_comm(int64_t bytes_sent, int64_t bytes_received, int64_t messages) {
  if (t_uncounted > 0) return;
  g_bytes_sent.fetch_add(bytes_sent, std::memory_order_relaxed);
  g_bytes_received.fetch_add(bytes_received, std::memory_order_relaxed);
  g_messages.fetch_add(messages, std::memory_order_relaxed);
}
void record_comm_time(int64_t nanoseconds) {
  if (t_uncounted > 0) return;
  g_comm_nanoseconds.fetch_add(nanoseconds, std::memory_order_relaxed);
}
void record_gathered(int64_t bytes) {
  g_gathered_bytes.fetch_add(bytes, std::memory_order_relaxed);
}
void record_staged(int64_t bytes) { g_staged_bytes.fetch_add(bytes, std::memory_order_relaxed); }
}  // namespace detail

}  // namespace shardtensor
