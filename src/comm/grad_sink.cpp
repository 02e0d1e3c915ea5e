// The gradient-sink registry (comm/grad_sink.h, Note [gradient buckets]): which
// replicated leaves send their partial gradients to a sink (nn/'s bucketed
// reducer) instead of all-reducing them in use_replicated()'s backward.
#include "comm/grad_sink.h"

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace shardtensor::comm {

namespace detail {
namespace {
struct SinkEntry {
  c10::weak_intrusive_ptr<at::TensorImpl> leaf;
  DeviceMesh mesh;
  std::shared_ptr<ReplicatedGradSink> sink;
};
std::atomic<bool> g_before_use{false};
std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const at::TensorImpl*, SinkEntry>& sink_registry() {
  static auto* r = new std::unordered_map<const at::TensorImpl*, SinkEntry>();  // never destroyed
  return *r;
}
}  // namespace

void set_grad_sink(const at::Tensor& leaf, const DeviceMesh& mesh,
                   std::shared_ptr<ReplicatedGradSink> sink) {
  TORCH_CHECK(leaf.defined(), "set_grad_sink: undefined tensor");
  std::lock_guard<std::mutex> lock(sink_mutex());
  auto& reg = sink_registry();
  // Drop entries whose tensors are gone (their address may be reused).
  for (auto it = reg.begin(); it != reg.end();) {
    it = it->second.leaf.expired() ? reg.erase(it) : std::next(it);
  }
  const at::TensorImpl* key = leaf.unsafeGetTensorImpl();
  if (!sink) {
    reg.erase(key);
    return;
  }
  reg.erase(key);
  if (sink->wants_before_use()) g_before_use.store(true, std::memory_order_relaxed);
  reg.emplace(key, SinkEntry{c10::weak_intrusive_ptr<at::TensorImpl>(leaf.getIntrusivePtr()), mesh,
                             std::move(sink)});
}

std::shared_ptr<ReplicatedGradSink> grad_sink_for(const at::Tensor& t, const DeviceMesh& mesh,
                                                  const std::vector<int64_t>& mesh_dims) {
  if (!t.defined() || !t.requires_grad() || !t.is_leaf()) return nullptr;
  std::shared_ptr<ReplicatedGradSink> sink;
  {
    std::lock_guard<std::mutex> lock(sink_mutex());
    auto& reg = sink_registry();
    if (reg.empty()) return nullptr;
    auto it = reg.find(t.unsafeGetTensorImpl());
    if (it == reg.end() || it->second.leaf.expired() || it->second.mesh != mesh) return nullptr;
    sink = it->second.sink;
  }
  return sink->takes(mesh.ndim(), mesh_dims) ? sink : nullptr;
}

bool before_use_enabled() { return g_before_use.load(std::memory_order_relaxed); }

void before_replicated_use(const at::Tensor& t) {
  if (!before_use_enabled() || !t.defined()) return;
  std::shared_ptr<ReplicatedGradSink> sink;
  const at::TensorImpl* leaf = nullptr;
  {
    std::lock_guard<std::mutex> lock(sink_mutex());
    auto& reg = sink_registry();
    if (reg.empty()) return;
    const at::TensorBase* candidates[2] = {&t, t.is_view() ? &t._base() : nullptr};
    for (const at::TensorBase* c : candidates) {
      if (c == nullptr || !c->defined()) continue;
      auto it = reg.find(c->unsafeGetTensorImpl());
      if (it == reg.end() || it->second.leaf.expired()) continue;
      sink = it->second.sink;
      leaf = it->first;
      break;
    }
  }
  // Outside the lock: the sink may communicate, and may register tensors.
  if (sink) sink->before_use(leaf);
}

size_t grad_sink_registry_size() {
  std::lock_guard<std::mutex> lock(sink_mutex());
  return sink_registry().size();
}

}  // namespace detail

}  // namespace shardtensor::comm
