// Note [wrapper autograd]: in libtorch (1.13 and 2.11-2.14 alike) `Tensor::requires_grad_()`,
// `retain_grad()`, `is_leaf()`, `grad_fn()`, `output_nr()` and `backward()`
// are not dispatched; they go through at::impl::VariableHooksInterface, a
// process-wide interface that libtorch's autograd installs and that exists to
// be implemented. We install a delegating implementation: for a ShardTensor
// these act on the local piece (where autograd history lives), for every other
// tensor they call libtorch's own hooks unchanged. No foreign
// AutogradMetaInterface is ever installed: libtorch static_casts autograd meta
// to torch::autograd::AutogradMeta (torch::autograd::impl::get_autograd_meta),
// so the wrapper only ever gets a genuine AutogradMeta from libtorch's factory.
//
//  - requires_grad_(b) sets the flag on the local piece and mirrors it on the
//    wrapper, so `t.requires_grad()` tells the truth. For a leaf piece, a post
//    hook on its gradient accumulator then copies every accumulated gradient
//    into the wrapper's own grad field as a ShardTensor, so `t.grad()` works
//    after backward (ShardTensor(t).grad() always does, with no hook).
//  - retain_grad()/retains_grad()/is_leaf()/grad_fn()/output_nr(): the piece's.
//  - backward(gradient, retain_graph, create_graph) on a ShardTensor is
//    shardtensor::backward(t, gradient, retain_graph, create_graph)
//    (collective); `inputs=` is refused with a clear error (shardtensor::grad
//    takes inputs).
// `t.grad()` of a non-leaf ShardTensor after retain_grad() is only available
// as ShardTensor(t).grad(): libtorch reads a wrapper's grad field directly.
// The interface is libtorch 2.x's (grad_dtype, basic_autograd_not_implemented_fallback);
// its Node pointer is std::shared_ptr before torch 2.13 and c10::intrusive_ptr from
// 2.13 on (pytorch#181782), spelled here as decltype(Edge::function).
#include <ATen/core/VariableHooksInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "tensor/shard_tensor_impl.h"

namespace shardtensor::detail {
namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct GradMirror : torch::autograd::FunctionPostHook {
  explicit GradMirror(WeakImpl w) : wrapper(std::move(w)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    auto strong = wrapper.lock();
    if (!strong) return outputs;
    at::Tensor t(std::move(strong));
    ShardTensor g = ShardTensor(t).grad();
    if (g.defined()) t.unsafeGetTensorImpl()->mutable_grad() = g;
    return outputs;
  }
  WeakImpl wrapper;
};

}  // namespace

void mirror_requires_grad(const at::Tensor& t) {
  auto* i = dynamic_cast<ShardTensorImpl*>(t.unsafeGetTensorImpl());
  if (!i) return;
  const bool on = i->local().requires_grad();
  if (on || t.unsafeGetTensorImpl()->autograd_meta()) {
    t.unsafeGetTensorImpl()->set_requires_grad(on);  // libtorch's own AutogradMeta
  }
  if (on && i->local().is_leaf() && !i->grad_mirror()) {
    auto acc = torch::autograd::impl::grad_accumulator(i->local());
    if (acc) {
      acc->add_post_hook(std::make_unique<GradMirror>(WeakImpl(t.getIntrusivePtr())));
      i->grad_mirror() = std::make_shared<decltype(acc)>(acc);  // keeps the node alive
    }
  }
}

namespace {

struct ShardVariableHooks final : at::impl::VariableHooksInterface {
  explicit ShardVariableHooks(at::impl::VariableHooksInterface* b) : orig(b) {}
  at::impl::VariableHooksInterface* orig;

  at::TensorBase tensor_data(const at::TensorBase& t) const override {
    return orig->tensor_data(t);
  }
  at::TensorBase variable_data(const at::TensorBase& t) const override {
    return orig->variable_data(t);
  }
  using NodePtr = decltype(torch::autograd::Edge::function);
  const NodePtr& grad_fn(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->grad_fn(i->local());
    return orig->grad_fn(t);
  }
  unsigned _register_hook(
      const at::TensorBase& t,
      std::function<at::TensorBase(const at::TensorBase&)> hook) const override {
    return orig->_register_hook(t, std::move(hook));
  }
  void remove_hook(const at::TensorBase& t, unsigned pos) const override {
    orig->remove_hook(t, pos);
  }
  bool is_view(const at::TensorBase& t) const override { return orig->is_view(t); }
  const at::TensorBase& base(const at::TensorBase& t) const override { return orig->base(t); }
  const std::string& name(const at::TensorBase& t) const override { return orig->name(t); }
  bool is_leaf(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->is_leaf(i->local());
    return orig->is_leaf(t);
  }
  int64_t output_nr(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->output_nr(i->local());
    return orig->output_nr(t);
  }
  void set_data(const at::TensorBase& t, const at::TensorBase& d) const override {
    orig->set_data(t, d);
  }
  at::TensorBase data(const at::TensorBase& t) const override { return orig->data(t); }
  int64_t _version(const at::TensorBase& t) const override { return orig->_version(t); }
  void retain_grad(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->retain_grad(i->local());
    orig->retain_grad(t);
  }
  bool retains_grad(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->retains_grad(i->local());
    return orig->retains_grad(t);
  }
  void _backward(const at::Tensor& t, at::TensorList inputs,
                 const std::optional<at::Tensor>& gradient, std::optional<bool> keep_graph,
                 bool create_graph) const override {
    if (!impl_of(t)) return orig->_backward(t, inputs, gradient, keep_graph, create_graph);
    TORCH_CHECK(inputs.empty(),
                "ShardTensor.backward(): inputs= is not supported on a ShardTensor; call "
                "shardtensor::grad(outputs, inputs, ...) instead");
    std::optional<bool> retain;
    if (keep_graph) retain = *keep_graph;
    shardtensor::backward(t, gradient.value_or(at::Tensor()), retain, create_graph);
  }
  void requires_grad_(const at::TensorBase& t, bool on) const override {
    auto* i = impl_of(t);
    if (!i) return orig->requires_grad_(t, on);
    orig->requires_grad_(i->local(), on);
    mirror_requires_grad(at::Tensor(t.getIntrusivePtr()));
  }
  void basic_autograd_not_implemented_fallback(const c10::OperatorHandle& op,
                                               c10::DispatchKeySet ks,
                                               torch::jit::Stack* stack) const override {
    orig->basic_autograd_not_implemented_fallback(op, ks, stack);
  }
  std::optional<c10::ScalarType> grad_dtype(const at::TensorBase& t) const override {
    if (auto* i = impl_of(t)) return orig->grad_dtype(i->local());
    return orig->grad_dtype(t);
  }
  void set_grad_dtype(const at::TensorBase& t,
                      const std::optional<c10::ScalarType>& d) const override {
    if (auto* i = impl_of(t)) orig->set_grad_dtype(i->local(), d);
    orig->set_grad_dtype(t, d);
  }

 private:
  static ShardTensorImpl* impl_of(const at::TensorBase& t) {
    if (!t.defined()) return nullptr;
    return dynamic_cast<ShardTensorImpl*>(t.unsafeGetTensorImpl());
  }
};

struct InstallHooks {
  InstallHooks() {
    static auto* hooks = new ShardVariableHooks(at::impl::GetVariableHooks());  // leaked
    at::impl::SetVariableHooks(hooks);
  }
};
const InstallHooks install_hooks;

}  // namespace
}  // namespace shardtensor::detail
