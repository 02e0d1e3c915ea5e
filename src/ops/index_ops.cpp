// Ops that are index ops in disguise, along sharded dims (Note [index
// disguises]): repeat (and tile, which decomposes to it), embedding with a
// replicated or a vocabulary-sharded weight, advanced indexing x[idx] /
// x.index_put_(idx, v) with one index on any dim. repeat_interleave and
// take_along_dim need no rule: they are CompositeImplicitAutograd (1.13 and
// 2.13) and decompose onto ops with rules. libtorch 1.13 decomposed them into
// index_select with a plain index and gather; 2.13 (traced with a
// TorchDispatchMode) makes take_along_dim expand, remainder (the index
// wrapped) and gather, repeat_interleave with a tensor of repeats
// repeat_interleave.Tensor of the repeats and index_select, and
// repeat_interleave with an int unsqueeze, expand, clone and a view that
// merges the repeated dim with the new one. gather and index_select are the
// rules of Note [index ops along any dim] (ops/graph_ops.cpp); the rest are
// the elementwise and view rules.
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
//  - x.index({..., i, j, ...}) and x.index_put_({..., i, j, ...}, v,
//    accumulate) with two or more int64 indices on adjacent dims: Note
//    [several indices].
//
// Note [several indices]
// ~~~~~~~~~~~~~~~~~~~~~~
// Indices i_1..i_k (k >= 2) on the adjacent dims [a, a+k) of a ShardTensor x
// (no Partial), each plain or replicated, int64, broadcast together to a
// shape S (negative ids wrap; an id out of range raises on every rank, which
// all hold the same indices). The result has shape x[:a] + S + x[a+k:]. Every
// rank knows every entry's position, so each rank picks the entries whose
// element lies in its piece (its range on every indexed dim: a mask over S)
// and nothing moves:
//  - x[i_1, ..., i_k]: the plain index on the local piece, with ids made
//    local and the entries outside the piece zeroed (where). Each entry is
//    owned by exactly one coordinate of the mesh dims that shard the indexed
//    dims, so the result is Partial on those mesh dims (summing exactly: one
//    nonzero term, NaN and Inf kept), Shard on the mesh dims that shard the
//    other dims (shifted past S), Replicate elsewhere. The gradient flows to
//    the owners only, through libtorch's index backward on the pieces.
//  - x.index_put_(indices, v, accumulate): v plain or replicated, broadcast
//    to the result's shape; each rank writes the entries it owns (v sliced
//    along the other sharded dims) with libtorch's index_put_ on its piece,
//    in the entries' order (accumulate sums duplicates, as libtorch; without
//    it libtorch leaves duplicates undefined). v's gradient sums the owners'
//    contributions over the mesh dims that shard x (Note [replicated
//    gradients]). Out of place, the result is laid out like x.
// Indices on dims that are not adjacent (libtorch then moves S to the front),
// bool or sharded indices, and a sharded v keep the generic fallback.
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

// ---- repeat ---------------------------------------------------------------------------

