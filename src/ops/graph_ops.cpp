// Message passing as users write it: index_select / gather of node rows by
// edge endpoints, and index_add / scatter_add / scatter_reduce back into the
// nodes, on row-sharded nodes and edges, through GhostPlans
// (Note [graph op rules], Note [index plan cache]); and the same ops, with
// index_copy and index_fill, along any dim of an N-d ShardTensor (Note
// [index ops along any dim]), with index_reduce and the reduce= overloads of
// scatter (Note [legacy scatter reductions and index_reduce]).
//
// Note [graph op rules]
// ~~~~~~~~~~~~~~~~~~~~~
// Nodes are a ShardTensor `x` sharded Shard(0) along one mesh dim m and
// Replicate on the others (any sizes, zeros included); edges are ShardTensors
// sharded Shard(0) along the same m and Replicate elsewhere (any sizes), and
// an index holds *global* node ids. For such calls along dim 0:
//
//   x.index_select(0, idx), x.gather(0, idx)              -> laid out like idx
//   x.index_add(0, idx, src, alpha), x.scatter_add(0, idx, src),
//   x.scatter_reduce(0, idx, src, reduce, include_self)   -> laid out like x
//   (and index_add_, scatter_add_, scatter_reduce_)
//
// the rule builds (or reuses, Note [index plan cache]) the GhostPlan of the
// index's ids, maps them to rows of this rank's `[owned | ghost]` layout, and
// runs the plain libtorch op on local rows:
//  - selection: ghost_exchange(x) brings the ghost rows, then index_select /
//    gather on the extended rows. Backward is libtorch's index_add / scatter
//    into the extended rows followed by ghost_accumulate (the exchange's
//    adjoint), so a node's gradient sums the contributions of every rank.
//  - sum and mean: the contributions are scattered into zero-filled extended
//    rows and ghost_accumulate completes each owned row's sum across ranks;
//    a count of contributions (accumulated the same way, no gradient) gives
//    include_self=false (indexed rows start from 0, as libtorch fills them
//    with the reduction's identity) and the mean's divisor (count + 1 with
//    include_self, 0 replaced by 1, floor division for integers, as
//    libtorch). Autograd derives the backward.
//  - amax, amin, prod: the contributions are combined into extended rows
//    filled with the identity (-inf / +inf / the integer limits, or 1), then
//    each owner combines the ghost copies of its rows (Max / Min / Product,
//    ghost_accumulate_nograd). The gradient is libtorch's
//    scatter_reduce_backward formula (1.13 and 2.13: on 2.13 a self of 0
//    under two messages of 0 with include_self=false still gets counted, each
//    message's gradient 1/3) evaluated on the global values (the
//    result is exchanged back to the edges' ranks to find the maximal
//    messages, ties split evenly; the tie count N includes a self equal to
//    the result even when include_self=false, exactly as libtorch does), in
//    the hand-written ScatterCombineFn: its coefficients are computed in
//    forward and its backward is one ghost_exchange of the scaled gradient.
//    Under create_graph its backward is built from differentiable pieces; it
//    is exact for amax/amin (constant coefficients, as libtorch's) and throws
//    for prod (whose coefficients depend on the inputs).
// These are the row-sharded case of Note [index ops along any dim] (below),
// which generalises them to any dim of an N-d tensor, replicated or sharded
// indices and src, and adds index_copy and index_fill. A call outside those
// layouts (a Partial placement, an index or src sharded unlike the layouts
// there, sparse_grad, a float16/bfloat16 or complex reduction) is not taken
// (Note [partial rules]) and runs as before: through the generic fallback, on
// gathered tensors, exactly. A bad call (an id outside [0, N) on any rank,
// shapes or dtypes libtorch refuses) throws a c10::Error naming the op, the
// shapes and the placements on every rank, before any data moves.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/intrusive_ptr.h>
#include <shardtensor/comm/ghost.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <limits>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/agree.h"
#include "ops/common.h"
#include "ops/graph_ops.h"

namespace shardtensor::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- Note [index plan cache] --------------------------------------------------------
//
// Note [index plan cache]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Building a GhostPlan costs two all-to-allvs and a sort of the ids; a model
// calls the same index many times (every layer, every step). The rules keep
// the plans of at most kMaxIndexPlans index tensors (least recently used
// dropped), each with the index mapped to extended rows. An entry is found
// for the index's local piece when all of these are unchanged: its TensorImpl
// (held by a weak reference, so that a freed impl's address cannot be reused
// by a new tensor while the entry lives, and an entry whose tensor died is
// dropped), its version counter (every in-place write bumps it, also through
// views), data_ptr, numel, sizes, strides and dtype, and the mesh, mesh dim
// and node sizes. Writes the version counter cannot see (through `.data`, or
// raw pointers) are not detected, as libtorch's own saved-tensor checks do
// not detect them; an index rebuilt on every call (e.g. `dst.unsqueeze(1)
// .expand(...)` inside the layer) is a new tensor each time and builds a new
// plan: hoist it out of the loop. Inference tensors (no version counter) are
// never cached. An entry holds its plan (and through it the mesh) and the
// mapped index until its index tensor dies and the next call of one of these
// rules drops it, or until clear_index_plan_cache() (ops/graph_ops.h).
//
// The plan's send lists depend on every rank's ids, so a rank may reuse its
// plan only if every rank reuses the plan of the *same* build: each call
// agrees on that with comm::agree_cache_reuse (one all-reduce of five
// integers, Note [cross-rank cache agreement] in src/comm/agree.h), which
// also carries this rank's verdict on its ids (an id outside [0, N): then
// check_all raises the failing rank's message on every rank). Unless every
// rank hit an entry of one build, every rank rebuilds (collectively) and
// replaces its entry.

struct Entry {
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::optional<WeakImpl> impl;  // keeps the impl's address from being reused
  const c10::TensorImpl* raw = nullptr;
  int64_t version = 0;
  const void* data = nullptr;
  int64_t numel = 0;
  std::vector<int64_t> shape, strides;
  at::ScalarType dtype = at::kLong;
  DeviceMesh mesh;
  int64_t mesh_dim = 0;
  std::vector<int64_t> node_sizes;
  std::vector<int64_t> extra;  // how the ids were derived from the index (its target piece)
  int64_t stamp = 0;
  GhostPlan plan;
  at::Tensor rows;  // the index mapped to extended rows (int64, the index's shape)

