// Note [out variants]
// ~~~~~~~~~~~~~~~~~~~
// An aten out-variant (add.out, sum.IntList_out, cumsum.out, sort.values,
// sort.values_stable, ...: an overload whose written Tensor arguments, the
// out= buffers, are exactly its returns) runs through its functional
// overload's rule when it has none of its own: the overload of the same name
// with the same arguments minus the out= ones and nothing written (add.Tensor,
// sum.dim_IntList, cumsum, sort, sort.stable). The adapter runs that rule on
// the functional arguments, then copies each result into its out= tensor:
//  - the out= tensor must be a ShardTensor on the results' mesh, without a
//    Partial placement (a plain out= tensor next to sharded inputs would hide
//    a gather: refused, naming the op, as the elementwise rule does);
//  - with the result's global shape it keeps its own layout: the result is
//    redistributed into it (local when the layouts agree; a gather is
//    visible, Note [visible gathers]) and cast to its dtype, which must be one
//    the result's dtype can be cast to (libtorch's rule for out=); a
//    functional overload with a `dtype` argument left unset (sum, cumsum,
//    softmax, ...) computes in the out= tensor's dtype, as libtorch does;
//  - with another shape it is resized as libtorch's resize_output does (with
//    its warning when it held elements): it takes the result's layout
//    (Partial summed), holds a fresh piece, and keeps its dtype. A view that
//    writes back into its source (Note [view write-back]) or a tensor whose
//    metadata may not change cannot be resized: the call raises naming the op.
// As in libtorch, out= does not support autograd: when grad mode is on and an
// argument requires grad, every rank raises. The functional rule's own checks
// and errors apply unchanged (its errors name the functional overload). The
// adapter's predicate is the functional rule's (Note [partial rules]) on the
// functional arguments, and it needs a ShardTensor among them; a call it does
// not take goes to the op's own rule for every overload of its name, if any,
// else to the decomposition or the generic fallback. An out-variant that has
// a rule for its very overload (where.self_out) keeps it; a rule registered
// for every overload of a name (cumsum, matmul, add) gives way to the adapter
// on the out-variants, which therefore behave alike: a result in any layout
// lands in the out= tensor's layout. Every decision depends on metadata only,
// so every rank takes the same path. op_coverage() reports these ops as
// "out-adapter". Cost: the functional result is a temporary, so an out=
// call holds one more result-sized piece than libtorch's in-place kernel
// would, and with equal layouts the copy is a local memcpy.
#include "ops/out_variants.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

struct OutArgs {
  std::vector<size_t> outs;   // indices of the out= arguments, in the order of the returns
  std::vector<size_t> plain;  // indices of the other arguments
};

/// The out= arguments of `s` when it is an out-variant, else nullopt.
std::optional<OutArgs> out_shape(const c10::FunctionSchema& s) {
  OutArgs r;
  const auto& args = s.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* a = args[i].alias_info();
    if (a && a->isWrite()) {
      if (args[i].type()->kind() != c10::TypeKind::TensorType) return std::nullopt;
    } else {
      r.plain.push_back(i);
    }
  }
  const auto& rets = s.returns();
  if (rets.empty() || rets.size() + r.plain.size() != args.size()) return std::nullopt;
  for (const auto& ret : rets) {
    const auto* alias = ret.alias_info();
    if (!alias || !alias->isWrite() || ret.type()->kind() != c10::TypeKind::TensorType) {
      return std::nullopt;
    }
    bool found = false;
    for (size_t i = 0; i < args.size() && !found; ++i) {
      const auto* a = args[i].alias_info();
      if (a && a->isWrite() && a->beforeSets() == alias->beforeSets()) {
        r.outs.push_back(i);
        found = true;
      }
    }
    if (!found) return std::nullopt;
  }
  return r;
}