bool repeat_takes(const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek_args(op, stack);
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
      const at::Tensor ids =
          at::arange(off, off + sizes[c], local.options().dtype(at::kLong)).remainder(n);
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
    // A 0-d index has no dim to split along: the generic fallback (before, asking the
    // layout of its dim 0 raised an internal error).
    if (idx.dim() == 0) return std::nullopt;
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
  return embedding_layout(peek_args(op, stack)).has_value();
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

// ---- several indices (Note [several indices]) -------------------------------------------

struct MultiIndex {
  int64_t first = -1;               // the indexed dims are [first, first + indices.size())
  std::vector<at::Tensor> indices;  // as given
  std::vector<int64_t> shape;       // their broadcast shape S
};

/// Two or more int64 indices, plain or replicated, on adjacent dims of a
/// ShardTensor without Partial; nullopt otherwise. Metadata only.
std::optional<MultiIndex> multi_index(const at::Tensor& self, const c10::IValue& list) {
  const ShardSpec* xs = spec_of(self);
  if (xs == nullptr || xs->has_partial() || !list.isList()) return std::nullopt;
  MultiIndex r;
  int64_t pos = 0;
  bool ended = false;
  for (const c10::IValue& v : list.toListRef()) {
    if (v.isTensor() && v.toTensor().defined()) {
      if (ended) return std::nullopt;  // not adjacent
      if (r.first < 0) r.first = pos;
      r.indices.push_back(v.toTensor());
    } else if (v.isNone() || v.isTensor()) {
      if (r.first >= 0) ended = true;
    } else {
      return std::nullopt;
    }
    ++pos;
  }
  const int64_t k = static_cast<int64_t>(r.indices.size());
  if (k < 2 || r.first + k > self.dim()) return std::nullopt;
  for (const at::Tensor& t : r.indices) {
    if (t.scalar_type() != at::kLong) return std::nullopt;
    const ShardSpec* s = spec_of(t);
    if (s != nullptr && (!s->is_replicated() || s->mesh() != xs->mesh())) return std::nullopt;
    const auto bs = at::infer_size(r.shape, t.sizes());  // throws if not broadcastable
    r.shape.assign(bs.begin(), bs.end());
  }
  return r;
}

std::optional<MultiIndex> multi_index_or_none(const at::Tensor& self, const c10::IValue& list) {
  try {
    return multi_index(self, list);
  } catch (const c10::Error&) {
    return std::nullopt;  // indices that do not broadcast: libtorch's error, via the fallback
  }
}

/// The global shape of x[indices].
std::vector<int64_t> indexed_shape(const ShardSpec& xs, const MultiIndex& r) {
  const auto& g = xs.global_shape();
  const int64_t k = static_cast<int64_t>(r.indices.size());
  std::vector<int64_t> shape(g.begin(), g.begin() + r.first);
  shape.insert(shape.end(), r.shape.begin(), r.shape.end());
  shape.insert(shape.end(), g.begin() + r.first + k, g.end());
  return shape;
}

/// This rank's share of the entries: per indexed dim the ids local to the
/// piece (0 where the entry is not here), and the mask of the entries here.
struct LocalEntries {
  std::vector<at::Tensor> ids;  // int64, shape S
  at::Tensor here;              // bool, shape S
  bool empty_piece = false;     // an indexed dim's piece is empty here
};

/// Local (the indices are the same on every rank, so an id out of range
/// raises on every rank).
LocalEntries local_entries(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                           const ShardSpec& xs, const MultiIndex& r) {
  std::vector<at::Tensor> locals;
  for (const at::Tensor& t : r.indices) locals.push_back(local_of(t));
  const std::vector<at::Tensor> full = at::broadcast_tensors(locals);
  const auto off = xs.local_offsets();
  const auto len = xs.local_shape();
  LocalEntries e;
  e.here = at::ones(
      r.shape, full.empty() ? at::TensorOptions(at::kBool) : full[0].options().dtype(at::kBool));
  for (size_t j = 0; j < full.size(); ++j) {
    const int64_t d = r.first + static_cast<int64_t>(j);
    const int64_t n = xs.global_shape()[d];
    at::Tensor t = full[j];
    if (t.numel() > 0) {
      const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
      const int64_t bad = lo < -n ? lo : hi >= n ? hi : 0;
      if (lo < -n || hi >= n) {
        fail(op, args,
             "index " + std::to_string(bad) + " is out of bounds for dimension " +
                 std::to_string(d) + " with size " + std::to_string(n));
      }
    }
    t = at::where(t.lt(0), t + n, t) - off[d];
    e.here = e.here.logical_and(t.ge(0)).logical_and(t.lt(len[d]));
    e.ids.push_back(t);
    e.empty_piece = e.empty_piece || len[d] == 0;
  }
  for (at::Tensor& t : e.ids) t = at::where(e.here, t, at::zeros({}, t.options()));
  return e;
}

/// The index list for a piece: `first` slices, then `ids`.
c10::List<c10::optional<at::Tensor>> index_list(int64_t first, const std::vector<at::Tensor>& ids) {
  c10::List<c10::optional<at::Tensor>> l;
  for (int64_t i = 0; i < first; ++i) l.push_back(c10::nullopt);
  for (const at::Tensor& t : ids) l.push_back(t);
  return l;
}

void multi_index_rule(const c10::OperatorHandle& op, std::vector<c10::IValue> args, Stack* stack) {
  const at::Tensor self = args[0].toTensor();
  const ShardSpec& xs = *spec_of(self);
  const MultiIndex r = *multi_index(self, args[1]);
  const int64_t k = static_cast<int64_t>(r.indices.size());
  const int64_t ns = static_cast<int64_t>(r.shape.size());
  const LocalEntries e = local_entries(op, args, xs, r);
  const at::Tensor xl = local_of(self);
  // The result's layout: Partial where an indexed dim is sharded.
  Placements p = xs.placements();
  ShardSizes sizes = xs.all_shard_sizes();
  for (size_t m = 0; m < p.size(); ++m) {
    const int64_t d = shard_dim(p[m]);
    if (d < r.first) continue;  // Replicate (-1) or before the indexed dims
    if (d < r.first + k) {
      p[m] = Partial{};
      sizes[m] = {};
    } else {
      p[m] = Shard{d - k + ns};
    }
  }
  const SpecPtr spec = make_spec(xs.mesh(), p, indexed_shape(xs, r), sizes);
  at::Tensor out;
  if (e.empty_piece) {
    // No entry here; stays connected to the (empty) piece so that every rank's
    // result requires grad alike.
    out = at::zeros(spec->local_shape(), xl.options());
    if (xl.requires_grad()) out = out + at::sum(xl, xl.scalar_type());
  } else {
    const at::Tensor sel = at::index(xl, index_list(r.first, e.ids));
    std::vector<int64_t> mask_shape(r.first, 1);
    mask_shape.insert(mask_shape.end(), r.shape.begin(), r.shape.end());
    mask_shape.resize(sel.dim(), 1);
    out = at::where(e.here.view(mask_shape), sel, at::zeros({}, sel.options()));
  }
  stack->push_back(wrap(out, spec));
}

/// index_put's values as given, when they fit Note [several indices].
bool multi_values_fit(const at::Tensor& self, const MultiIndex& r, const at::Tensor& v) {
  const ShardSpec* vs = spec_of(v);
  if (vs != nullptr && (!vs->is_replicated() || vs->mesh() != spec_of(self)->mesh())) return false;
  return at::is_expandable_to(v.sizes(), indexed_shape(*spec_of(self), r));
}

void multi_index_put_rule(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                          Stack* stack) {
  at::Tensor self = args[0].toTensor();
  const ShardSpec& xs = *spec_of(self);
  const MultiIndex r = *multi_index(self, args[1]);
  const bool accumulate = args[3].toBool();
  const bool in_place = is_written(op.schema().arguments()[0]);
  const int64_t k = static_cast<int64_t>(r.indices.size());
  const int64_t ns = static_cast<int64_t>(r.shape.size());
  const LocalEntries e = local_entries(op, args, xs, r);
  at::Tensor xl = local_of(self);
  at::Tensor v = local_of(args[2].toTensor());
  const std::vector<int64_t> sharded = sharded_mesh_dims(xs);
  if (v.requires_grad() && at::GradMode::is_enabled() && !sharded.empty()) {
    v = comm::use_replicated(v, xs.mesh(), sharded);
  }
  // v over the result's shape, sliced to this rank's piece of the other dims.
  v = v.expand(indexed_shape(xs, r));
  const auto off = xs.local_offsets();
  const auto len = xs.local_shape();
  for (int64_t d = 0; d < xs.ndim(); ++d) {
    if (d >= r.first && d < r.first + k) continue;
    const int64_t rd = d < r.first ? d : d - k + ns;
    if (len[d] != xs.global_shape()[d]) v = v.narrow(rd, off[d], len[d]);
  }
  // The entries here, in their order.
  std::vector<int64_t> flat(v.sizes().begin(), v.sizes().begin() + r.first);
  flat.push_back(c10::multiply_integers(r.shape));  // not -1: another dim may be empty
  flat.insert(flat.end(), v.sizes().begin() + r.first + ns, v.sizes().end());
  const at::Tensor sel = e.here.reshape({-1}).nonzero().squeeze(1);
  std::vector<at::Tensor> ids;
  for (const at::Tensor& t : e.ids) ids.push_back(t.reshape({-1}).index_select(0, sel));
  const at::Tensor vs = v.reshape(flat).index_select(r.first, sel);
  const auto list = index_list(r.first, ids);
  at::Tensor out =
      in_place ? xl.index_put_(list, vs, accumulate) : xl.index_put(list, vs, accumulate);
  if (in_place) {
    stack->push_back(self);
  } else {
    stack->push_back(wrap(out, spec_ptr_of(self)));
  }
}

bool index_takes(const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek_args(op, stack);
  if (!a[0].isTensor()) return false;
  const at::Tensor self = a[0].toTensor();
  if (multi_index_or_none(self, a[1])) return true;
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
  if (multi_index_or_none(self, args[1])) return multi_index_rule(op, std::move(args), stack);
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
  const auto a = peek_args(op, stack);
  if (!a[0].isTensor() || !a[2].isTensor()) return false;
  const at::Tensor self = a[0].toTensor();
  if (spec_of(self) == nullptr) return false;
  if (const auto mr = multi_index_or_none(self, a[1])) {
    return multi_values_fit(self, *mr, a[2].toTensor());
  }
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
  if (multi_index_or_none(self, args[1])) return multi_index_put_rule(op, std::move(args), stack);
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