  bool dead() const { return !impl || impl->expired(); }
};

struct PlanCache {
  std::mutex mu;
  std::list<Entry> entries;  // most recently used first
  int64_t builds = 0, reuses = 0, stamp = 0;
};

PlanCache& plan_cache() {
  static auto* c = new PlanCache();  // never destroyed (plans may be used at exit)
  return *c;
}

bool same_key(const Entry& e, const at::Tensor& idx, const DeviceMesh& mesh, int64_t m,
              const std::vector<int64_t>& node_sizes, const std::vector<int64_t>& extra) {
  return !e.dead() && e.raw == idx.unsafeGetTensorImpl() && e.version == idx._version() &&
         e.data == idx.data_ptr() && e.numel == idx.numel() && e.shape == idx.sizes().vec() &&
         e.strides == idx.strides().vec() && e.dtype == idx.scalar_type() && e.mesh_dim == m &&
         e.node_sizes == node_sizes && e.extra == extra && e.mesh == mesh;
}

}  // namespace

IndexPlan index_plan(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     const DeviceMesh& mesh, int64_t m, const std::vector<int64_t>& node_sizes,
                     const at::Tensor& idx, const at::Tensor& key,
                     const std::vector<int64_t>& extra) {
  auto& c = plan_cache();
  const bool cacheable = key.defined() && !key.is_inference();
  std::optional<IndexPlan> found;
  int64_t found_stamp = 0, next_stamp = 0;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.entries.remove_if([](const Entry& e) { return e.dead(); });
    if (cacheable) {
      for (auto it = c.entries.begin(); it != c.entries.end(); ++it) {
        if (!same_key(*it, key, mesh, m, node_sizes, extra)) continue;
        found = IndexPlan{it->plan, it->rows};
        found_stamp = it->stamp;
        c.entries.splice(c.entries.begin(), c.entries, it);
        break;
      }
    }
    next_stamp = c.stamp + 1;
  }
  int64_t n = 0;
  for (int64_t s : node_sizes) n += s;
  bool ok = true;
  std::string msg;
  if (!found && idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    if (lo < 0 || hi >= n) {
      ok = false;
      msg = "index out of range: this rank's index piece holds ids in [" + std::to_string(lo) +
            ", " + std::to_string(hi) + "] but the nodes have " + std::to_string(n) + " rows, in " +
            describe_call(op, args);
    }
  }
  const comm::CacheAgreement agreed = comm::agree_cache_reuse(
      mesh, ok, found ? std::optional<int64_t>(found_stamp) : std::nullopt, next_stamp);
  if (!agreed.all_ok) {
    comm::check_all(mesh, ok, "shardtensor: " + c10::toString(op.operator_name()), msg);
  }
  if (agreed.reuse) {
    std::lock_guard<std::mutex> lock(c.mu);
    ++c.reuses;
    return *found;
  }
  IndexPlan out;
  const at::Tensor ids = idx.to(at::kLong);
  out.plan = GhostPlan::build(mesh, m, node_sizes, ids.reshape({-1}));
  out.rows = out.plan.local_index(ids);
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.builds;
  c.stamp = agreed.stamp;
  if (cacheable) {
    c.entries.remove_if(
        [&](const Entry& e) { return same_key(e, key, mesh, m, node_sizes, extra); });
    Entry e;
    e.impl = Entry::WeakImpl(key.getIntrusivePtr());
    e.raw = key.unsafeGetTensorImpl();
    e.version = key._version();
    e.data = key.data_ptr();
    e.numel = key.numel();
    e.shape = key.sizes().vec();
    e.strides = key.strides().vec();
    e.dtype = key.scalar_type();
    e.mesh = mesh;
    e.mesh_dim = m;
    e.node_sizes = node_sizes;
    e.extra = extra;
    e.stamp = agreed.stamp;
    e.plan = out.plan;
    e.rows = out.rows;
    c.entries.push_front(std::move(e));
    while (c.entries.size() > kMaxIndexPlans) c.entries.pop_back();
  }
  return out;
}

