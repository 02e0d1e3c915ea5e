// Interception of every aten op that touches a ShardTensor (Note [dispatch]).
//
// Note [dispatch]: a ShardTensor carries the keys PrivateUse1 and
// AutogradPrivateUse1. A boxed *fallback* at AutogradPrivateUse1 would not see
// ops that have derivative formulas or composite kernels (the dispatcher
// prefers those), so at load time we walk every registered aten op and
// register one boxed kernel per op for AutogradPrivateUse1 on a library that
// lives for the whole process. Composite ops (conv2d, layer_norm, matmul...)
// therefore arrive before their decomposition. The kernel looks up the rule
// table (ops/registry.h; an out-variant runs through its functional
// overload's rule, Note [out variants]); without a rule, an op that has a
// CompositeImplicitAutograd kernel is re-dispatched below the autograd key into
// its decomposition, whose pieces come back here one by one; any other op
// runs through the generic fallback on gathered tensors (Note [generic
// fallback], dispatch/fallback.cpp), or in strict mode raises a c10::Error
// naming the op and the arguments' placements. Those
// decisions depend only on metadata that is identical on every rank, so every
// rank throws, and none is left in a collective.
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/dispatch/stats.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/diagnostic.h"
#include "comm/error_channel.h"
#include "comm/grad_sink.h"
#include "comm/settings.h"
#include "core/debug.h"
#include "core/fingerprint.h"
#include "dispatch/fallback.h"
#include "ops/common.h"
#include "ops/out_variants.h"

