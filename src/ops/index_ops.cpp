// Ops that are index ops in disguise, along sharded dims (Note [index
// disguises]): repeat (and tile, which decomposes to it), embedding with a
// replicated or a vocabulary-sharded weight, advanced indexing x[idx] /
// x.index_put_(idx, v) with one index on any dim. repeat_interleave and
// take_along_dim need no rule: libtorch 1.13 decomposes them into
// index_select with a plain index and gather, which the rules of Note [index
// ops along any dim] (ops/graph_ops.cpp) take.
//
// Note [index disguises]
// ~~~~~~~~~~~~~~~~~~~~~~
//  - repeat(x, reps): along a dim d that mesh dim k shards, with reps r != 1,
//    the result has n*r rows split balanced along k, and output row i is
//    input row i % n: each rank selects its rows by those global ids through
//    one GhostPlan (select_along: only the rows it lacks move; the backward
//    sums every copy's gradient on the row's owner). Unsharded dims and the
//    new leading dims repeat locally. Placements shift right by the number
//    of new dims.
//  - embedding(weight, indices): with a weight that no mesh dim shards along
//    its rows (Replicate, or Shard(1): the embedding dim, where the indices
//    are Replicate), the plain op on the local pieces, no communication; the
//    result is laid out like the indices with the embedding dim last, and the
//    weight's gradient is summed over the mesh dims that shard the indices
//    (Note [replicated gradients]). With the rows (vocabulary) sharded along
//    mesh dim m: each rank's token ids become one GhostPlan over m (Note
//    [index plan cache]), the rows it lacks arrive by ghost_exchange, and the
//    backward (embedding_dense_backward) is the exchange's adjoint: every
//    token's gradient is summed on the row's owner. Indices replicated along m
//    are first split along their first dim that no other mesh dim shards (a
//    local slice), so each token is looked up once per m sub-communicator.
//    padding_idx rows get no gradient, as in libtorch. scale_grad_by_freq and
//    sparse keep the generic fallback.
//  - x.index({..., idx}) (aten::index.Tensor) and x.index_put_({..., idx}, v,
//    accumulate): exactly one index, 1-D, int64 (negative ids wrap, as in
//    libtorch) or a replicated bool mask (its nonzero ids): the same as
//    index_select / index_add_ (accumulate) / index_copy_ along that dim, and
//    run as those ops' rules; v is broadcast to the indexed shape (a plain v;
//    a ShardTensor v must have that shape). Calls those rules do not take
//    keep the generic fallback.
#include <ATen/ATen.h>
#include <shardtensor/comm/ghost.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/agree.h"
#include "ops/common.h"
#include "ops/graph_ops.h"