namespace {

// ---- amax / amin / prod --------------------------------------------------------------

struct CombineArgs {
  GhostPlan plan;
  at::Tensor rows;     // the index mapped to extended rows
  at::Tensor indexed;  // owned elements that receive a contribution (bool); with !include_self
  std::string reduce;  // "amax", "amin", "prod"
  bool include_self = true;
};

at::Scalar identity_of(const std::string& reduce, at::ScalarType t) {
  return reduce == "prod" ? at::Scalar(1) : extreme_identity(t, reduce == "amax");
}

ReduceOp combine_op(const std::string& reduce) {
  return reduce == "amax" ? ReduceOp::Max : reduce == "amin" ? ReduceOp::Min : ReduceOp::Product;
}

std::vector<int64_t> extended_shape(const at::Tensor& owned, const GhostPlan& plan) {
  std::vector<int64_t> s = owned.sizes().vec();
  s[0] = plan.num_extended();
  return s;
}

/// Collective over the plan's mesh dim, no gradient. The global combination
/// (a.reduce) of the contributions `src` into the owned rows (shaped like
/// `self`): the identity where there are none.
at::Tensor combine_contributions(const at::Tensor& self, const at::Tensor& src,
                                 const CombineArgs& a) {
  at::Tensor ext = at::full(extended_shape(self, a.plan), identity_of(a.reduce, self.scalar_type()),
                            self.options());
  ext.scatter_reduce_(0, a.rows, src, a.reduce, /*include_self=*/true);
  return ghost_accumulate_nograd(ext, a.plan, combine_op(a.reduce));
}

/// Local, no gradient. libtorch's scatter_reduce(self, 0, index, src, reduce,
/// include_self) on the whole graph, this rank's owned rows, from the
/// combined contributions `comb`.
at::Tensor reduced_value(const at::Tensor& self, const at::Tensor& comb, const CombineArgs& a) {
  if (!a.include_self) return at::where(a.indexed, comb, self);
  if (a.reduce == "amax") return at::maximum(self, comb);
  if (a.reduce == "amin") return at::minimum(self, comb);
  return self * comb;
}

/// Collective over the plan's mesh dim, no gradient. The sum over every rank
/// of `per_entry` (shaped like the index) scattered into the owned rows.
at::Tensor count_into(const at::Tensor& self, const at::Tensor& per_entry, const GhostPlan& plan,
                      const at::Tensor& rows) {
  at::Tensor ext = at::zeros(extended_shape(self, plan), self.options())
                       .scatter_add_(0, rows, per_entry.to(self.scalar_type()));
  return ghost_accumulate_nograd(ext, plan, ReduceOp::Sum);
}

template <class T>
struct Boxed : torch::CustomClassHolder {
  explicit Boxed(T v) : value(std::move(v)) {}
  T value;
};

// Hand-written: the value combines rows across ranks with a non-differentiable
// Max / Min / Product (ghost_accumulate_nograd); the backward is libtorch's
// scatter_reduce_backward formula with coefficients computed in forward, and
// one ghost_exchange of the scaled gradient (Note [graph op rules]).
struct ScatterCombineFn : torch::autograd::Function<ScatterCombineFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, const at::Tensor& src,
                            CombineArgs a) {
    const auto dt = self.scalar_type();
    at::Tensor comb = combine_contributions(self, src, a);
    at::Tensor result = reduced_value(self, comb, a);
    auto& sd = ctx->saved_data;
    sd["plan"] = c10::IValue::make_capsule(c10::make_intrusive<Boxed<GhostPlan>>(a.plan));
    sd["rows"] = a.rows;
    sd["indexed"] = a.include_self ? at::Tensor() : a.indexed;
    sd["prod"] = a.reduce == "prod";
    if (a.reduce != "prod") {
      // libtorch: value = result.gather(dim, index); the gradient is split
      // among N = (self == result) + the number of (src == value) per row.
      at::Tensor value = ghost_exchange(result, a.plan).gather(0, a.rows);
      at::Tensor src_is = src.eq(value);
      at::Tensor self_is = self.eq(result);
      sd["n"] = self_is.to(dt) + count_into(self, src_is, a.plan, a.rows);
      sd["self_is"] = self_is;
      sd["src_is"] = src_is;
    } else {
      // libtorch: zeros in self and single zeros among a row's src are
      // masked to 1, and the products recomputed, so that a gradient is not
      // lost as 0 / 0.
      at::Tensor masked_self = self.masked_fill(self.eq(0), 1);
      sd["msr"] = a.include_self ? masked_self * comb : at::where(a.indexed, comb, masked_self);
      sd["masked_self"] = masked_self;
      at::Tensor src_zero = src.eq(0);
      at::Tensor zeros = count_into(self, src_zero, a.plan, a.rows);
      at::Tensor both = ghost_exchange(at::stack({result, zeros}, -1), a.plan);
      at::Tensor single = src_zero.logical_and(both.select(-1, 1).gather(0, a.rows).eq(1));
      at::Tensor msrc_result =
          reduced_value(self, combine_contributions(self, src.masked_fill(single, 1), a), a);
      sd["single"] = single;
      sd["msrc_result"] = ghost_exchange(msrc_result, a.plan).gather(0, a.rows);
      sd["result"] = both.select(-1, 0).gather(0, a.rows);
      sd["src_masked"] = src.masked_fill(src_zero, 1);
    }
    return result;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("ScatterCombineFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto& sd = ctx->saved_data;
    const GhostPlan& plan = static_cast<Boxed<GhostPlan>*>(sd.at("plan").toCapsule().get())->value;
    const at::Tensor rows = sd.at("rows").toTensor();
    const at::Tensor indexed =
        sd.at("indexed").isTensor() ? sd.at("indexed").toTensor() : at::Tensor();
    at::Tensor grad_self, grad_src;
    if (!sd.at("prod").toBool()) {
      // Built from differentiable pieces (ghost_exchange is a Function): the
      // coefficients are constants, as in libtorch's formula, so this is
      // exact under create_graph too.
      at::Tensor gd = g / sd.at("n").toTensor();
      grad_self = sd.at("self_is").toTensor() * gd;
      grad_src = sd.at("src_is").toTensor() * ghost_exchange(gd, plan).gather(0, rows);
    } else {
      // The same graph, hence the same verdict, on every rank.
      TORCH_CHECK(!at::GradMode::is_enabled(),
                  "shardtensor: double backward (create_graph=true) through a sharded "
                  "scatter_reduce with reduce='prod' is not supported: its gradient's "
                  "coefficients are computed as constants (Note [graph op rules])");
      grad_self = g * sd.at("msr").toTensor() / sd.at("masked_self").toTensor();
      at::Tensor ge = ghost_exchange(g, plan).gather(0, rows);
      grad_src = at::where(sd.at("single").toTensor(), ge * sd.at("msrc_result").toTensor(),
                           ge * sd.at("result").toTensor() / sd.at("src_masked").toTensor());
    }
    if (indexed.defined()) grad_self = grad_self.masked_fill(indexed, 0);
    return {grad_self, grad_src, at::Tensor()};
  }
};

// ---- the rules --------------------------------------------------------------------

enum class Kind {
  IndexSelect,
  Gather,
  IndexAdd,
  ScatterAdd,
  ScatterReduce,
  IndexCopy,
  IndexFill,
  Scatter,       // scatter.src
  ScatterValue,  // scatter.value
  IndexReduce    // index_reduce (Note [legacy scatter reductions and index_reduce])
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::IndexSelect:
      return "index_select";
    case Kind::Gather:
      return "gather";
    case Kind::IndexAdd:
      return "index_add";
    case Kind::ScatterAdd:
      return "scatter_add";
    case Kind::ScatterReduce:
      return "scatter_reduce";
    case Kind::IndexCopy:
      return "index_copy";
    case Kind::IndexFill:
      return "index_fill";
    case Kind::Scatter:
    case Kind::ScatterValue:
      return "scatter";
    case Kind::IndexReduce:
      return "index_reduce";
  }
  return "";
}

/// Ops with a src tensor.
bool has_src(Kind k) {
  return k == Kind::IndexAdd || k == Kind::ScatterAdd || k == Kind::ScatterReduce ||
         k == Kind::IndexCopy || k == Kind::Scatter || k == Kind::IndexReduce;
}
/// Ops whose result is laid out like self.
bool writes_self(Kind k) { return has_src(k) || k == Kind::IndexFill || k == Kind::ScatterValue; }
/// Ops with a 1-D index of entries along dim (the others have a gather-style
/// index with self's number of dims).
bool one_d(Kind k) {
  return k == Kind::IndexSelect || k == Kind::IndexAdd || k == Kind::IndexCopy ||
         k == Kind::IndexFill || k == Kind::IndexReduce;
}

