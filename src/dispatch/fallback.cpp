// Note [generic fallback]: an op that reaches the dispatcher with a
// ShardTensor argument, no sharding rule and no CompositeImplicitAutograd
// decomposition is run on gathered data:
//  1. every ShardTensor argument (tensor lists included) is redistributed to
//     Replicate with the differentiable comm/ primitives (all-gather for Shard,
//     all-reduce for Partial), so gradients flow back through their adjoints;
//  2. the op runs on the full, plain tensors (ordinary libtorch autograd);
//  3. a result is re-sharded like the first ShardTensor argument (its
//     placements and shard sizes; Partial becomes Replicate) when it has that
//     argument's rank and its extent along every sharded dim; otherwise it is
//     returned as a plain tensor, replicated (identical on every rank), except
//     the result of a view op (see Limits);
//  4. arguments written in place (in-place ops, out=) that are ShardTensors get
//     their piece of the full result copied back into their local tensor.
// Gradient conventions hold (Note [replicated gradients]): a replicated
// result's gradient is the full gradient on every rank, and all-gather's
// adjoint hands every rank its own slice.
//
// The gather is visible (Note [visible gathers]): CommStats::gathered_bytes
// counts it and a one-line warning names the op and the bytes, once per op, on
// mesh rank 0. In strict mode the fallback raises today's "no sharding rule"
// error instead. Every decision here depends only on specs and the strict
// flag, which are the same on every rank, so all ranks make the same
// collective calls or all throw.
//
// Limits: a view op that falls back (as_strided, view_as_real, ...) returns a
// copy, not a view: its results are ShardTensors (a result that cannot be
// re-sharded is returned replicated on every mesh dim, not plain) on which an
// in-place op raises on every rank, naming the op (Note [view write-back]),
// instead of being lost. They follow their source (the ShardTensor argument
// they alias per the schema) as libtorch's views would (Note [stale copy
// views], ops::refuse_in_place_following): before one of them, or a view of
// one, is used after a write into the source, steps 1-3 run again (a gather,
// counted and announced like the first; refused in strict mode on every rank)
// and the new pieces are copied into the existing ones, once for all the
// results of the call; a source whose layout was changed in place (t_,
// squeeze_, ...) is refused instead. A copy of a plain tensor cannot follow it
// (its writes never reach the dispatcher). Random ops draw on the full tensor on
// every rank. A result that is not strided (to_sparse, to_mkldnn) cannot be
// split: where it would be re-sharded it is refused on every rank, naming the
// op, its arguments' placements and the layout.
#include "dispatch/fallback.h"

#include <shardtensor/core/policy.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops/common.h"

namespace shardtensor::dispatch {
namespace {

ShardSpec replicated_like(const ShardSpec& s) {
  return ShardSpec(s.mesh(), Placements(s.mesh().ndim(), Replicate{}), s.global_shape());
}

at::Tensor gather_full(const at::Tensor& t) {
  const ShardSpec* s = ops::spec_of(t);
  if (!s) return t;
  return detail::redistribute_local(ops::local_of(t), *s, replicated_like(*s));
}

int64_t gather_bytes_of(const at::Tensor& t) {
  const ShardSpec* s = ops::spec_of(t);
  return ops::gathered_bytes(*s, replicated_like(*s), ops::local_of(t).element_size());
}

c10::IValue gather_value(const c10::IValue& v) {
  if (v.isTensor()) return gather_full(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(gather_full(t));
    return out;
  }
  if (v.isList()) {
    bool any = false;
    for (const c10::IValue& e : v.toListRef())
      any = any || (e.isTensor() && ops::spec_of(e.toTensor()));
    if (!any) return v;
    // Optional-tensor lists (index.Tensor's indices).
    c10::List<c10::optional<at::Tensor>> out;
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isNone()) {
        out.push_back(c10::nullopt);
      } else {
        out.push_back(gather_full(e.toTensor()));
      }
    }
    return out;
  }
  return v;
}

// The layout of a result: like `first` when the shapes allow, else nullptr (replicated).
ops::SpecPtr result_spec(const at::Tensor& r, const ShardSpec& first) {
  if (!r.defined() || r.dim() != first.ndim()) return nullptr;
  Placements p = first.placements();
  for (int64_t m = 0; m < first.mesh().ndim(); ++m) {
    if (is_partial(p[m])) p[m] = Replicate{};
    if (is_shard(p[m])) {
      const int64_t d = shard_dim(p[m]);
      if (r.size(d) != first.global_shape()[d]) return nullptr;
    }
  }
  return ops::make_spec(first.mesh(), p, r.sizes().vec(), first.all_shard_sizes());
}

at::Tensor reshard(const at::Tensor& r, const ShardSpec& first) {
  ops::SpecPtr spec = result_spec(r, first);
  if (!spec) return r;
  return ops::wrap(detail::redistribute_local(r, replicated_like(*spec), *spec), spec);
}