/// Whether `f` is the functional form of the out-variant `s` (whose other
/// arguments are `plain`).
bool is_functional_of(const c10::FunctionSchema& f, const c10::FunctionSchema& s,
                      const OutArgs& shape) {
  const auto& fa = f.arguments();
  if (fa.size() != shape.plain.size() || f.returns().size() != shape.outs.size()) return false;
  for (size_t k = 0; k < fa.size(); ++k) {
    const auto& a = s.arguments()[shape.plain[k]];
    if (fa[k].alias_info() || fa[k].name() != a.name() || !(*fa[k].type() == *a.type())) {
      return false;
    }
  }
  for (const auto& ret : f.returns()) {
    if (ret.alias_info() || ret.type()->kind() != c10::TypeKind::TensorType) return false;
  }
  return true;
}

/// aten op names -> their overloads (built once: every aten op is registered
/// before the first call reaches the dispatcher).
const std::map<std::string, std::vector<c10::OperatorName>>& overloads() {
  static const auto* m = [] {
    auto* r = new std::map<std::string, std::vector<c10::OperatorName>>();
    for (const auto& n : c10::Dispatcher::singleton().getAllOpNames()) (*r)[n.name].push_back(n);
    return r;
  }();
  return *m;
}

/// The resolved pieces of an adapter.
struct Target {
  c10::OperatorHandle functional;
  const Rule* rule;
  const Accepts* accepts;    // the functional rule's predicate, or nullptr
  const Rule* own;           // the out-variant's rule for every overload, or nullptr
  const Accepts* own_takes;  // its predicate, or nullptr
  OutArgs shape;
};

std::vector<c10::IValue> functional_args(const OutArgs& shape,
                                         const std::vector<c10::IValue>& args) {
  std::vector<c10::IValue> f;
  f.reserve(shape.plain.size());
  for (size_t i : shape.plain) f.push_back(args[i]);
  return f;
}

bool adapter_takes(const Target& t, const std::vector<c10::IValue>& args) {
  const std::vector<c10::IValue> f = functional_args(t.shape, args);
  if (shard_args(f).empty()) return false;
  return t.accepts == nullptr || (*t.accepts)(t.functional, f);
}

/// Collective as redistribution is. Writes the functional result `r` into the
/// out= tensor `out` (Note [out variants]).
void copy_into(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
               const at::Tensor& out, const at::Tensor& r) {
  const ShardSpec* os = spec_of(out);
  const ShardSpec* rs = spec_of(r);
  if (rs != nullptr && rs->mesh() != os->mesh()) {
    fail(op, args, "the out= tensor lives on another mesh than the result");
  }
  if (!at::canCast(r.scalar_type(), out.scalar_type())) {
    fail(op, args,
         std::string("result type ") + c10::toString(r.scalar_type()) +
             " can't be cast to the desired output type " + c10::toString(out.scalar_type()));
  }
  const DeviceMesh& mesh = os->mesh();
  if (r.sizes() != out.sizes()) {
    // resize_output: the out= tensor takes the result's layout.
    auto* impl = detail::shard_impl(out);
    if (impl->write_back() || !impl->allow_tensor_metadata_change()) {
      fail(op, args,
           "the out= tensor has shape " + shape_str(out.sizes()) + " but the result has shape " +
               shape_str(r.sizes()) +
               ", and it cannot be resized (a view of another ShardTensor, or a tensor whose "
               "metadata may not change)");
    }
    if (out.numel() != 0) {
      TORCH_WARN("shardtensor: ", op.operator_name(),
                 ": an output with one or more elements was resized since it had shape ",
                 out.sizes(), ", which does not match the required output shape ", r.sizes(),
                 ". This behavior is deprecated in libtorch; resize the out= tensor to zero "
                 "elements first (Note [out variants]).");
    }
    SpecPtr spec = rs != nullptr
                       ? std::make_shared<const ShardSpec>(without_partial(*rs))
                       : make_spec(mesh, Placements(mesh.ndim(), Replicate{}), r.sizes().vec());
    at::Tensor piece =
        rs != nullptr ? detail::redistribute_local(local_of(r), *rs, *spec) : local_of(r);
    piece = piece.to(out.scalar_type()).clone(at::MemoryFormat::Contiguous);
    at::Tensor fresh = wrap(piece, spec);
    impl->shallow_copy_from(fresh.getIntrusivePtr());
    return;
  }
  at::Tensor piece;
  if (rs != nullptr) {
    if (gathers(*rs, *os)) {
      note_gather(op, args, mesh, gathered_bytes(*rs, *os, r.element_size()),
                  "the out= tensor replicates dims the result is sharded along");
    }
    piece = detail::redistribute_local(local_of(r), *rs, *os);
  } else {
    piece = detail::local_slice(r, *os);
  }
  local_of(out).copy_(piece);
}