struct Call {
  at::Tensor self, index, src;
  std::string reduce = "sum";
  bool include_self = true;
  c10::Scalar alpha = 1;  // index_add; the fill value of index_fill
};

Call parse(Kind kind, const std::vector<c10::IValue>& a) {
  Call c;
  c.self = a[0].toTensor();
  c.index = a[2].toTensor();
  if (has_src(kind)) c.src = a[3].toTensor();
  if (kind == Kind::IndexAdd) c.alpha = a[4].toScalar();
  if (kind == Kind::IndexFill || kind == Kind::ScatterValue) c.alpha = a[3].toScalar();
  if (kind == Kind::ScatterReduce || kind == Kind::IndexReduce) {
    c.reduce = a[4].toStringRef();
    c.include_self = a[5].toBool();
  }
  return c;
}

// Note [index ops along any dim]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Note [graph op rules] in general: self is a ShardTensor (or a plain tensor,
// taken as replicated) in any layout without Partial, and the op works along
// any dim d. Two cases, decided from metadata alone:
//
//  - d is sharded by mesh dim m (the "ghost" path). The index's entries (its
//    dim 0 for index_select / index_add / index_copy / index_fill, its dim d
//    for gather / scatter_add / scatter_reduce) are sharded along m too: with
//    the index's own sizes when it is sharded there, else with src's when src
//    is, else balanced. A replicated (plain) index or src is sliced to those
//    entries locally (src differentiably: its gradient is all-gathered). The
//    other dims are laid out like self: the index, src and a gather's result
//    must then match self's extent on every other sharded dim. d is moved to
//    the front (movedim, a view) and the rest of each row travels as
//    features: one GhostPlan of this rank's ids over m (Note [index plan
//    cache]; on a 2-D mesh the plan's exchange runs within each m
//    sub-communicator, where the other dims' pieces agree), then the rules of
//    Note [graph op rules] on the moved rows. index_copy scatters src into
//    zero extended rows, ghost_accumulate brings them to their owners, and a
//    count of the entries per row (no gradient) says which rows take the copy
//    (duplicate ids: libtorch leaves the result undefined; here the copies are
//    summed). scatter (src or value) does the same per element with a
//    gather-style index (duplicate positions: summed, where libtorch leaves
//    them undefined). index_fill with a replicated index needs no
//    communication (each rank fills the ids it owns); with a sharded one the
//    count says where.
//  - d is not sharded (the "local" path): the plain op on the local pieces,
//    with no communication at all when the index is replicated and used whole
//    (one 1-int all-reduce of an error flag otherwise, so that an id outside
//    [0, n) on one rank throws on every rank). The index is replicated, or
//    laid out like self on the other dims; for index_select and gather only,
//    its entries may also be sharded along a mesh dim on which self is
//    Replicate: the result is then sharded like the index (and self's
//    gradient is summed over that mesh dim).
// Anything else (Partial, an index or src sharded unlike these targets, a
// src wider than the index along a sharded d, complex dtypes) is not taken
// (Note [partial rules]) and keeps the exact generic fallback.

struct Layout {
  DeviceMesh mesh;
  SpecPtr xs;                              // self's layout (fully replicated for a plain self)
  int64_t d = 0;                           // the op's dim, wrapped
  int64_t m = -1;                          // the mesh dim sharding d in self, or -1
  int64_t em = -1;                         // the mesh dim sharding the entries, or -1
  std::vector<int64_t> es;                 // entry sizes along em
  SpecPtr index_spec, src_spec, out_spec;  // the layouts the rule computes in
};

/// A spec laid out like self (Shard(d) along em with the entry sizes) for a
/// tensor of `shape`; nullptr when `shape` disagrees with self's extent on a
/// dim that another mesh dim shards, or its dim d with the entry sizes.
SpecPtr like_self(const Layout& L, const std::vector<int64_t>& shape) {
  const ShardSpec& xs = *L.xs;
  if (static_cast<int64_t>(shape.size()) != xs.ndim()) return nullptr;
  Placements p = xs.placements();
  ShardSizes s = xs.all_shard_sizes();
  for (int64_t k = 0; k < L.mesh.ndim(); ++k) {
    if (k == L.em) continue;
    const int64_t e = shard_dim(p[k]);
    if (e >= 0 && e != L.d && shape[e] != xs.global_shape()[e]) return nullptr;
  }
  if (L.em >= 0) {
    int64_t sum = 0;
    for (int64_t v : L.es) sum += v;
    if (shape[L.d] != sum) return nullptr;
    p[L.em] = Shard{L.d};
    s[L.em] = L.es;
  }
  return make_spec(L.mesh, p, shape, s);
}

/// A 1-D index laid out as the entries.
SpecPtr entries_1d(const Layout& L, int64_t n) {
  Placements p(L.mesh.ndim(), Replicate{});
  ShardSizes s(L.mesh.ndim());
  if (L.em >= 0) {
    int64_t sum = 0;
    for (int64_t v : L.es) sum += v;
    if (sum != n) return nullptr;
    p[L.em] = Shard{0};
    s[L.em] = L.es;
  }
  return make_spec(L.mesh, p, {n}, s);
}

/// Whether `t` is a plain tensor or a ShardTensor with every placement Replicate.
bool is_replicated_operand(const at::Tensor& t) {
  const ShardSpec* s = spec_of(t);
  return s == nullptr || s->is_replicated();
}

/// Whether `t` can be brought to `target` without replicating more than its
/// piece: a plain or replicated tensor (sliced locally), or one with the
/// target's placements (its sizes may differ: a repartition).
bool fits(const at::Tensor& t, const SpecPtr& target) {
  if (!target) return false;
  if (t.sizes().vec() != target->global_shape()) return false;
  const ShardSpec* s = spec_of(t);
  if (s == nullptr) return true;
  if (s->has_partial() || s->mesh() != target->mesh()) return false;
  return s->is_replicated() || s->placements() == target->placements();
}

/// The piece of the index in the layout `target` (fits()); no gradient.
at::Tensor index_piece(const at::Tensor& t, const ShardSpec& target) {
  const ShardSpec* s = spec_of(t);
  if (s != nullptr && *s == target) return local_of(t);
  if (s != nullptr && !s->is_replicated()) {
    at::NoGradGuard no_grad;
    return detail::redistribute_local(local_of(t), *s, target);
  }
  at::Tensor full = local_of(t);
  const auto off = target.local_offsets();
  const auto shape = target.local_shape();
  for (int64_t e = 0; e < full.dim(); ++e) {
    if (shape[e] != full.size(e)) full = full.narrow(e, off[e], shape[e]);
  }
  return full;
}