namespace shardtensor::ops {
namespace {

std::vector<c10::IValue> peek(const c10::OperatorHandle& op, const Stack& stack) {
  const size_t n = op.schema().arguments().size();
  return std::vector<c10::IValue>(stack.end() - n, stack.end());
}

/// This rank's piece of `t` (laid out as `from`, or plain: replicated) in
/// `to`, which only splits dims that `from` leaves whole; a local slice.
at::Tensor slice_to(const at::Tensor& local, const ShardSpec& from, const ShardSpec& to) {
  if (from == to) return local;
  const auto off_from = from.local_offsets(), off_to = to.local_offsets();
  const auto shape_to = to.local_shape();
  at::Tensor t = local;
  for (int64_t e = 0; e < t.dim(); ++e) {
    if (t.size(e) != shape_to[e]) t = t.narrow(e, off_to[e] - off_from[e], shape_to[e]);
  }
  return t;
}

ShardSpec replicated_spec(const DeviceMesh& mesh, std::vector<int64_t> shape) {
  return ShardSpec(mesh, Placements(mesh.ndim(), Replicate{}), std::move(shape));
}

// ---- repeat ---------------------------------------------------------------------------

bool repeat_takes(const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek(op, stack);
  const ShardSpec* xs = a[0].isTensor() ? spec_of(a[0].toTensor()) : nullptr;
  return xs != nullptr && !xs->has_partial();
}

void repeat_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor x = args[0].toTensor();
  const ShardSpec& xs = *spec_of(x);
  const DeviceMesh& mesh = xs.mesh();
  const std::vector<int64_t> reps = int_list(args[1]);
  const int64_t nd = xs.ndim(), lead = static_cast<int64_t>(reps.size()) - nd;
  if (lead < 0) {
    fail(op, args,
         "the number of repeats (" + std::to_string(reps.size()) +
             ") can not be smaller than the number of dims of self (" + std::to_string(nd) + ")");
  }
  for (int64_t r : reps) {
    if (r < 0) fail(op, args, "repeats must be non-negative, got " + std::to_string(r));
  }
  // Sharded dims: a selection by computed global ids (Note [index disguises]).
  at::Tensor local = local_of(x);
  ShardSpec cur = xs;
  for (int64_t e = 0; e < nd; ++e) {
    const int64_t k = cur.mesh_dim_of(e), r = reps[lead + e];
    if (k < 0 || r == 1) continue;
    const int64_t n = cur.global_shape()[e], total = n * r;
    const std::vector<int64_t> sizes = balanced_sizes(total, mesh.size(k));
    const int64_t c = mesh.coordinate()[k];
    const int64_t off = offsets_of(sizes)[c];
    if (total == 0) {
      local = local.narrow(e, 0, 0);
    } else {
      const at::Tensor ids = at::arange(off, off + sizes[c], at::kLong).remainder(n);
      local = select_along(op, args, local, cur, e, ids);
    }
    std::vector<int64_t> shape = cur.global_shape();
    shape[e] = total;
    ShardSizes ss = cur.all_shard_sizes();
    ss[k] = sizes;
    cur = ShardSpec(mesh, cur.placements(), shape, ss);
  }
  // Unsharded dims and the new leading dims: locally.
  std::vector<int64_t> local_reps = reps;
  std::vector<int64_t> shape(reps.begin(), reps.begin() + lead);
  for (int64_t e = 0; e < nd; ++e) {
    const bool sharded = cur.mesh_dim_of(e) >= 0;
    if (sharded) local_reps[lead + e] = 1;
    shape.push_back(cur.global_shape()[e] * (sharded ? 1 : reps[lead + e]));
  }
  local = local.repeat(local_reps);
  Placements p = cur.placements();
  for (auto& pl : p) {
    if (is_shard(pl)) pl = Shard{shard_dim(pl) + lead};
  }
  stack->push_back(wrap(local, make_spec(mesh, p, shape, cur.all_shard_sizes())));
}

const RuleRegistrar r_repeat({"repeat."}, repeat_rule, repeat_takes);

// ---- embedding -------------------------------------------------------------------------

struct EmbeddingLayout {
  DeviceMesh mesh;
  ShardSpec ws, is;                 // weight's and indices' layouts (replicated when plain)
  std::optional<ShardSpec> target;  // the indices' layout the rule computes in
  std::optional<ShardSpec> out;
  int64_t m = -1;  // the mesh dim sharding the weight's rows
};

std::optional<EmbeddingLayout> embedding_layout(const std::vector<c10::IValue>& a) {
  if (!a[0].isTensor() || !a[1].isTensor()) return std::nullopt;
  if (a[3].toBool() || a[4].toBool()) return std::nullopt;  // scale_grad_by_freq, sparse
  const at::Tensor w = a[0].toTensor(), idx = a[1].toTensor();
  const ShardSpec* ws = spec_of(w);
  const ShardSpec* is = spec_of(idx);
  if (w.dim() != 2 || (ws == nullptr && is == nullptr)) return std::nullopt;
  if (idx.scalar_type() != at::kLong && idx.scalar_type() != at::kInt) return std::nullopt;
  if ((ws && ws->has_partial()) || (is && is->has_partial())) return std::nullopt;
  if (ws && is && ws->mesh() != is->mesh()) return std::nullopt;
  const DeviceMesh mesh = ws ? ws->mesh() : is->mesh();
  EmbeddingLayout L{mesh, ws ? *ws : replicated_spec(mesh, w.sizes().vec()),
                    is ? *is : replicated_spec(mesh, idx.sizes().vec()), std::nullopt,
                    std::nullopt};
  L.m = L.ws.mesh_dim_of(0);
  Placements tp = L.is.placements();
  ShardSizes ts = L.is.all_shard_sizes();
  if (L.m >= 0) {
    if (L.is.mesh_dim_of(0) < 0 && idx.dim() == 0) return std::nullopt;
    if (!is_shard(tp[L.m])) {
      int64_t j = -1;
      for (int64_t e = 0; e < idx.dim() && j < 0; ++e) {
        if (L.is.mesh_dim_of(e) < 0) j = e;
      }
      if (j < 0) return std::nullopt;
      tp[L.m] = Shard{j};
      ts[L.m] = balanced_sizes(idx.size(j), mesh.size(L.m));
    }
  }
  L.target = ShardSpec(mesh, tp, idx.sizes().vec(), ts);
  Placements op = tp;
  ShardSizes os = ts;
  for (int64_t k = 0; k < mesh.ndim(); ++k) {
    if (k == L.m) continue;
    const int64_t e = shard_dim(L.ws.placements()[k]);
    if (e < 0) continue;                            // Replicate
    if (!is_replicate(tp[k])) return std::nullopt;  // Shard(1) needs indices Replicate there
    op[k] = Shard{idx.dim()};
    os[k] = L.ws.shard_sizes(k);
  }
  std::vector<int64_t> shape = idx.sizes().vec();
  shape.push_back(w.size(1));
  L.out = ShardSpec(mesh, op, shape, os);
  return L;
}

bool embedding_takes(const c10::OperatorHandle& op, const Stack& stack) {
  return embedding_layout(peek(op, stack)).has_value();
}

void embedding_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const EmbeddingLayout L = *embedding_layout(args);
  const at::Tensor w = args[0].toTensor(), idx = args[1].toTensor();
  const int64_t padding_idx = int_arg(args[2]);
  const int64_t V = w.size(0);
  const at::Tensor il = slice_to(local_of(idx), L.is, *L.target);
  const at::Tensor wl = to_layout(w, L.ws, *L.out);
  at::Tensor out;
  if (L.m < 0) {
    // Local: an id outside [0, V) on one rank throws on every rank.
    std::string err;
    if (il.numel() > 0) {
      const int64_t lo = il.min().item<int64_t>(), hi = il.max().item<int64_t>();
      if (lo < 0 || hi >= V) {
        err = "index out of range: this rank's indices hold ids in [" + std::to_string(lo) + ", " +
              std::to_string(hi) + "] but the weight has " + std::to_string(V) + " rows, in " +
              describe_call(op, args);
      }
    }
    if (L.target->is_replicated()) {
      if (!err.empty())
        fail(op, args, err);  // the same indices, hence the same verdict, everywhere
    } else {
      comm::check_all(L.mesh, err.empty(), "shardtensor: " + c10::toString(op.operator_name()),
                      err);
    }
    out = at::embedding(wl, il, padding_idx, false, false);
  } else {
    std::vector<int64_t> extra = L.target->local_offsets();
    for (int64_t v : L.target->local_shape()) extra.push_back(v);
    extra.push_back(-1);  // an embedding lookup
    const IndexPlan ip = index_plan(op, args, L.mesh, L.m, L.ws.shard_sizes(L.m), il.reshape({-1}),
                                    local_of(idx), extra);
    std::vector<int64_t> shape = il.sizes().vec();
    shape.push_back(wl.size(1));
    out = ghost_exchange(wl, ip.plan).index_select(0, ip.rows).view(shape);
    if (padding_idx >= 0) out = at::where(il.eq(padding_idx).unsqueeze(-1), out.detach(), out);
  }
  stack->push_back(wrap(out, std::make_shared<const ShardSpec>(*L.out)));
}