namespace shardtensor::dispatch {
namespace {

// Note [dispatch stats]: relaxed atomic counters of the interception itself
// (DispatchStats in <shardtensor/dispatch/stats.h>). Always on: four
// steady_clock reads per intercepted call (~100 ns), against the microseconds
// of the rule it dispatches to. `depth` is the nesting level of intercepted
// calls on this thread, so handler_seconds counts outermost handlers only.
struct Counters {
  std::atomic<int64_t> calls{0}, rule_calls{0}, decompositions{0}, fallbacks{0};
  std::atomic<int64_t> lookup_ns{0}, boundary_ns{0}, handler_ns{0};
};
Counters& counters() {
  static Counters* c = new Counters();  // never destroyed: ops run during static teardown
  return *c;
}
thread_local int depth = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Debug mode: every rank must be running the same op on the same global
// shapes and placements; a mismatch throws on every rank instead of hanging.
void check_agreement(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  auto shards = ops::shard_args(args);
  std::string fp = op.operator_name().name + "." + op.operator_name().overload_name;
  for (const auto& t : shards) fp += "|" + ops::spec_of(t)->to_string();
  const DeviceMesh& mesh = ops::spec_of(shards[0])->mesh();
  // Uncounted (Note [traffic accounting]): CommStats are the same with and
  // without SHARDTENSOR_DEBUG. FNV-1a, identical on every rank (std::hash is not).
  // The settings that decide collectives are agreed here too, over the whole
  // mesh (Note [settings at op entry], comm/settings.cpp).
  const uint64_t with_settings =
      detail::Fingerprint().add(fp).add(static_cast<int64_t>(comm::settings_fingerprint())).value();
  if (!comm::diagnostic_agree(mesh, with_settings).same) {
    comm::check_settings(mesh);  // raises on every rank when a setting differs
    ops::fail(op, args, "SHARDTENSOR_DEBUG: ranks disagree on the op or its layouts");
  }
}

// Whether libtorch's result of the view op `op` on `self` would be a copy
// (Note [wrapper strides]): contiguous() of a non-contiguous tensor, and a
// reshape or flatten that the strides do not allow as a view. Such a result
// is a tensor of its own: it must not inherit its source's write-back or
// refusal. Decided from the wrapper's strides (identical on every rank).
bool torch_copies(const c10::OperatorHandle& op, const at::Tensor& self, const at::Tensor& r) {
  const std::string& name = op.operator_name().name;
  if (name == "aten::contiguous") return r.unsafeGetTensorImpl() != self.unsafeGetTensorImpl();
  if (name == "aten::reshape" || name == "aten::flatten") {
    return !at::detail::computeStride(self.sizes(), self.strides(), r.sizes()).has_value();
  }
  return false;
}

// Note [view write-back] (tensor/shard_tensor_impl.h): the result of a view op
// on a source that writes back writes back through it too. Note [stale copy
// views] (ops/shape.cpp): a result that is a true view of its source (the
// rule gave it no write-back of its own) shares the source wrapper's version
// counter, as libtorch's views share their base's; a view of a copy view is
// brought up to date through its source.
void chain_write_back(const at::Tensor& self, const at::Tensor& r) {
  auto* ri = detail::shard_impl(r);
  auto* si = detail::shard_impl(self);
  if (!ri || !si || ri == si) return;
  const auto own = ri->write_back();
  if (!own && si->version_counter().enabled() && !ri->is_inference()) {
    ri->set_version_counter(si->version_counter());
  }
  if (!si->write_back()) return;
  const auto parent = si->write_back();
  if (own && !own->fn) return;  // already refused
  auto wb = std::make_shared<detail::WriteBack>();
  if (!parent->fn) {
    wb->refusal = parent->refusal;
  } else if (own) {
    wb->fn = [own, parent, self](const at::Tensor& t) {
      own->fn(t);
      parent->fn(self);
    };
  } else {
    wb->fn = [parent, self](const at::Tensor&) { parent->fn(self); };
  }
  if (own) {
    // A copy of its own, whose refresh brings its source up to date first.
    wb->refresh = own->refresh;
    wb->refreshes = own->refreshes;
    wb->stale = own->stale;
  } else if (parent->refresh) {
    wb->refresh = [parent, self](const at::Tensor&) { parent->refresh(self); };
    wb->refreshes = parent->refreshes;
    if (parent->stale)
      wb->stale = [parent, self](const at::Tensor&) { return parent->stale(self); };
  }
  ri->set_write_back(std::move(wb));
}

// Note [rule cache]: how an op is handled (its rule, or decomposition, or the
// fallback) depends only on the op, and rules register themselves during
// static initialisation (RuleRegistrar), before any op can run on a
// ShardTensor. So each op's kernel object (one per op and dispatch key)
// resolves it once, on its first call, and keeps the answer: the per-call
// cost is one atomic load instead of the registry's mutex and a string
// concatenation of the op's name and overload (ops::find_rule). A rule
// registered after an op's first call would not be seen by that op.
// A rule with a predicate (Note [partial rules], ops/registry.h) hands the
// calls it does not take to the handling of an op without a rule.
struct Handler {
  const ops::Rule* rule = nullptr;
  const ops::Accepts* accepts = nullptr;  // null: the rule takes every call
  bool decomposes = false;                // the op has a CompositeImplicitAutograd kernel
  bool returns_view = false;              // ops::returns_view(schema)
};

// Note [integer arguments of decompositions]: some decompositions read the
// data of an integer tensor argument on the host (tensor_split's indices,
// ctc_loss's lengths: data_ptr, after .to(kLong) or .contiguous()), which a
// ShardTensor cannot give (its storage access throws). An integer or bool
// argument that is a replicated ShardTensor holds the whole value on every
// rank, so before decomposing it is replaced by its local tensor: the result
// is the same on every rank, and such an argument carries no gradient. Only
// while another ShardTensor argument remains, so that the op still comes back
// here with its results sharded; a call whose only ShardTensors are such
// integers keeps them. The decision reads metadata only (alike on every rank).
void unwrap_replicated_integers(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  auto unwrappable = [](const c10::IValue& v) {
    if (!v.isTensor()) return false;
    const ShardSpec* s = ops::spec_of(v.toTensor());
    return s != nullptr && s->is_replicated() &&
           at::isIntegralType(v.toTensor().scalar_type(), /*includeBool=*/true);
  };
  bool other = false;
  std::vector<size_t> which;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = *(first + static_cast<std::ptrdiff_t>(i));
    if (unwrappable(v)) {
      which.push_back(i);
    } else if (!ops::shard_args({v}).empty()) {
      other = true;
    }
  }
  if (!other) return;
  for (size_t i : which) {
    c10::IValue& v = *(first + static_cast<std::ptrdiff_t>(i));
    v = ops::local_of(v.toTensor());
  }
}

void run(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
         const Handler& h) {
  Counters& c = counters();
  if (h.rule != nullptr && (h.accepts == nullptr || (*h.accepts)(op, *stack))) {
    c.rule_calls.fetch_add(1, std::memory_order_relaxed);
    (*h.rule)(op, stack);
    return;
  }
  if (h.decomposes) {
    // Note [decomposition skips ADInplaceOrView]: torch 2.x registers ADInplaceOrView
    // kernels for some composite view ops (aten::chunk, for nested tensors). That kernel
    // runs the decomposition under AutoDispatchBelowADInplaceOrView, which hides the
    // autograd keys from every op inside it, so the pieces would come back below
    // autograd and the result would have no gradient (found by
    // Attention.MultiheadAttentionModule: chunk of a projection). A plain CPU tensor
    // reaches the CompositeImplicitAutograd kernel straight from AutogradCPU; so does a
    // ShardTensor here, by leaving ADInplaceOrView out of the redispatch.
    c.decompositions.fetch_add(1, std::memory_order_relaxed);
    unwrap_replicated_integers(op, stack);  // Note [integer arguments of decompositions]
    op.redispatchBoxed((ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                                 c10::DispatchKey::AutogradPrivateUse1))
                           .remove(c10::DispatchKey::ADInplaceOrView),
                       stack);
    return;
  }
  c.fallbacks.fetch_add(1, std::memory_order_relaxed);
  generic_fallback(op, stack);
}