/// Note [partial rules], Note [index ops along any dim]: the layout the rule
/// computes in, or nullopt when the call is not taken. Metadata only.
std::optional<Layout> analyse(Kind kind, const std::vector<c10::IValue>& a) {
  if (!a[0].isTensor() || !a[1].isInt() || !a[2].isTensor()) return std::nullopt;
  if (has_src(kind) && !a[3].isTensor()) return std::nullopt;
  if ((kind == Kind::IndexFill || kind == Kind::ScatterValue) && !a[3].isScalar()) {
    return std::nullopt;
  }
  if (kind == Kind::Gather && a[3].toBool()) return std::nullopt;  // sparse_grad
  const at::Tensor x = a[0].toTensor(), idx = a[2].toTensor();
  const at::Tensor src = has_src(kind) ? a[3].toTensor() : at::Tensor();
  const ShardSpec* xs = spec_of(x);
  const ShardSpec* is = spec_of(idx);
  const ShardSpec* ss = src.defined() ? spec_of(src) : nullptr;
  Layout L;
  bool have_mesh = false;
  for (const ShardSpec* s : {xs, is, ss}) {
    if (s == nullptr) continue;
    if (s->has_partial()) return std::nullopt;
    if (!have_mesh) {
      L.mesh = s->mesh();
      have_mesh = true;
    } else if (s->mesh() != L.mesh) {
      return std::nullopt;
    }
  }
  if (!have_mesh) return std::nullopt;
  const at::ScalarType t = x.scalar_type();
  if (at::isComplexType(t)) return std::nullopt;
  if (has_src(kind) &&
      !(t == at::kFloat || t == at::kDouble || at::isIntegralType(t, /*includeBool=*/false))) {
    return std::nullopt;
  }
  const int64_t nd = x.dim();
  if (nd == 0) return std::nullopt;
  if (one_d(kind) ? idx.dim() != 1 : idx.dim() != nd) return std::nullopt;
  if (src.defined() && src.dim() != nd) return std::nullopt;
  int64_t d = a[1].toInt();
  if (d < -nd || d >= nd) return std::nullopt;
  L.d = d < 0 ? d + nd : d;
  L.xs = xs != nullptr ? spec_ptr_of(x)
                       : make_spec(L.mesh, Placements(L.mesh.ndim(), Replicate{}), x.sizes().vec());
  L.m = L.xs->mesh_dim_of(L.d);
  const int64_t ie = one_d(kind) ? 0 : L.d;  // the index's entry dim
  const int64_t n_entries = idx.size(ie);
  const int64_t im = is != nullptr ? is->mesh_dim_of(ie) : -1;
  const int64_t sm = ss != nullptr ? ss->mesh_dim_of(L.d) : -1;
  if (L.m >= 0) {
    L.em = L.m;
    if (im == L.m) {
      L.es = is->shard_sizes(L.m);
    } else if (sm == L.m && src.size(L.d) == n_entries) {
      L.es = ss->shard_sizes(L.m);
    } else {
      L.es = balanced_sizes(n_entries, L.mesh.size(L.m));
    }
  } else if (im >= 0) {
    // Entries sharded along a mesh dim on which self is Replicate: selections only.
    if (writes_self(kind) || !is_replicate(L.xs->placements()[im])) return std::nullopt;
    L.em = im;
    L.es = is->shard_sizes(im);
  }
  L.index_spec = one_d(kind) ? entries_1d(L, n_entries) : like_self(L, idx.sizes().vec());
  if (!fits(idx, L.index_spec)) return std::nullopt;
  if (src.defined()) {
    L.src_spec = like_self(L, src.sizes().vec());
    if (!fits(src, L.src_spec)) return std::nullopt;
  }
  if (writes_self(kind)) {
    L.out_spec = L.xs;
  } else if (kind == Kind::IndexSelect) {
    std::vector<int64_t> shape = L.xs->global_shape();
    shape[L.d] = n_entries;
    L.out_spec = like_self(L, shape);
  } else {
    L.out_spec = L.index_spec;
  }
  if (!L.out_spec) return std::nullopt;
  return L;
}

bool takes(Kind kind, const c10::OperatorHandle& op, const Stack& stack) {
  return analyse(kind, peek_args(op, stack)).has_value();
}

/// The reductions on local rows (Note [graph op rules]): this rank's owned
/// rows of the result.
at::Tensor reduce_rows(Kind kind, const Call& c, const at::Tensor& xl, const at::Tensor& sl,
                       const IndexPlan& ip) {
  CombineArgs a{ip.plan, ip.rows, at::Tensor(), c.reduce, c.include_self};
  at::Tensor cnt;
  if (!c.include_self || c.reduce == "mean") {
    at::NoGradGuard no_grad;
    cnt = count_into(xl, at::ones(ip.rows.sizes(), xl.options()), ip.plan, ip.rows);
    a.indexed = cnt.gt(0);
  }
  if (c.reduce == "sum" || c.reduce == "mean") {
    at::Tensor zeros = at::zeros(extended_shape(xl, ip.plan), xl.options());
    at::Tensor ext = kind == Kind::IndexAdd ? zeros.index_add(0, ip.rows, sl, c.alpha)
                                            : zeros.scatter_add(0, ip.rows, sl);
    at::Tensor num =
        (c.include_self ? xl : xl.masked_fill(a.indexed, 0)) + ghost_accumulate(ext, ip.plan);
    if (c.reduce == "sum") return num;
    at::Tensor den = c.include_self ? cnt + 1 : cnt;
    den = den.masked_fill(den.eq(0), 1);
    return xl.is_floating_point() ? num / den : num.div(den, "floor");
  }
  // amax / amin / prod use src where the index reaches (libtorch's formula
  // compares src with the gathered result elementwise).
  at::Tensor sn = sl;
  for (int64_t d = 1; d < sn.dim(); ++d) {
    if (sn.size(d) > ip.rows.size(d)) sn = sn.narrow(d, 0, ip.rows.size(d));
  }
  // The same verdict on every rank (the same program; Note [collective discipline]).
  if (at::GradMode::is_enabled() && (xl.requires_grad() || sn.requires_grad())) {
    return ScatterCombineFn::apply(xl, sn, a);
  }
  at::NoGradGuard no_grad;
  return reduced_value(xl, combine_contributions(xl, sn, a), a);
}

