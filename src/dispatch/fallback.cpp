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
// Limits: a view op that falls back (unfold, as_strided, view_as_real, ...)
// returns a copy, not a view: its results are ShardTensors (a result that
// cannot be re-sharded is returned replicated on every mesh dim, not plain)
// on which an in-place op raises on every rank, naming the op (Note [view
// write-back]), instead of being lost. Random ops draw on the full tensor on
// every rank. A result that is not strided (to_sparse, to_mkldnn) cannot be
// split: where it would be re-sharded it is refused on every rank, naming the
// op, its arguments' placements and the layout.
#include "dispatch/fallback.h"

#include <shardtensor/core/policy.h>

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

}  // namespace

void generic_fallback(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack) {
  std::vector<c10::IValue> args = ops::pop_args(op, stack);
  if (strict()) {
    ops::fail(op, args,
              "no sharding rule for this op (strict mode: SHARDTENSOR_STRICT / "
              "shardtensor::set_strict refuse the generic fallback's gather)");
  }
  const DeviceMesh mesh = ops::common_mesh(op, args);
  const auto shards = ops::shard_args(args);
  const ShardSpec first = *ops::spec_of(shards.front());
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
  int64_t bytes = 0;
  for (const auto& t : shards) bytes += gather_bytes_of(t);
  detail::record_gather(c10::toString(op.operator_name()), bytes, mesh.rank() == 0,
                        "generic fallback: no sharding rule, ran on gathered tensors");

  std::vector<c10::IValue> full_args;
  full_args.reserve(args.size());
  for (const auto& v : args) full_args.push_back(gather_value(v));
  std::vector<c10::IValue> call(full_args.begin(), full_args.end());
  op.callBoxed(&call);
  const size_t nret = schema.returns().size();
  TORCH_INTERNAL_ASSERT(call.size() == nret, "unexpected number of results of ",
                        op.operator_name());
  // A sparse (or otherwise non-strided) result cannot be split into pieces: refused
  // where it would be re-sharded (a replicated one is returned whole).
  // Every rank ran the same op on the same gathered tensors, so every rank sees the
  // same layouts and throws here, with no collective pending.
  for (const c10::IValue& r : call) {
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
      at::Tensor t = reshard(r.toTensor(), first);
      if (alias) {
        // A view op's result here is a copy: in-place ops on it must raise,
        // not be lost. A plain (replicated) result would never reach the
        // dispatcher again, so it is returned as a replicated ShardTensor.
        if (!detail::shard_impl(t)) t = replicated(t, mesh);
        ops::refuse_in_place(t, copy_not_view(op));
      }
      stack->push_back(std::move(t));
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : r.toTensorList()) {
        at::Tensor u = reshard(t, first);
        if (alias) {
          if (!detail::shard_impl(u)) u = replicated(u, mesh);
          ops::refuse_in_place(u, copy_not_view(op));
        }
        out.push_back(u);
      }
      stack->push_back(std::move(out));
    } else {
      stack->push_back(std::move(r));
    }
  }
}

}  // namespace shardtensor::dispatch