// A plain result of the fallback as a ShardTensor replicated on every mesh dim.
at::Tensor replicated(const at::Tensor& r, const DeviceMesh& mesh) {
  return ops::wrap(r, ops::make_spec(mesh, Placements(mesh.ndim(), Replicate{}), r.sizes().vec()));
}

std::string copy_not_view(const c10::OperatorHandle& op) {
  return c10::toString(op.operator_name()) +
         " has no sharding rule; the generic fallback returned a copy, not a view";
}

// Strict mode refuses the gather (every rank alike: the flag is the same
// everywhere), `why` saying why the fallback would run.
void refuse_if_strict(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                      const std::string& why) {
  if (strict()) {
    ops::fail(op, args,
              why +
                  " (strict mode: SHARDTENSOR_STRICT / shardtensor::set_strict refuse the "
                  "generic fallback's gather)");
  }
}

// Steps 1 and 2 of Note [generic fallback]: counts and announces the gather,
// gathers every ShardTensor argument and runs the op on the full tensors.
// Returns the full arguments (to copy written ones back) and the results, of
// which a non-strided one that would be re-sharded is refused. Collective over
// `mesh`.
struct Gathered {
  std::vector<c10::IValue> full_args, results;
};

Gathered run_gathered(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                      const DeviceMesh& mesh, const ShardSpec& first) {
  int64_t bytes = 0;
  for (const auto& t : ops::shard_args(args)) bytes += gather_bytes_of(t);
  detail::record_gather(c10::toString(op.operator_name()), bytes, mesh.rank() == 0,
                        "generic fallback: no sharding rule, ran on gathered tensors");

  Gathered g;
  g.full_args.reserve(args.size());
  for (const auto& v : args) g.full_args.push_back(gather_value(v));
  g.results.assign(g.full_args.begin(), g.full_args.end());
  op.callBoxed(&g.results);
  TORCH_INTERNAL_ASSERT(g.results.size() == op.schema().returns().size(),
                        "unexpected number of results of ", op.operator_name());
  // A sparse (or otherwise non-strided) result cannot be split into pieces: refused
  // where it would be re-sharded (a replicated one is returned whole).
  // Every rank ran the same op on the same gathered tensors, so every rank sees the
  // same layouts and throws here, with no collective pending.
  for (const c10::IValue& r : g.results) {
    std::vector<at::Tensor> ts;
    if (r.isTensor()) ts.push_back(r.toTensor());
    if (r.isTensorList()) ts = r.toTensorList().vec();
    for (const at::Tensor& t : ts) {
      if (!t.defined() || t.layout() == at::kStrided) continue;
      const ops::SpecPtr spec = result_spec(t, first);
      if (spec && !spec->is_replicated()) {
        ops::fail(op, args,
                  "its result has layout " + c10::str(t.layout()) +
                      "; a ShardTensor holds strided pieces only (call full_tensor() first "
                      "for a plain tensor of that layout)");
      }
    }
  }
  return g;
}

// Step 3 for one result. A view op's result here is a copy: a plain
// (replicated) one would never reach the dispatcher again, so it is returned
// as a replicated ShardTensor, on which in-place ops can raise.
at::Tensor result_of(const at::Tensor& r, const ShardSpec& first, const DeviceMesh& mesh,
                     bool view) {
  at::Tensor t = reshard(r, first);
  if (view && !detail::shard_impl(t)) t = replicated(t, mesh);
  return t;
}

// The tensors of the results that are views per the schema (an alias that is
// not written), in order.
std::vector<at::Tensor> view_results(const c10::FunctionSchema& schema,
                                     const std::vector<c10::IValue>& results) {
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < results.size(); ++j) {
    const auto* alias = schema.returns()[j].alias_info();
    if (!alias || alias->isWrite()) continue;
    if (results[j].isTensor()) out.push_back(results[j].toTensor());
    if (results[j].isTensorList()) {
      for (const at::Tensor& t : results[j].toTensorList()) out.push_back(t);
    }
  }
  return out;
}

// The alias sets of an annotation, those of a list's elements included.
void alias_sets(const c10::AliasInfo& a, std::vector<c10::Symbol>* out) {
  out->insert(out->end(), a.beforeSets().begin(), a.beforeSets().end());
  for (const auto& c : a.containedTypes()) alias_sets(c, out);
}

// The ShardTensor argument that the view results alias per the schema
// (normally self), or an undefined tensor (a plain tensor viewed, whose writes
// the dispatcher never sees).
at::Tensor view_source(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  std::vector<c10::Symbol> viewed;
  for (const auto& r : schema.returns()) {
    if (r.alias_info() && !r.alias_info()->isWrite()) alias_sets(*r.alias_info(), &viewed);
  }
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    const auto* a = schema.arguments()[i].alias_info();
    if (!a || a->isWrite() || !args[i].isTensor() || !ops::spec_of(args[i].toTensor())) continue;
    std::vector<c10::Symbol> sets;
    alias_sets(*a, &sets);
    for (const c10::Symbol& s : sets) {
      if (std::find(viewed.begin(), viewed.end(), s) != viewed.end()) return args[i].toTensor();
    }
  }
  return {};
}

}  // namespace