/// Metadata checks (the same verdict on every rank, before any communication).
void check_call(Kind kind, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                const Call& c, const Layout& L) {
  const int64_t nd = L.xs->ndim();
  const auto& xshape = L.xs->global_shape();
  const auto ishape = c.index.sizes().vec();
  const at::ScalarType it = c.index.scalar_type();
  const std::string dims = std::to_string(nd);
  if (kind == Kind::IndexSelect || kind == Kind::IndexAdd || kind == Kind::IndexReduce) {
    if (it != at::kLong && it != at::kInt) {
      fail(op, args,
           std::string("index must be an int64 or int32 tensor, got ") + c10::toString(it));
    }
  } else if (it != at::kLong) {
    fail(op, args, std::string("index must be an int64 tensor, got ") + c10::toString(it));
  }
  if (kind == Kind::Gather || kind == Kind::ScatterValue) {
    for (int64_t d = 0; d < nd; ++d) {
      if (d != L.d && ishape[d] > xshape[d]) {
        fail(op, args,
             "index.size(" + std::to_string(d) + ") must be <= self.size(" + std::to_string(d) +
                 ")");
      }
    }
  }
  if (c.src.defined()) {
    const auto sshape = c.src.sizes().vec();
    if (c.src.scalar_type() != c.self.scalar_type()) {
      fail(op, args,
           std::string("self and src must have the same dtype, got ") +
               c10::toString(c.self.scalar_type()) + " and " + c10::toString(c.src.scalar_type()));
    }
    for (int64_t d = 0; d < nd; ++d) {
      const std::string ds = std::to_string(d);
      if (one_d(kind) && d != L.d && sshape[d] != xshape[d]) {
        fail(op, args, "source.size(" + ds + ") must equal self.size(" + ds + ")");
      }
      if (!one_d(kind) && (ishape[d] > sshape[d] || (d != L.d && ishape[d] > xshape[d]))) {
        fail(op, args,
             "index.size(" + ds + ") must be <= src.size(" + ds + ") and <= self.size(" + ds + ")");
      }
    }
  }
  if (kind == Kind::ScatterReduce && c.reduce != "sum" && c.reduce != "mean" &&
      c.reduce != "amax" && c.reduce != "amin" && c.reduce != "prod") {
    fail(op, args, "reduce must be one of sum, prod, mean, amax, amin, got '" + c.reduce + "'");
  }
  if (kind == Kind::IndexReduce && c.reduce != "prod" && c.reduce != "mean" && c.reduce != "amax" &&
      c.reduce != "amin") {
    fail(op, args,
         "index_reduce(): expected reduce to be one of prod, mean, amax or amin, got '" + c.reduce +
             "'");
  }
  const at::Tensor xl = local_of(c.self);
  if (is_written(op.schema().arguments()[0]) && at::GradMode::is_enabled() && xl.is_leaf() &&
      xl.requires_grad()) {
    fail(op, args, "a leaf ShardTensor that requires grad is being used in an in-place operation");
  }
}

/// Local. The message for ids of `ids` outside [0, n), "" when none.
std::string range_error(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                        const at::Tensor& ids, int64_t n) {
  if (ids.numel() == 0) return "";
  const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
  if (lo >= 0 && hi < n) return "";
  return "index out of range: this rank's index piece holds ids in [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "] but dim has " + std::to_string(n) + " rows, in " +
         describe_call(op, args);
}

/// Which extended rows receive at least one entry, as this rank's owned rows
/// along dim 0 of a tensor of `ndim` dims (bool, broadcastable). Collective
/// over the plan's mesh dim, no gradient.
at::Tensor hit_rows(const IndexPlan& ip, int64_t ndim) {
  at::NoGradGuard no_grad;
  at::Tensor cnt = at::zeros({ip.plan.num_extended()}, ip.rows.options().dtype(at::kLong));
  cnt.index_add_(0, ip.rows.reshape({-1}), at::ones({ip.rows.numel()}, cnt.options()));
  std::vector<int64_t> shape(ndim, 1);
  shape[0] = ip.plan.num_owned();
  return ghost_accumulate_nograd(cnt, ip.plan, ReduceOp::Sum).gt(0).view(shape);
}

/// Which elements of the owned rows `xm` (dim 0 first) receive at least one
/// entry of a gather-style index (bool, xm's shape). Collective over the
/// plan's mesh dim, no gradient.
at::Tensor hit_elements(const at::Tensor& xm, const IndexPlan& ip) {
  at::NoGradGuard no_grad;
  const at::Tensor ones = at::ones(ip.rows.sizes(), xm.options().dtype(at::kLong));
  at::Tensor ext =
      at::zeros(extended_shape(xm, ip.plan), ones.options()).scatter_add_(0, ip.rows, ones);
  return ghost_accumulate_nograd(ext, ip.plan, ReduceOp::Sum).gt(0);
}