void kernel_body(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
                 const Handler& h, int64_t t_enter) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  if (detail::debug_enabled()) {
    std::vector<c10::IValue> args(stack->end() - n, stack->end());
    check_agreement(op, args);
  }
  // Written ShardTensor arguments (their wrappers' versions are bumped), those
  // of them that are views needing a write-back, and the source of a view op
  // (Note [view write-back], Note [stale copy views]). Copy views among the
  // arguments are brought up to date first.
  std::vector<at::Tensor> written, bumped;
  at::Tensor view_source;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    const auto* a = schema.arguments()[i].alias_info();
    const bool writes = a && a->isWrite();
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        detail::refresh_copy_view(t);
        if (writes && detail::shard_impl(t)) bumped.push_back(t);
      }
      continue;
    }
    if (!v.isTensor()) continue;
    auto* impl = detail::shard_impl(v.toTensor());
    if (!impl) continue;
    if (i == 0 && h.returns_view) view_source = v.toTensor();
    if (writes) bumped.push_back(v.toTensor());
    if (!impl->write_back()) continue;
    if (writes) {
      if (!impl->write_back()->fn) {
        std::vector<c10::IValue> args(stack->end() - n, stack->end());
        ops::fail(op, args,
                  "cannot write in place into this ShardTensor: " + impl->write_back()->refusal);
      }
      written.push_back(v.toTensor());
    }
    detail::refresh_copy_view(v.toTensor());
  }
  if (comm::detail::before_use_enabled()) {
    // fully_shard gathers a unit's parameters at their first use with a
    // ShardTensor (Note [fully_shard]), also where no rule marks them.
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = (*stack)[stack->size() - n + i];
      if (v.isTensor()) {
        if (!detail::shard_impl(v.toTensor())) comm::detail::before_replicated_use(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) {
          if (!detail::shard_impl(t)) comm::detail::before_replicated_use(t);
        }
      }
    }
  }
  Counters& c = counters();
  const int64_t t_run = now_ns();
  ++depth;
  struct Leave {
    ~Leave() { --depth; }
  } leave;
  run(op, ks, stack, h);
  const int64_t t_ran = now_ns();
  if (depth == 1) c.handler_ns.fetch_add(t_ran - t_run, std::memory_order_relaxed);
  for (const auto& t : bumped) detail::bump_alias_version(t);
  for (const auto& t : written) detail::shard_impl(t)->write_back()->fn(t);
  if (view_source.defined()) {
    const size_t nret = schema.returns().size();
    for (size_t j = stack->size() - nret; j < stack->size(); ++j) {
      const c10::IValue& r = (*stack)[j];
      if (r.isTensor()) {
        if (!torch_copies(op, view_source, r.toTensor()))
          chain_write_back(view_source, r.toTensor());
      } else if (r.isTensorList()) {
        for (const at::Tensor& t : r.toTensorList()) chain_write_back(view_source, t);
      }
    }
  }
  c.boundary_ns.fetch_add((t_run - t_enter) + (now_ns() - t_ran), std::memory_order_relaxed);
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
            const Handler& h, int64_t t_enter) {
  // Names the op in watchdog messages (Note [watchdog]); the schema's name lives
  // as long as the operator registration.
  const char* name = op.operator_name().name.c_str();
  const OpLabel label(name);
  // An error raised on some ranks only reaches every rank (Note [carried rule
  // errors] in comm/error_channel.h).
  comm::errors::run_as_op(name, [&] { kernel_body(op, ks, stack, h, t_enter); });
}