void run_adapter(const Target& t, const c10::OperatorHandle& op, Stack* stack) {
  std::vector<c10::IValue> args = pop_args(op, stack);
  if (at::GradMode::is_enabled()) {
    for (const auto& v : args) {
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) {
        fail(op, args,
             "functions with out=... arguments don't support automatic differentiation, but "
             "one of the arguments requires grad");
      }
    }
  }
  const DeviceMesh mesh = common_mesh(op, args);
  for (size_t i : t.shape.outs) {
    const ShardSpec* s = spec_of(args[i].toTensor());
    if (s == nullptr) fail(op, args, "the out= tensor must be a ShardTensor when an input is one");
    if (s->has_partial()) fail(op, args, "the out= tensor must not be Partial");
  }
  Stack f = functional_args(t.shape, args);
  if (t.shape.outs.size() == 1) {
    // libtorch computes in the out= tensor's dtype when `dtype` is not given
    // (sum_out, cumsum_out, ...).
    const auto& fa = t.functional.schema().arguments();
    for (size_t k = 0; k < fa.size(); ++k) {
      if (fa[k].name() == "dtype" && f[k].isNone() &&
          fa[k].type()->kind() == c10::TypeKind::OptionalType) {
        f[k] = args[t.shape.outs[0]].toTensor().scalar_type();
      }
    }
  }
  (*t.rule)(t.functional, &f);
  TORCH_INTERNAL_ASSERT(f.size() == t.shape.outs.size(), "unexpected number of results of ",
                        t.functional.operator_name());
  for (size_t j = 0; j < t.shape.outs.size(); ++j) {
    copy_into(op, args, args[t.shape.outs[j]].toTensor(), f[j].toTensor());
  }
  for (size_t i : t.shape.outs) stack->push_back(args[i]);
}

std::unique_ptr<OutAdapter> make_adapter(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  if (find_exact_rule(name) != nullptr) return nullptr;
  const auto shape = out_shape(op.schema());
  if (!shape) return nullptr;
  auto it = overloads().find(name.name);
  if (it == overloads().end()) return nullptr;
  for (const auto& cand : it->second) {
    if (cand.overload_name == name.overload_name) continue;
    auto f = c10::Dispatcher::singleton().findOp(cand);
    if (!f || !f->hasSchema() || !is_functional_of(f->schema(), op.schema(), *shape)) continue;
    const Rule* rule = find_rule(cand);
    if (rule == nullptr) return nullptr;
    auto t = std::make_shared<const Target>(
        Target{*f, rule, find_accepts(cand), find_rule(name), find_accepts(name), *shape});
    Rule adapter = [t](const c10::OperatorHandle& o, Stack* stack) {
      const size_t n = o.schema().arguments().size();
      const std::vector<c10::IValue> args(stack->end() - n, stack->end());
      if (adapter_takes(*t, args)) {
        run_adapter(*t, o, stack);
      } else {
        (*t->own)(o, stack);  // the predicate below took the call for it
      }
    };
    Accepts accepts = [t](const c10::OperatorHandle& o, const Stack& stack) {
      const size_t n = o.schema().arguments().size();
      const std::vector<c10::IValue> args(stack.end() - n, stack.end());
      if (adapter_takes(*t, args)) return true;
      return t->own != nullptr && (t->own_takes == nullptr || (*t->own_takes)(o, stack));
    };
    return std::make_unique<OutAdapter>(OutAdapter{std::move(adapter), std::move(accepts), cand});
  }
  return nullptr;
}

}  // namespace

const OutAdapter* find_out_adapter(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<c10::OperatorName, std::unique_ptr<OutAdapter>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(op.operator_name());
  if (it == cache->end()) it = cache->emplace(op.operator_name(), make_adapter(op)).first;
  return it->second.get();
}

}  // namespace shardtensor::ops