/// The ghost path of Note [index ops along any dim]: this rank's result
/// piece, laid out as L.out_spec.
at::Tensor ghost_path(Kind kind, const c10::OperatorHandle& op,
                      const std::vector<c10::IValue>& args, const Call& c, const Layout& L,
                      const at::Tensor& xl) {
  const int64_t d = L.d;
  const at::Tensor xm = xl.movedim(d, 0);
  if (kind == Kind::IndexFill && is_replicated_operand(c.index)) {
    // Every rank holds the whole index: fill the ids it owns, no communication.
    const at::Tensor full = local_of(c.index);
    const std::string err = range_error(op, args, full, L.xs->global_shape()[d]);
    if (!err.empty()) fail(op, args, err);  // the same data, hence the same verdict, everywhere
    const int64_t off = L.xs->local_offsets()[d], n = xl.size(d);
    const at::Tensor mine = full.ge(off).logical_and(full.lt(off + n));
    return xl.index_fill(d, full.masked_select(mine) - off, c.alpha);
  }
  const at::Tensor il = index_piece(c.index, *L.index_spec);
  const at::Tensor im = one_d(kind) ? il : il.movedim(d, 0);
  std::vector<int64_t> extra = L.index_spec->local_offsets();
  for (int64_t v : L.index_spec->local_shape()) extra.push_back(v);
  extra.push_back(d);
  extra.push_back(one_d(kind) ? 1 : 0);
  const IndexPlan ip =
      index_plan(op, args, L.mesh, L.m, L.xs->shard_sizes(L.m), im, local_of(c.index), extra);
  // Communication of data starts here.
  if (kind == Kind::IndexSelect || kind == Kind::Gather) {
    const at::Tensor ext = ghost_exchange(xm, ip.plan);
    at::Tensor out =
        kind == Kind::IndexSelect ? ext.index_select(0, ip.rows) : ext.gather(0, ip.rows);
    return out.movedim(0, d);
  }
  if (kind == Kind::IndexFill) return xm.masked_fill(hit_rows(ip, xm.dim()), c.alpha).movedim(0, d);
  if (kind == Kind::ScatterValue) {
    return xm.masked_fill(hit_elements(xm, ip), c.alpha).movedim(0, d);
  }
  const at::Tensor sm = to_layout(c.src, *L.src_spec, *L.out_spec).movedim(d, 0);
  if (kind == Kind::IndexReduce) {
    // Each entry's row of src reduces into its row: scatter_reduce with the
    // row ids broadcast over the rest of the row (Note [legacy scatter
    // reductions and index_reduce]).
    std::vector<int64_t> view(sm.dim(), 1);
    view[0] = -1;
    const IndexPlan rows{ip.plan, ip.rows.view(view).expand(sm.sizes()).contiguous()};
    return reduce_rows(Kind::ScatterReduce, c, xm, sm, rows).movedim(0, d);
  }
  if (kind == Kind::IndexCopy) {
    at::Tensor ext =
        at::zeros(extended_shape(xm, ip.plan), xm.options()).index_copy(0, ip.rows, sm);
    return at::where(hit_rows(ip, xm.dim()), ghost_accumulate(ext, ip.plan), xm).movedim(0, d);
  }
  if (kind == Kind::Scatter) {
    at::Tensor ext = at::zeros(extended_shape(xm, ip.plan), xm.options()).scatter(0, ip.rows, sm);
    return at::where(hit_elements(xm, ip), ghost_accumulate(ext, ip.plan), xm).movedim(0, d);
  }
  return reduce_rows(kind, c, xm, sm, ip).movedim(0, d);
}

/// The local path of Note [index ops along any dim].
at::Tensor local_path(Kind kind, const c10::OperatorHandle& op,
                      const std::vector<c10::IValue>& args, const Call& c, const Layout& L,
                      const at::Tensor& xl) {
  const int64_t d = L.d;
  const at::Tensor il = index_piece(c.index, *L.index_spec);
  const std::string err = range_error(op, args, il, L.xs->global_shape()[d]);
  if (L.index_spec->is_replicated()) {
    if (!err.empty()) fail(op, args, err);  // the whole index on every rank: the same verdict
  } else {
    comm::check_all(L.mesh, err.empty(), "shardtensor: " + c10::toString(op.operator_name()), err);
  }
  const at::Tensor sl = c.src.defined() ? to_layout(c.src, *L.src_spec, *L.out_spec) : at::Tensor();
  switch (kind) {
    case Kind::IndexSelect:
      return xl.index_select(d, il);
    case Kind::Gather:
      return xl.gather(d, il);
    case Kind::IndexAdd:
      return xl.index_add(d, il, sl, c.alpha);
    case Kind::ScatterAdd:
      return xl.scatter_add(d, il, sl);
    case Kind::ScatterReduce:
      return xl.scatter_reduce(d, il, sl, c.reduce, c.include_self);
    case Kind::IndexCopy:
      return xl.index_copy(d, il, sl);
    case Kind::IndexFill:
      return xl.index_fill(d, il, c.alpha);
    case Kind::Scatter:
      return xl.scatter(d, il, sl);
    case Kind::ScatterValue:
      return xl.scatter(d, il, c.alpha);
    case Kind::IndexReduce:
      return xl.index_reduce(d, il, sl, c.reduce, c.include_self);
  }
  return {};
}

/// The rules of Note [index ops along any dim] on the arguments `as` of
/// `kind` in schema order; `args` are the call's own (messages, results).
void index_run(Kind kind, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
               const std::vector<c10::IValue>& as, Stack* stack) {
  const std::optional<Layout> L = analyse(kind, as);
  TORCH_INTERNAL_ASSERT(L.has_value(), "shardtensor: ", kind_name(kind),
                        " rule called for a call it does not take");
  const Call c = parse(kind, as);
  check_call(kind, op, args, c, *L);
  // Self's piece; where the result is sharded along a mesh dim on which self
  // is Replicate, self's gradient is summed over it (to_layout).
  const at::Tensor xl = to_layout(c.self, *L->xs, *L->out_spec);
  at::Tensor out =
      L->m >= 0 ? ghost_path(kind, op, args, c, *L, xl) : local_path(kind, op, args, c, *L, xl);
  if (is_written(op.schema().arguments()[0])) xl.copy_(out);
  Stack results{out};
  push_results(op, args, &results, L->out_spec, stack);
}

void index_rule(Kind kind, const c10::OperatorHandle& op, Stack* stack) {
  const auto args = pop_args(op, stack);
  index_run(kind, op, args, args, stack);
}

// Note [legacy scatter reductions and index_reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// scatter(self, dim, index, src, reduce) and scatter(self, dim, index,
// value, reduce) (and scatter_) take reduce "add" or "multiply": they are
// scatter_add(self, dim, index, src) and scatter_reduce(self, dim, index,
// src, "prod", include_self=true), the value form with src a tensor shaped
// and laid out like the index, filled with the value in self's dtype. They
// run as those rules (Note [index ops along any dim]), in the same layouts,
// and take the calls those rules take. libtorch defines no derivative for
// these two overloads (1.13 and 2.13: a backward through scatter or scatter_
// with reduce raises "derivative for aten::scatter is not implemented"); here
// the gradients are those of scatter_add and scatter_reduce.
// index_reduce(self, dim, index, source, reduce, include_self) ("prod",
// "mean", "amax", "amin") is a 1-D index of entries along dim, like
// index_add: along an unsharded dim it is libtorch's op on the local pieces;
// along a sharded dim each entry's row of source goes to the row's owner as
// in index_add, and the reduction is scatter_reduce's (Note [graph op
// rules]) with the entry's row id broadcast over the rest of its row. That
// is index_reduce's value, and libtorch's index_reduce backward formula is
// scatter_reduce's with the same broadcast index (ties split evenly among
// self and the maximal entries for amax/amin; zeros masked for prod), so
// gradients equal libtorch's.