const RuleRegistrar r_embedding({"embedding."}, embedding_rule, embedding_takes);

// ---- index.Tensor, index_put_ ----------------------------------------------------------

struct OneIndex {
  int64_t dim = -1;
  at::Tensor index;  // as given
};

/// The single index of an indices list, or nullopt. Metadata only.
std::optional<OneIndex> one_index(const at::Tensor& self, const c10::IValue& list) {
  if (!list.isList()) return std::nullopt;
  OneIndex r;
  int64_t pos = 0;
  for (const c10::IValue& v : list.toListRef()) {
    if (v.isTensor() && v.toTensor().defined()) {  // an absent index may come as undefined
      if (r.dim >= 0) return std::nullopt;
      r.dim = pos;
      r.index = v.toTensor();
    } else if (!v.isNone() && !v.isTensor()) {
      return std::nullopt;
    }
    ++pos;
  }
  if (r.dim < 0 || r.dim >= self.dim() || r.index.dim() != 1) return std::nullopt;
  const auto t = r.index.scalar_type();
  if (t == at::kBool || t == at::kByte) {
    const ShardSpec* s = spec_of(r.index);
    if ((s && !s->is_replicated()) || r.index.size(0) != self.size(r.dim)) return std::nullopt;
  } else if (t != at::kLong) {
    return std::nullopt;
  }
  return r;
}