void generic_fallback(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack) {
  std::vector<c10::IValue> args = ops::pop_args(op, stack);
  refuse_if_strict(op, args, "no sharding rule for this op");
  const DeviceMesh mesh = ops::common_mesh(op, args);
  const ShardSpec first = *ops::spec_of(ops::shard_args(args).front());
  const auto& schema = op.schema();
  // Written ShardTensor arguments must be able to take their piece back.
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    const auto* a = schema.arguments()[i].alias_info();
    if (a && a->isWrite() && args[i].isTensor()) {
      if (const ShardSpec* s = ops::spec_of(args[i].toTensor())) {
        if (s->has_partial()) {
          ops::fail(op, args,
                    "the generic fallback cannot write in place into a Partial ShardTensor");
        }
      }
    }
  }
  Gathered g = run_gathered(op, args, mesh, first);
  const std::vector<c10::IValue>& full_args = g.full_args;
  std::vector<c10::IValue>& call = g.results;
  const size_t nret = schema.returns().size();

  // Copy written pieces back (in-place ops, out=).
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    const auto* a = schema.arguments()[i].alias_info();
    if (!(a && a->isWrite() && args[i].isTensor())) continue;
    const at::Tensor& orig = args[i].toTensor();
    const ShardSpec* s = ops::spec_of(orig);
    if (!s) continue;
    const at::Tensor& full = full_args[i].toTensor();
    at::Tensor local = ops::local_of(orig);
    if (full.unsafeGetTensorImpl() == local.unsafeGetTensorImpl()) continue;  // was replicated
    TORCH_CHECK(full.sizes().vec() == s->global_shape(), "shardtensor: ", op.operator_name(),
                " resized a ShardTensor argument written in place (", s->to_string(), " -> ",
                full.sizes(), "); the generic fallback cannot do that");
    local.copy_(detail::local_slice(full, *s));
  }

  for (size_t j = 0; j < nret; ++j) {
    c10::IValue& r = call[j];
    const auto* alias = schema.returns()[j].alias_info();
    if (alias && alias->isWrite()) {
      bool found = false;
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto* a = schema.arguments()[i].alias_info();
        if (a && a->isWrite() && a->beforeSets() == alias->beforeSets()) {
          stack->push_back(args[i]);
          found = true;
          break;
        }
      }
      TORCH_INTERNAL_ASSERT(found, "no written argument for a result of ", op.operator_name());
    } else if (r.isTensor()) {
      stack->push_back(result_of(r.toTensor(), first, mesh, alias != nullptr));
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : r.toTensorList())
        out.push_back(result_of(t, first, mesh, alias != nullptr));
      stack->push_back(std::move(out));
    } else {
      stack->push_back(std::move(r));
    }
  }

  // A view op's results are copies (Limits): in-place ops on them must raise,
  // not be lost, and they follow their source (Note [stale copy views]): made
  // anew by the same steps, one generation for all of them.
  const std::vector<c10::IValue> pushed(stack->end() - static_cast<std::ptrdiff_t>(nret),
                                        stack->end());
  const std::vector<at::Tensor> views = view_results(schema, pushed);
  if (views.empty()) return;
  // Their wrappers get libtorch's strides (Note [wrapper strides]): a copy
  // whose strides say "not contiguous" is copied by contiguous(), reshape,
  // ..., as libtorch's view would be, instead of being written in place.
  ops::set_torch_strides(op, args, stack);
  const at::Tensor source = view_source(schema, args);
  if (!source.defined()) {
    for (const at::Tensor& t : views) ops::refuse_in_place(t, copy_not_view(op));
    return;
  }
  std::string what = c10::toString(op.operator_name()) + " of " + ops::spec_of(source)->to_string();
  what += " (a copy laid out as " + ops::spec_of(views.front())->to_string() + ")";
  ops::refuse_in_place_following(views, copy_not_view(op), source, what, [op, args, mesh, first] {
    refuse_if_strict(op, args,
                     "no sharding rule for this op; its result, a copy where libtorch's would be "
                     "a view, must be made anew on gathered tensors because its source was "
                     "written since (Note [stale copy views])");
    const Gathered again = run_gathered(op, args, mesh, first);
    std::vector<at::Tensor> pieces;
    for (const at::Tensor& t : view_results(op.schema(), again.results)) {
      pieces.push_back(ops::local_of(result_of(t, first, mesh, true)));
    }
    return pieces;
  });
}

}  // namespace shardtensor::dispatch