/// The scatter_add / scatter_reduce.two arguments of a legacy scatter
/// reduction (value: the value overload), or nullopt when `a` are not
/// tensors where they must be. With `fill` the value form's src is built
/// (a local op); without it the index stands in for it (its shape and layout
/// are src's: enough for analyse()).
std::optional<std::pair<Kind, std::vector<c10::IValue>>> legacy_args(
    const std::vector<c10::IValue>& a, bool value, bool fill) {
  if (!a[0].isTensor() || !a[2].isTensor() || !a[4].isString()) return std::nullopt;
  if (value ? !a[3].isScalar() : !a[3].isTensor()) return std::nullopt;
  at::Tensor src;
  if (!value) {
    src = a[3].toTensor();
  } else if (!fill) {
    src = a[2].toTensor();
  } else {
    const at::Tensor self = a[0].toTensor(), index = a[2].toTensor();
    const auto opts = at::TensorOptions().dtype(self.scalar_type());
    src = spec_of(index) != nullptr ? at::full_like(index, a[3].toScalar(), opts)
                                    : at::full(index.sizes(), a[3].toScalar(), opts);
  }
  const std::string& reduce = a[4].toStringRef();
  if (reduce == "multiply") {
    return std::make_pair(Kind::ScatterReduce,
                          std::vector<c10::IValue>{a[0], a[1], a[2], src, "prod", true});
  }
  return std::make_pair(Kind::ScatterAdd, std::vector<c10::IValue>{a[0], a[1], a[2], src});
}

bool legacy_takes(bool value, const c10::OperatorHandle& op, const Stack& stack) {
  const auto t = legacy_args(peek_args(op, stack), value, false);
  return t && analyse(t->first, t->second).has_value();
}

void legacy_rule(bool value, const c10::OperatorHandle& op, Stack* stack) {
  const auto args = pop_args(op, stack);
  const std::string& reduce = args[4].toStringRef();
  if (reduce != "add" && reduce != "multiply") {
    fail(op, args, "reduce argument must be either add or multiply, got '" + reduce + "'");
  }
  const auto t = legacy_args(args, value, true);
  index_run(t->first, op, args, t->second, stack);
}

Rule rule_for(Kind k) {
  return [k](const c10::OperatorHandle& op, Stack* stack) { index_rule(k, op, stack); };
}
Accepts takes_for(Kind k) {
  return [k](const c10::OperatorHandle& op, const Stack& stack) { return takes(k, op, stack); };
}

// "name." is the overload without a name only (ops/registry.h): the out= and
// Dimname overloads keep their handling.
const RuleRegistrar r_index_select({"index_select."}, rule_for(Kind::IndexSelect),
                                   takes_for(Kind::IndexSelect));
const RuleRegistrar r_gather({"gather."}, rule_for(Kind::Gather), takes_for(Kind::Gather));
const RuleRegistrar r_index_add({"index_add.", "index_add_."}, rule_for(Kind::IndexAdd),
                                takes_for(Kind::IndexAdd));
const RuleRegistrar r_scatter_add({"scatter_add.", "scatter_add_."}, rule_for(Kind::ScatterAdd),
                                  takes_for(Kind::ScatterAdd));
const RuleRegistrar r_scatter_reduce({"scatter_reduce.two", "scatter_reduce_.two"},
                                     rule_for(Kind::ScatterReduce), takes_for(Kind::ScatterReduce));
const RuleRegistrar r_index_copy({"index_copy.", "index_copy_."}, rule_for(Kind::IndexCopy),
                                 takes_for(Kind::IndexCopy));
const RuleRegistrar r_scatter({"scatter.src", "scatter_.src"}, rule_for(Kind::Scatter),
                              takes_for(Kind::Scatter));
const RuleRegistrar r_scatter_value({"scatter.value", "scatter_.value"},
                                    rule_for(Kind::ScatterValue), takes_for(Kind::ScatterValue));
const RuleRegistrar r_index_fill({"index_fill.int_Scalar", "index_fill_.int_Scalar"},
                                 rule_for(Kind::IndexFill), takes_for(Kind::IndexFill));
const RuleRegistrar r_index_reduce({"index_reduce.", "index_reduce_."}, rule_for(Kind::IndexReduce),
                                   takes_for(Kind::IndexReduce));
const RuleRegistrar r_scatter_legacy(
    {"scatter.reduce", "scatter_.reduce"},
    [](const c10::OperatorHandle& op, Stack* stack) { legacy_rule(false, op, stack); },
    [](const c10::OperatorHandle& op, const Stack& stack) {
      return legacy_takes(false, op, stack);
    });
const RuleRegistrar r_scatter_value_legacy(
    {"scatter.value_reduce", "scatter_.value_reduce"},
    [](const c10::OperatorHandle& op, Stack* stack) { legacy_rule(true, op, stack); },
    [](const c10::OperatorHandle& op, const Stack& stack) {
      return legacy_takes(true, op, stack);
    });

}  // namespace

bool index_rule_takes(const std::string& name, const std::vector<c10::IValue>& args) {
  if (name == "index_select") return analyse(Kind::IndexSelect, args).has_value();
  if (name == "index_add") return analyse(Kind::IndexAdd, args).has_value();
  if (name == "index_copy") return analyse(Kind::IndexCopy, args).has_value();
  return false;
}

at::Tensor select_along(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                        const at::Tensor& local, const ShardSpec& spec, int64_t d,
                        const at::Tensor& ids) {
  const int64_t m = spec.mesh_dim_of(d);
  TORCH_INTERNAL_ASSERT(m >= 0, "select_along: dim ", d, " is not sharded in ", spec.to_string());
  const IndexPlan ip =
      index_plan(op, args, spec.mesh(), m, spec.shard_sizes(m), ids, at::Tensor(), {});
  return ghost_exchange(local.movedim(d, 0), ip.plan).index_select(0, ip.rows).movedim(0, d);
}

IndexPlanCacheStats index_plan_cache_stats() {
  auto& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  IndexPlanCacheStats s;
  s.builds = c.builds;
  s.reuses = c.reuses;
  s.entries = c.entries.size();
  return s;
}

void clear_index_plan_cache() {
  auto& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.entries.clear();
  c.builds = 0;
  c.reuses = 0;
}

}  // namespace shardtensor::ops