/// The ids of `r` for index_select along `r.dim` of a tensor with `n` rows:
/// a mask's nonzero positions, negative ids wrapped (as libtorch's indexing
/// does). Collective over `mesh` for a sharded index (one all-reduce: does
/// any rank hold a negative id); an index without negative ids is returned
/// as is, so its plan stays cached.
at::Tensor ids_of(const OneIndex& r, int64_t n, const DeviceMesh& mesh) {
  const auto t = r.index.scalar_type();
  if (t == at::kBool || t == at::kByte) return local_of(r.index).nonzero().squeeze(1);
  const ShardSpec* s = spec_of(r.index);
  const at::Tensor l = local_of(r.index);
  const bool neg = l.numel() > 0 && l.lt(0).any().item<bool>();
  if (s == nullptr || s->is_replicated()) return neg ? l + l.lt(0) * n : r.index;
  if (comm::all_ok(mesh, !neg)) return r.index;
  return wrap(l + l.lt(0) * n, spec_ptr_of(r.index));
}

bool index_takes(const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek(op, stack);
  if (!a[0].isTensor()) return false;
  const at::Tensor self = a[0].toTensor();
  const auto r = one_index(self, a[1]);
  if (!r) return false;
  at::Tensor meta = r->index;
  if (meta.scalar_type() != at::kLong) {
    // A replicated mask: its ids are a plain tensor; their number does not
    // change whether the rule takes the call.
    meta = at::zeros({0}, at::kLong);
  }
  return index_rule_takes("index_select", {self, r->dim, meta});
}

/// Runs `fn`; a c10::Error it throws (on every rank, as those rules throw)
/// is rethrown naming this op.
template <class F>
auto naming(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, F fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    fail(op, args, e.what_without_backtrace());
  }
}

void index_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor self = args[0].toTensor();
  const OneIndex r = *one_index(self, args[1]);
  const DeviceMesh mesh = common_mesh(op, args);
  at::Tensor out =
      naming(op, args, [&] { return self.index_select(r.dim, ids_of(r, self.size(r.dim), mesh)); });
  stack->push_back(out);
}

/// index_put's values broadcast to the indexed shape (`entries` rows along
/// `dim`), or undefined when they cannot be.
at::Tensor values_for(const at::Tensor& self, int64_t dim, int64_t entries, const at::Tensor& v) {
  std::vector<int64_t> shape = self.sizes().vec();
  shape[dim] = entries;
  if (spec_of(v) != nullptr) return v.sizes().vec() == shape ? v : at::Tensor();
  if (!at::is_expandable_to(v.sizes(), shape)) return at::Tensor();
  return v.expand(shape);
}

int64_t entries_of(const OneIndex& r) {
  const auto t = r.index.scalar_type();
  if (t == at::kBool || t == at::kByte) return local_of(r.index).ne(0).sum().item<int64_t>();
  return r.index.size(0);
}

bool index_put_takes(const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek(op, stack);
  if (!a[0].isTensor() || !a[2].isTensor()) return false;
  const at::Tensor self = a[0].toTensor();
  if (spec_of(self) == nullptr) return false;
  const auto r = one_index(self, a[1]);
  if (!r) return false;
  const at::Tensor v = values_for(self, r->dim, entries_of(*r), a[2].toTensor());
  if (!v.defined()) return false;
  at::Tensor meta =
      r->index.scalar_type() == at::kLong ? r->index : at::zeros({v.size(r->dim)}, at::kLong);
  if (a[3].toBool()) return index_rule_takes("index_add", {self, r->dim, meta, v, c10::Scalar(1)});
  return index_rule_takes("index_copy", {self, r->dim, meta, v});
}

void index_put_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  at::Tensor self = args[0].toTensor();
  const OneIndex r = *one_index(self, args[1]);
  const bool accumulate = args[3].toBool();
  const bool in_place = is_written(op.schema().arguments()[0]);
  const DeviceMesh mesh = common_mesh(op, args);
  at::Tensor out = naming(op, args, [&] {
    const at::Tensor ids = ids_of(r, self.size(r.dim), mesh);
    const at::Tensor v = values_for(self, r.dim, entries_of(r), args[2].toTensor());
    if (in_place) {
      return accumulate ? self.index_add_(r.dim, ids, v) : self.index_copy_(r.dim, ids, v);
    }
    return accumulate ? self.index_add(r.dim, ids, v) : self.index_copy(r.dim, ids, v);
  });
  stack->push_back(in_place ? self : out);
}

const RuleRegistrar r_index({"index.Tensor"}, index_rule, index_takes);
const RuleRegistrar r_index_put({"index_put.", "index_put_."}, index_put_rule, index_put_takes);

}  // namespace
}  // namespace shardtensor::ops
