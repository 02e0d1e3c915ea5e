// Message passing as users write it: index_select / gather of node rows by
// edge endpoints, and index_add / scatter_add / scatter_reduce back into the
// nodes, on row-sharded nodes and edges, through GhostPlans
// (Note [graph op rules], Note [index plan cache]).
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
//    ghost_accumulate_nograd). The gradient is libtorch 1.13's
//    scatter_reduce_backward formula evaluated on the global values (the
//    result is exchanged back to the edges' ranks to find the maximal
//    messages, ties split evenly; the tie count N includes a self equal to
//    the result even when include_self=false, exactly as libtorch does), in
//    the hand-written ScatterCombineFn: its coefficients are computed in
//    forward and its backward is one ghost_exchange of the scaled gradient.
//    Under create_graph its backward is built from differentiable pieces; it
//    is exact for amax/amin (constant coefficients, as libtorch's) and throws
//    for prod (whose coefficients depend on the inputs).
// A call outside this layout (an index that is a plain tensor or replicated,
// dim != 0, nodes sharded along another dim or with a Partial placement, a
// plain src, sparse_grad, a float16/bfloat16 or complex reduction) is not
// taken (Note [partial rules]) and runs as before: through the generic
// fallback, on gathered tensors, exactly. A bad call (an id outside [0, N) on
// any rank, src rows sharded unlike the index's, shapes or dtypes libtorch
// refuses) throws a c10::Error naming the op, the shapes and the placements
// on every rank, before any data moves.
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

enum class Kind { IndexSelect, Gather, IndexAdd, ScatterAdd, ScatterReduce };

bool is_reduction(Kind k) {
  return k == Kind::IndexAdd || k == Kind::ScatterAdd || k == Kind::ScatterReduce;
}

/// The mesh dim m when `s` is Shard(0) along exactly m and Replicate on every
/// other mesh dim; -1 otherwise. Metadata only: the same on every rank.
int64_t row_mesh_dim(const ShardSpec& s) {
  int64_t m = -1;
  for (int64_t d = 0; d < s.mesh().ndim(); ++d) {
    const auto& pl = s.placements()[d];
    if (is_shard(pl)) {
      if (shard_dim(pl) != 0 || m >= 0) return -1;
      m = d;
    } else if (!is_replicate(pl)) {
      return -1;
    }
  }
  return m;
}

std::vector<c10::IValue> peek_args(const c10::OperatorHandle& op, const Stack& stack) {
  const size_t n = op.schema().arguments().size();
  return std::vector<c10::IValue>(stack.end() - n, stack.end());
}

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
// plan only if every rank reuses the plan of the *same* build. Each call
// therefore does one small all-reduce (max) of five integers over the mesh:
// an error flag (an id outside [0, N): then check_all raises the failing
// rank's message on every rank), a miss flag, the entry's build stamp and its
// negation (max and -min: all equal), and the stamp a new build would take.
// Stamps are per-process counters made equal by that max at each build; a
// later build of the same mesh gets a larger stamp on every rank, so two
// different builds never agree. Unless every rank hit an entry with one
// stamp, every rank rebuilds (collectively) and replaces its entry.

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
              const std::vector<int64_t>& node_sizes) {
  return !e.dead() && e.raw == idx.unsafeGetTensorImpl() && e.version == idx._version() &&
         e.data == idx.data_ptr() && e.numel == idx.numel() && e.shape == idx.sizes().vec() &&
         e.strides == idx.strides().vec() && e.dtype == idx.scalar_type() && e.mesh_dim == m &&
         e.node_sizes == node_sizes && e.mesh == mesh;
}

struct IndexPlan {
  GhostPlan plan;
  at::Tensor rows;
};