// One per op and dispatch key (Note [rule cache]).
class CachedKernel final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const int64_t t0 = now_ns();
    Counters& c = counters();
    c.calls.fetch_add(1, std::memory_order_relaxed);
    std::call_once(resolved_, [&] {
      if (const ops::OutAdapter* a = ops::find_out_adapter(op)) {  // Note [out variants]
        handler_.rule = &a->rule;
        handler_.accepts = &a->accepts;
      } else {
        handler_.rule = ops::find_rule(op.operator_name());
        handler_.accepts = ops::find_accepts(op.operator_name());
      }
      handler_.decomposes = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
      handler_.returns_view = ops::returns_view(op.schema());
    });
    c.lookup_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    kernel(op, ks, stack, handler_, t0);
  }

 private:
  std::once_flag resolved_;
  Handler handler_;
};

// Note [below-autograd interception]: code that excludes the autograd keys
// (torch:: factory functions such as torch::empty_like run under
// AutoDispatchBelowADInplaceOrView; InferenceMode) skips AutogradPrivateUse1
// and lands on the PrivateUse1 backend key, where a CompositeExplicitAutograd
// kernel would happily build a plain full-size tensor. So the same kernel is
// also registered at PrivateUse1 for every op that has no
// CompositeImplicitAutograd kernel; composite ops keep their decomposition at
// PrivateUse1 (which is where the autograd-level kernel sends them), and their
// pieces come back here.
struct Registration {
  std::unique_ptr<torch::Library> autograd_lib;
  std::unique_ptr<torch::Library> backend_lib;
  Registration() {
    autograd_lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
    backend_lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      std::string full = name.name.substr(6);
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      autograd_lib->impl(
          full.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CachedKernel>()));
      auto op = dispatcher.findOp(name);
      if (op && !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
        backend_lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                            std::make_unique<CachedKernel>()));
      }
    }
  }
};

// Registered when the library is loaded; never destroyed (kernels must outlive
// every ShardTensor, including ones freed during static teardown). `used`
// keeps the pointer in the binary although nothing reads it, so that
// LeakSanitizer sees the registration as reachable rather than leaked.
[[gnu::used]] const Registration* const registration = new Registration();

}  // namespace
}  // namespace shardtensor::dispatch

namespace shardtensor {

DispatchStats dispatch_stats() {
  const auto& c = dispatch::counters();
  DispatchStats s;
  s.calls = c.calls.load(std::memory_order_relaxed);
  s.rule_calls = c.rule_calls.load(std::memory_order_relaxed);
  s.decompositions = c.decompositions.load(std::memory_order_relaxed);
  s.fallbacks = c.fallbacks.load(std::memory_order_relaxed);
  s.lookup_seconds = 1e-9 * static_cast<double>(c.lookup_ns.load(std::memory_order_relaxed));
  s.boundary_seconds = 1e-9 * static_cast<double>(c.boundary_ns.load(std::memory_order_relaxed));
  s.handler_seconds = 1e-9 * static_cast<double>(c.handler_ns.load(std::memory_order_relaxed));
  return s;
}

void reset_dispatch_stats() {
  auto& c = dispatch::counters();
  for (auto* a : {&c.calls, &c.rule_calls, &c.decompositions, &c.fallbacks, &c.lookup_ns,
                  &c.boundary_ns, &c.handler_ns})
    a->store(0, std::memory_order_relaxed);
}

}  // namespace shardtensor