/// Collective over every rank of `mesh` (one all-reduce; a build when any
/// rank misses). The plan of the ids in `idx` (this rank's index piece) over
/// mesh dim `m` with nodes `node_sizes`, and `idx` mapped to extended rows.
/// Throws on every rank, naming the call, if any rank holds an id outside
/// [0, N).
IndexPlan index_plan(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     const DeviceMesh& mesh, int64_t m, const std::vector<int64_t>& node_sizes,
                     const at::Tensor& idx) {
  auto& c = plan_cache();
  const bool cacheable = !idx.is_inference();
  std::optional<IndexPlan> found;
  int64_t found_stamp = 0, next_stamp = 0;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.entries.remove_if([](const Entry& e) { return e.dead(); });
    if (cacheable) {
      for (auto it = c.entries.begin(); it != c.entries.end(); ++it) {
        if (!same_key(*it, idx, mesh, m, node_sizes)) continue;
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
  std::vector<int64_t> v = {ok ? 0 : 1, found ? 0 : 1, found ? found_stamp : -1,
                            found ? -found_stamp : 1, next_stamp};
  comm::all_reduce_max(mesh, v);
  if (v[0] != 0) {
    comm::check_all(mesh, ok, "shardtensor: " + c10::toString(op.operator_name()), msg);
  }
  if (v[1] == 0 && v[2] == -v[3]) {
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
  c.stamp = v[4];
  if (cacheable) {
    c.entries.remove_if([&](const Entry& e) { return same_key(e, idx, mesh, m, node_sizes); });
    Entry e;
    e.impl = Entry::WeakImpl(idx.getIntrusivePtr());
    e.raw = idx.unsafeGetTensorImpl();
    e.version = idx._version();
    e.data = idx.data_ptr();
    e.numel = idx.numel();
    e.shape = idx.sizes().vec();
    e.strides = idx.strides().vec();
    e.dtype = idx.scalar_type();
    e.mesh = mesh;
    e.mesh_dim = m;
    e.node_sizes = node_sizes;
    e.stamp = v[4];
    e.plan = out.plan;
    e.rows = out.rows;
    c.entries.push_front(std::move(e));
    while (c.entries.size() > kMaxIndexPlans) c.entries.pop_back();
  }
  return out;
}

// ---- amax / amin / prod --------------------------------------------------------------

struct CombineArgs {
  GhostPlan plan;
  at::Tensor rows;     // the index mapped to extended rows
  at::Tensor indexed;  // owned elements that receive a contribution (bool); with !include_self
  std::string reduce;  // "amax", "amin", "prod"
  bool include_self = true;
};

at::Scalar identity_of(const std::string& reduce, at::ScalarType t) {
  if (reduce == "prod") return 1;
  const bool max = reduce == "amax";
  if (at::isFloatingType(t)) {
    const double inf = std::numeric_limits<double>::infinity();
    return max ? -inf : inf;
  }
  at::Scalar s;
  AT_DISPATCH_INTEGRAL_TYPES(t, "scatter_reduce identity", [&] {
    s = max ? std::numeric_limits<scalar_t>::lowest() : std::numeric_limits<scalar_t>::max();
  });
  return s;
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

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
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

struct Call {
  at::Tensor self, index, src;
  std::string reduce = "sum";
  bool include_self = true;
  c10::Scalar alpha = 1;
};

Call parse(Kind kind, const std::vector<c10::IValue>& a) {
  Call c;
  c.self = a[0].toTensor();
  c.index = a[2].toTensor();
  if (is_reduction(kind)) c.src = a[3].toTensor();
  if (kind == Kind::IndexAdd) c.alpha = a[4].toScalar();
  if (kind == Kind::ScatterReduce) {
    c.reduce = a[4].toStringRef();
    c.include_self = a[5].toBool();
  }
  return c;
}

/// Note [partial rules]: the layouts of Note [graph op rules]; everything
/// else keeps the generic fallback.
bool takes(Kind kind, const c10::OperatorHandle& op, const Stack& stack) {
  const auto a = peek_args(op, stack);
  if (!a[0].isTensor() || !a[1].isInt() || !a[2].isTensor()) return false;
  const ShardSpec* xs = spec_of(a[0].toTensor());
  const ShardSpec* is = spec_of(a[2].toTensor());
  if (xs == nullptr || is == nullptr || xs->mesh() != is->mesh()) return false;
  const int64_t m = row_mesh_dim(*xs);
  if (m < 0 || row_mesh_dim(*is) != m) return false;
  const int64_t d = a[1].toInt();
  if (d != 0 && d != -xs->ndim()) return false;
  if (kind == Kind::Gather && a[3].toBool()) return false;  // sparse_grad
  const at::ScalarType t = a[0].toTensor().scalar_type();
  if (!is_reduction(kind)) return !at::isComplexType(t);
  if (!a[3].isTensor()) return false;
  const ShardSpec* ss = spec_of(a[3].toTensor());
  if (ss == nullptr || ss->mesh() != xs->mesh()) return false;
  return t == at::kFloat || t == at::kDouble || at::isIntegralType(t, /*includeBool=*/false);
}

/// Metadata checks (the same verdict on every rank, before any communication).
void check_call(Kind kind, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                const Call& c, int64_t m) {
  const ShardSpec& xs = *spec_of(c.self);
  const ShardSpec& is = *spec_of(c.index);
  const int64_t nd = xs.ndim();
  const auto& xshape = xs.global_shape();
  const auto& ishape = is.global_shape();
  const at::ScalarType it = c.index.scalar_type();
  const std::string dims = std::to_string(nd);
  if (kind == Kind::IndexSelect || kind == Kind::IndexAdd) {
    if (it != at::kLong && it != at::kInt) {
      fail(op, args,
           std::string("index must be an int64 or int32 tensor, got ") + c10::toString(it));
    }
    if (is.ndim() != 1) fail(op, args, "index must be 1-D");
  } else {
    if (it != at::kLong) {
      fail(op, args, std::string("index must be an int64 tensor, got ") + c10::toString(it));
    }
    if (is.ndim() != nd) fail(op, args, "index must have as many dims as self (" + dims + ")");
  }
  if (kind == Kind::Gather) {
    for (int64_t d = 1; d < nd; ++d) {
      if (ishape[d] > xshape[d]) {
        fail(op, args,
             "index.size(" + std::to_string(d) + ") must be <= self.size(" + std::to_string(d) +
                 ")");
      }
    }
  }
  if (!is_reduction(kind)) return;
  const ShardSpec& ss = *spec_of(c.src);
  const auto& sshape = ss.global_shape();
  if (c.src.scalar_type() != c.self.scalar_type()) {
    fail(op, args,
         std::string("self and src must have the same dtype, got ") +
             c10::toString(c.self.scalar_type()) + " and " + c10::toString(c.src.scalar_type()));
  }
  if (ss.placements() != is.placements() || sshape[0] != ishape[0] ||
      ss.shard_sizes(m) != is.shard_sizes(m)) {
    fail(op, args,
         "the rows of src must be sharded like the rows of index (the same placements, global "
         "rows and sizes along mesh dim " +
             std::to_string(m) + "), got src " + ss.to_string() + " and index " + is.to_string());
  }
  if (ss.ndim() != nd) fail(op, args, "src must have as many dims as self (" + dims + ")");
  for (int64_t d = 1; d < nd; ++d) {
    const std::string ds = std::to_string(d);
    if (kind == Kind::IndexAdd && sshape[d] != xshape[d]) {
      fail(op, args, "source.size(" + ds + ") must equal self.size(" + ds + ")");
    }
    if (kind != Kind::IndexAdd && (ishape[d] > sshape[d] || ishape[d] > xshape[d])) {
      fail(op, args,
           "index.size(" + ds + ") must be <= src.size(" + ds + ") and <= self.size(" + ds + ")");
    }
  }
  if (kind == Kind::ScatterReduce && c.reduce != "sum" && c.reduce != "mean" &&
      c.reduce != "amax" && c.reduce != "amin" && c.reduce != "prod") {
    fail(op, args, "reduce must be one of sum, prod, mean, amax, amin, got '" + c.reduce + "'");
  }
  const at::Tensor xl = local_of(c.self);
  if (is_written(op.schema().arguments()[0]) && at::GradMode::is_enabled() && xl.is_leaf() &&
      xl.requires_grad()) {
    fail(op, args, "a leaf ShardTensor that requires grad is being used in an in-place operation");
  }
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

void graph_rule(Kind kind, const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const Call c = parse(kind, args);
  const ShardSpec& xs = *spec_of(c.self);
  const ShardSpec& is = *spec_of(c.index);
  const DeviceMesh& mesh = xs.mesh();
  const int64_t m = row_mesh_dim(xs);
  check_call(kind, op, args, c, m);
  // Communication starts here.
  const at::Tensor xl = local_of(c.self);
  const IndexPlan ip = index_plan(op, args, mesh, m, xs.shard_sizes(m), local_of(c.index));
  if (!is_reduction(kind)) {
    at::Tensor ext = ghost_exchange(xl, ip.plan);
    std::vector<int64_t> shape = is.global_shape();
    at::Tensor out;
    if (kind == Kind::IndexSelect) {
      out = ext.index_select(0, ip.rows);
      shape = xs.global_shape();
      shape[0] = is.global_shape()[0];
    } else {
      out = ext.gather(0, ip.rows);
    }
    stack->push_back(wrap(out, make_spec(mesh, is.placements(), shape, is.all_shard_sizes())));
    return;
  }
  at::Tensor out = reduce_rows(kind, c, xl, local_of(c.src), ip);
  if (is_written(op.schema().arguments()[0])) xl.copy_(out);
  Stack results{out};
  push_results(op, args, &results, spec_ptr_of(c.self), stack);
}

Rule rule_for(Kind k) {
  return [k](const c10::OperatorHandle& op, Stack* stack) { graph_rule(k, op, stack); };
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

}  // namespace

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
