// fully_shard: parameters, gradients and optimizer state sharded over one mesh
// dim (FSDP / ZeRO-3), activations sharded over the others (Note [fully_shard]).
#include <c10/util/StringUtil.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/nn/fully_shard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "comm/agree.h"
#include "comm/async_reduce.h"
#include "comm/grad_sink.h"
#include "comm/settings.h"
#include "nn/fully_shard_stats.h"
#include "nn/module_support.h"

// Note [fully_shard]
// ~~~~~~~~~~~~~~~~~~
// A unit is one module's parameters (those not in an inner unit), flattened
// in registration order into one buffer of N elements, padded with zeros to
// a multiple of D (the data dim's size). Rank at data coordinate c keeps
// elements [c S, (c + 1) S) (S = padded / D) in `shard_`, a leaf that the
// optimizer steps; Adam's state is then 1/D per rank as well.
//
// The module's own parameter tensors stay what the module's code reads, with
// their shapes, but their storage is the unit's flat buffer `full_`
// (set_data once, at fully_shard). Freeing the unit (reshard) releases that
// storage's bytes (the StorageImpl keeps 0 bytes); gathering (unshard)
// allocates them again and all-gathers the shards into them. Because
// autograd saves a leaf parameter (and use_replicated's alias of it) by
// reference to that same storage, the backward sees whatever the storage
// holds when it runs, so a unit freed after its forward is gathered again
// before its backward and nothing is copied by autograd.
//
// When, without forward hooks in libtorch:
//  - gather: every use of a parameter in sharded compute goes through
//    comm::use_replicated(), which first calls the unit's before_use() (the
//    gradient-sink seam, comm/grad_sink.h). A unit used for the first time
//    in a forward is gathered there (collective over the data dim: every
//    rank runs the same ops in the same order), and the unit used before it
//    is freed (reshard_after_forward, ZeRO-3; never a root unit, which
//    contains the others and whose parameters are typically used again at
//    the end of forward). The order of units is recorded.
//  - gather for backward: the first partial gradient of unit V arriving in
//    backward (its first use's backward ran, so V's backward has begun)
//    gathers the unit recorded just before V in forward. Autograd's engine
//    runs a ready node with a higher sequence number first, and V's
//    use_replicated nodes were made after every node of the units before
//    it, so this runs before their backward when the units form a chain
//    (each unit's output feeds the next, as in U-Nets and stacks of blocks).
//  - reduce: a post hook on each parameter's gradient accumulator (as in
//    Note [gradient buckets]) marks it done; when all of a unit's parameters
//    are done the unit is reduced and freed, strictly in the reverse of the
//    forward order (then the units not seen in forward, in registration
//    order), so every rank runs the same collectives in the same order;
//    whatever is left is reduced in an end-of-backward callback.
//
// Gradients keep distribute_module's meaning (Note [gradient buckets]):
// partial gradients of sharded uses arrive through the sink, one flat
// buffer per set of mesh dims M the uses ran over; each buffer is
// reduce-scattered over the data dim (when it is in M; else this rank's
// slice is taken) and the slice all-reduced over M minus the data dim.
// Contributions through plain compute reach the parameter's grad() through
// autograd, are already whole, and add only their slice. The shard's grad()
// is then this rank's slice of the single-process gradient, and the
// parameters' own grad() stays undefined.
//
// Note [fully_shard prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Communication is started early and finished where its result is needed,
// as FSDP2 does with streams (here the transport's split-phase collectives,
// comm/async_reduce.h; Gloo moves the bytes in its own threads, MPI inside
// the MPI calls that the compute in between makes):
//  - forward: when unit V starts (its gather above), the gather of the unit
//    that followed V in the last forward that had a backward (`last_order`)
//    starts too (also without grad mode: evaluation gathers the same way).
//    An order that changed only wastes the early gather (it is finished and
//    dropped when its unit is used or freed).
//  - backward: V's first gradient starts the gather of V's forward
//    predecessor U instead of waiting for it. It is finished when V has
//    received all its gradients (every accumulator of V ran): in a chain,
//    V's nodes all come after U's in forward, so autograd runs them, and
//    the accumulators (which it runs first of all ready nodes), before any
//    node of U's backward. A use of U's parameters through before_use()
//    finishes it too.
//  - A started gather receives into a buffer of its own, which becomes the
//    storage's bytes only when it is finished; until then the storage has
//    none, so a read that comes too early throws libtorch's "not
//    allocated", never reads stale bytes. It sends a copy of the shard and
//    notes the shard's version: if an optimizer step changed the shard
//    before the gather is finished, the result is dropped and the unit is
//    gathered again (every rank stepped alike, so all decide alike).
//  - reduce: a unit's gradient reduce-scatter is started as soon as its
//    last accumulator ran (in the strict order above) and finished when the
//    next unit's reduction starts, or at the end of backward; the sum over
//    the domain dims and the plain-use slices are added then, in the same
//    order as before, so the result is the blocking one bit for bit. At
//    most one unit's gradient buffer is thus in flight beyond the shards.

namespace shardtensor {

namespace autograd = torch::autograd;

namespace detail {

class FullyShardUnit;

namespace {

/// The process-wide record of units in forward order and of the running
/// backward (one autograd engine per process).
struct Context {
  std::mutex mutex;
  std::vector<std::weak_ptr<FullyShardUnit>> live;           // registration order
  std::vector<std::weak_ptr<FullyShardUnit>> forward_order;  // non-root units, by first use
  std::vector<std::weak_ptr<FullyShardUnit>> last_order;     // forward_order of the last backward
  size_t cursor = 0;                                         // where last_order matched last
  std::shared_ptr<FullyShardUnit> reducing;                  // reduction in flight (prefetch note)
  std::vector<std::shared_ptr<FullyShardUnit>> plan;         // reduction order of this backward
  size_t next = 0;                                           // next unit of `plan` to reduce
  bool in_backward = false;
};
Context& context() {
  static auto* c = new Context();  // never destroyed (hooks may run at exit)
  return *c;
}

FullyShardOverlapStats& overlap_stats() {
  static FullyShardOverlapStats s;
  return s;
}

std::unordered_map<const at::TensorImpl*, std::weak_ptr<FullyShardUnit>>& param_units() {
  static auto* m = new std::unordered_map<const at::TensorImpl*, std::weak_ptr<FullyShardUnit>>();
  return *m;
}

}  // namespace

class FullyShardUnit : public comm::detail::ReplicatedGradSink,
                       public std::enable_shared_from_this<FullyShardUnit> {
 public:
  struct Param {
    std::string name;
    at::Tensor var;
    int64_t offset = 0;
    int64_t numel = 0;
    decltype(autograd::Edge::function) accumulator;
    bool ready = false;
  };

  FullyShardUnit(const std::vector<std::pair<std::string, at::Tensor>>& params,
                 const DeviceMesh& mesh, int64_t dim, bool reshard_after_forward, bool is_root)
      : mesh_(mesh),
        dim_(dim),
        d_(mesh.size(dim)),
        me_(mesh.coordinate()[dim]),
        reshard_after_forward_(reshard_after_forward),
        is_root_(is_root) {
    at::TensorOptions opts = at::TensorOptions().dtype(at::kFloat);
    for (const auto& [name, t] : params) {
      Param p;
      p.name = name;
      p.var = t;
      p.offset = numel_;
      p.numel = t.numel();
      numel_ += p.numel;
      opts = t.options();
      params_.push_back(std::move(p));
    }
    shard_numel_ = (numel_ + d_ - 1) / d_;
    padded_ = shard_numel_ * d_;
    sizes_.assign(static_cast<size_t>(d_), shard_numel_);
    opts_ = opts.requires_grad(false);
    label_ = "fully_shard unit (" + std::to_string(params_.size()) + " parameters, " +
             std::to_string(numel_) + " elements)";
    torch::NoGradGuard no_grad;
    full_ = at::zeros({padded_}, opts_);
    for (auto& p : params_) {
      full_.narrow(0, p.offset, p.numel).copy_(p.var.detach().reshape({-1}));
    }
    shard_ = full_.narrow(0, me_ * shard_numel_, shard_numel_).clone().requires_grad_(true);
    for (auto& p : params_) {
      // The parameter's storage becomes the flat buffer's (Note [fully_shard]).
      p.var.set_data(full_.narrow(0, p.offset, p.numel).view(p.var.sizes()));
      index_[p.var.unsafeGetTensorImpl()] = &p - params_.data();
    }
    gathered_ = true;
    release();
  }

  /// Hooks the accumulators and registers the parameters as sink targets.
  void install() {
    std::weak_ptr<FullyShardUnit> self = weak_from_this();
    for (auto& p : params_) {
      p.accumulator = autograd::impl::grad_accumulator(p.var);
      TORCH_INTERNAL_ASSERT(p.accumulator, "fully_shard: no gradient accumulator");
      p.accumulator->add_post_hook(std::make_unique<ReadyHook>(self, p.var.unsafeGetTensorImpl()));
      comm::detail::set_grad_sink(p.var, mesh_, shared_from_this());
      param_units()[p.var.unsafeGetTensorImpl()] = self;
    }
    auto& ctx = context();
    std::lock_guard<std::mutex> lock(ctx.mutex);
    ctx.live.push_back(self);
  }

  // --- ReplicatedGradSink ---------------------------------------------------

  bool takes(int64_t /*mesh_ndim*/, const std::vector<int64_t>& /*mesh_dims*/) const override {
    return true;  // one buffer per set of mesh dims
  }

  bool wants_before_use() const override { return true; }

  void before_use(const at::TensorImpl* /*leaf*/) override {
    auto& ctx = context();
    if (ctx.in_backward) {
      unshard();
      return;
    }
    begin_forward();
  }

  void add_partial(const at::TensorImpl* leaf, const at::Tensor& grad,
                   const std::vector<int64_t>& mesh_dims) override {
    auto it = index_.find(leaf);
    TORCH_INTERNAL_ASSERT(it != index_.end(), "fully_shard: unknown parameter");
    const Param& p = params_[it->second];
    begin_backward();
    if (!backward_started_) {
      backward_started_ = true;
      gather_predecessor();
    }
    at::Tensor& buf = partial_[mesh_dims];
    if (!buf.defined()) buf = at::zeros({padded_}, opts_);
    torch::NoGradGuard no_grad;
    buf.narrow(0, p.offset, p.numel).add_(grad.reshape({-1}));
  }

  // --- gather and free -------------------------------------------------------

  void begin_forward() {
    unshard();
    if (is_root_) return;
    auto& ctx = context();
    std::shared_ptr<FullyShardUnit> prev;
    {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      if (!ctx.forward_order.empty()) {
        prev = ctx.forward_order.back().lock();
        if (prev.get() == this) return;  // still this unit's forward
      }
      if (at::GradMode::is_enabled()) {
        ctx.forward_order.push_back(weak_from_this());
      } else {
        // No backward follows: only the last unit is remembered.
        ctx.forward_order.assign(1, weak_from_this());
      }
    }
    if (prev && prev->reshard_after_forward_) prev->reshard();
    // Note [fully_shard prefetch]: the unit that came after this one last
    // time (looked up from where the last lookup matched, then from the
    // start, so that a forward without backward in between does not shift it).
    std::shared_ptr<FullyShardUnit> next;
    if (prefetch_on()) {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      const auto& o = ctx.last_order;
      auto find_from = [&](size_t from) {
        for (size_t j = from; j < o.size(); ++j)
          if (o[j].lock().get() == this) return j;
        return o.size();
      };
      size_t j = find_from(ctx.cursor);
      if (j == o.size()) j = find_from(0);
      if (j + 1 < o.size()) {
        next = o[j + 1].lock();
        ctx.cursor = j + 1;
      }
    }
    if (next && next.get() != this && next->start_unshard()) ++overlap_stats().forward_prefetches;
  }

  /// Starts gathering the unit without waiting (Note [fully_shard prefetch]);
  /// collective over the data dim. False when there is nothing to start.
  bool start_unshard() {
    if (gathered_ || gathering_ || d_ == 1) return false;
    const OpLabel label(label_.c_str());
    torch::NoGradGuard no_grad;
    outgoing_ = shard_.detach().clone();
    incoming_ = at::empty({padded_}, opts_);
    sent_from_ = shard_.unsafeGetTensorImpl();
    sent_version_ = shard_._version();
    gather_ = comm::start_all_gather_flat(outgoing_, incoming_, mesh_, dim_);
    gathering_ = true;
    return true;
  }

  /// Finishes a started gather; true when its result became the unit's.
  bool finish_started_gather() {
    if (!gathering_) return false;
    gathering_ = false;
    gather_.finish();
    at::Tensor in = std::move(incoming_);
    outgoing_ = at::Tensor();
    if (shard_.unsafeGetTensorImpl() != sent_from_ || shard_._version() != sent_version_) {
      ++overlap_stats().stale_prefetches;
      return false;
    }
    // The receive buffer's bytes become the storage's (no copy).
    c10::StorageImpl* s = storage();
    c10::StorageImpl* from = in.storage().unsafeGetStorageImpl();
    const size_t bytes = static_cast<size_t>(padded_) * full_.element_size();
    TORCH_INTERNAL_ASSERT(in.storage_offset() == 0 && from->nbytes() == bytes,
                          "fully_shard: a gather buffer of the wrong size");
    s->set_data_ptr_noswap(from->set_data_ptr(at::DataPtr(nullptr, full_.device())));
    s->set_nbytes(bytes);
    gathered_ = true;
    ++overlap_stats().prefetches_used;
    return true;
  }

  void unshard() {
    if (gathered_) return;
    const OpLabel label(label_.c_str());
    torch::NoGradGuard no_grad;
    if (finish_started_gather()) return;
    at::Tensor all = d_ == 1
                         ? shard_.detach()
                         : comm::all_gather(shard_.detach().contiguous(), mesh_, dim_, 0, sizes_);
    allocate();
    full_.copy_(all);
    gathered_ = true;
  }

  void reshard() {
    if (gathering_) {
      // Started for a use that did not come: finish it (every rank started
      // it) and drop it.
      gathering_ = false;
      gather_.finish();
      incoming_ = outgoing_ = at::Tensor();
    }
    if (!gathered_) return;
    release();
  }

  // --- backward ----------------------------------------------------------------

  void on_ready(const at::TensorImpl* leaf) {
    auto it = index_.find(leaf);
    if (it == index_.end()) return;
    begin_backward();
    Param& p = params_[it->second];
    if (p.ready) return;
    p.ready = true;
    if (!backward_started_) {
      backward_started_ = true;
      gather_predecessor();
    }
    if (++ready_ == params_.size()) {
      complete_ = true;
      // Note [fully_shard prefetch]: U's backward comes next.
      if (auto u = backward_prev_.lock(); u && !u->complete_) u->unshard();
      backward_prev_.reset();
    }
    reduce_ready_units();
  }

  /// Starts reducing this unit's gradients and frees the unit; finish_reduce()
  /// adds the result to shard_.grad() (Note [fully_shard prefetch]).
  void start_reduce() {
    const OpLabel label(label_.c_str());
    torch::NoGradGuard no_grad;
    TORCH_INTERNAL_ASSERT(reducing_.empty(), "fully_shard: a reduction is already in flight");
    for (auto& [dims, buf] : partial_) {
      InFlightReduction r;
      for (int64_t m : dims)
        if (m != dim_) r.rest.push_back(m);
      const bool over_data = d_ > 1 && std::find(dims.begin(), dims.end(), dim_) != dims.end();
      if (over_data) {
        r.out = at::empty({shard_numel_}, opts_);
        r.op = comm::start_reduce_scatter_flat(buf, r.out, mesh_, dim_);
        r.started = true;
        ++overlap_stats().reductions_started;
      } else {
        r.out = buf.narrow(0, me_ * shard_numel_, shard_numel_).contiguous();
      }
      reducing_.push_back(std::move(r));
    }
    reduce_any_ = !partial_.empty();
    partial_.clear();  // the buffers in flight are kept by their operations
    plain_ = at::Tensor();
    const int64_t lo = me_ * shard_numel_, hi = lo + shard_numel_;
    for (auto& p : params_) {
      at::Tensor& pg = p.var.mutable_grad();
      if (pg.defined()) {
        // Plain-compute contributions: whole already, add this rank's slice.
        if (!plain_.defined()) plain_ = at::zeros({shard_numel_}, opts_);
        const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
        if (a < b) {
          plain_.narrow(0, a - lo, b - a).add_(pg.reshape({-1}).narrow(0, a - p.offset, b - a));
        }
        pg = at::Tensor();
        reduce_any_ = true;
      }
      p.ready = false;
    }
    ready_ = 0;
    complete_ = false;
    backward_started_ = false;
    backward_prev_.reset();
    reshard();
  }

  /// Whether backward gave this unit anything to reduce.
  bool has_gradients() const {
    if (!partial_.empty()) return true;
    for (const auto& p : params_)
      if (p.var.grad().defined()) return true;
    return false;
  }

  /// Finishes the reduction start_reduce() started: shard_.grad() += this
  /// rank's slice of the gradient. `late`: when the next unit's starts.
  void finish_reduce(bool late) {
    const OpLabel label(label_.c_str());
    torch::NoGradGuard no_grad;
    at::Tensor g = at::zeros({shard_numel_}, opts_);
    std::vector<InFlightReduction> rs = std::move(reducing_);
    reducing_.clear();
    for (auto& r : rs) {
      if (late && r.started) ++overlap_stats().reductions_finished_late;
      r.op.finish();
      at::Tensor x = r.out;
      if (!r.rest.empty()) x = comm::all_reduce_nograd(x, mesh_, r.rest, ReduceOp::Sum);
      g.add_(x);
    }
    if (plain_.defined()) g.add_(plain_);
    plain_ = at::Tensor();
    if (!reduce_any_) return;
    reduce_any_ = false;
    at::Tensor& sg = shard_.mutable_grad();
    if (sg.defined()) {
      sg.add_(g);
    } else {
      sg = g;
    }
  }

  // --- accessors -------------------------------------------------------------

  const at::Tensor& shard() const { return shard_; }
  void set_shard(const at::Tensor& t) {
    TORCH_CHECK(
        t.dim() == 1 && t.numel() == shard_numel_ && t.scalar_type() == shard_.scalar_type(),
        "fully_shard set_shard: expected a 1-D ", shard_.scalar_type(), " tensor of ", shard_numel_,
        " elements, got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.is_leaf(), "fully_shard set_shard: the shard must be a leaf tensor");
    {
      torch::NoGradGuard no_grad;
      t.detach().copy_(shard_.detach());
    }
    shard_ = t;
    if (!shard_.requires_grad()) shard_.requires_grad_(true);
  }
  int64_t numel() const { return numel_; }
  int64_t padded() const { return padded_; }
  int64_t shard_numel() const { return shard_numel_; }
  bool gathered() const { return gathered_; }
  bool is_root() const { return is_root_; }
  const DeviceMesh& mesh() const { return mesh_; }
  int64_t dim() const { return dim_; }
  const std::vector<Param>& params() const { return params_; }
  bool complete() const { return complete_; }

  std::vector<at::Tensor> gather_flat(const at::Tensor& shard_like) const {
    TORCH_CHECK(shard_like.dim() == 1 && shard_like.numel() == shard_numel_,
                "fully_shard: expected a tensor laid out like the shard (", shard_numel_,
                " elements), got shape ", shard_like.sizes());
    torch::NoGradGuard no_grad;
    at::Tensor all =
        d_ == 1 ? shard_like.detach()
                : comm::all_gather(shard_like.detach().contiguous(), mesh_, dim_, 0, sizes_);
    std::vector<at::Tensor> out;
    for (const auto& p : params_) {
      out.push_back(all.narrow(0, p.offset, p.numel).view(p.var.sizes()).clone());
    }
    return out;
  }

  void load_full(const std::vector<std::pair<std::string, at::Tensor>>& state) {
    std::unordered_map<std::string, at::Tensor> by_name(state.begin(), state.end());
    torch::NoGradGuard no_grad;
    at::Tensor flat = at::zeros({padded_}, opts_);
    for (const auto& p : params_) {
      auto it = by_name.find(p.name);
      TORCH_CHECK(it != by_name.end(), "fully_shard load_full_state_dict: no value for '", p.name,
                  "'");
      TORCH_CHECK(it->second.sizes() == p.var.sizes(), "fully_shard load_full_state_dict: '",
                  p.name, "' has shape ", it->second.sizes(), ", the parameter has ",
                  p.var.sizes());
      flat.narrow(0, p.offset, p.numel).copy_(it->second.reshape({-1}));
    }
    reshard();
    shard_.detach().copy_(flat.narrow(0, me_ * shard_numel_, shard_numel_));
  }

 private:
  struct ReadyHook : autograd::FunctionPostHook {
    ReadyHook(std::weak_ptr<FullyShardUnit> u, const at::TensorImpl* l)
        : unit(std::move(u)), leaf(l) {}
    autograd::variable_list operator()(const autograd::variable_list& outputs,
                                       const autograd::variable_list& /*inputs*/) override {
      if (auto u = unit.lock()) u->on_ready(leaf);
      return outputs;
    }
    std::weak_ptr<FullyShardUnit> unit;
    const at::TensorImpl* leaf;
  };

  c10::StorageImpl* storage() const { return full_.storage().unsafeGetStorageImpl(); }

  /// SHARDTENSOR_FSDP_PREFETCH (on unless "0"; Note [agreed settings]):
  /// off, every gather and reduction completes where it starts.
  bool prefetch_on() const {
    return d_ > 1 && comm::use_setting(mesh_, Setting::FsdpPrefetch) != 0;
  }

  void allocate() {
    const size_t bytes = static_cast<size_t>(padded_) * full_.element_size();
    c10::StorageImpl* s = storage();
    s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
    s->set_nbytes(bytes);
  }

  void release() {
    c10::StorageImpl* s = storage();
    // The byte count stays, so views of the parameters can still be taken
    // (their bounds are checked against it); reading data throws libtorch's
    // "data is not allocated yet" (Note [fully_shard]).
    s->set_data_ptr_noswap(at::DataPtr(nullptr, full_.device()));
    gathered_ = false;
  }

  /// The unit recorded just before this one in forward is gathered again
  /// for its backward (Note [fully_shard]).
  void gather_predecessor() {
    auto& ctx = context();
    std::shared_ptr<FullyShardUnit> prev;
    {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      const auto& order = ctx.forward_order;
      for (size_t i = order.size(); i-- > 0;) {
        if (order[i].lock().get() != this) continue;
        for (size_t j = i; j-- > 0;) {
          auto u = order[j].lock();
          if (u && u.get() != this) {
            prev = u;
            break;
          }
        }
        break;
      }
    }
    if (prev && !prev->complete_) {
      if (!prefetch_on()) {
        prev->unshard();
        return;
      }
      backward_prev_ = prev;
      if (prev->start_unshard()) ++overlap_stats().backward_prefetches;
    }
  }

  static void begin_backward() {
    auto& ctx = context();
    {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      if (ctx.in_backward) return;
      ctx.in_backward = true;
      // Reduction order: the reverse of forward, then the rest in registration order.
      ctx.plan.clear();
      ctx.next = 0;
      std::unordered_set<const FullyShardUnit*> seen;
      for (auto it = ctx.forward_order.rbegin(); it != ctx.forward_order.rend(); ++it) {
        if (auto u = it->lock(); u && seen.insert(u.get()).second) ctx.plan.push_back(u);
      }
      for (const auto& w : ctx.live) {
        if (auto u = w.lock(); u && seen.insert(u.get()).second) ctx.plan.push_back(u);
      }
    }
    autograd::Engine::get_default_engine().queue_callback([] { finish_backward(); });
  }

  static void reduce_ready_units() {
    auto& ctx = context();
    while (true) {
      std::shared_ptr<FullyShardUnit> u;
      {
        std::lock_guard<std::mutex> lock(ctx.mutex);
        if (ctx.next >= ctx.plan.size() || !ctx.plan[ctx.next]->complete_) return;
        u = ctx.plan[ctx.next++];
      }
      reduce_unit(u);
    }
  }

  /// Starts `u`'s reduction after finishing the one in flight (Note
  /// [fully_shard prefetch]); `u` null: finishes the one in flight.
  static void reduce_unit(const std::shared_ptr<FullyShardUnit>& u) {
    if (u && !u->has_gradients()) {
      // Nothing to send (a unit not used in this forward): only reset and free it.
      u->start_reduce();
      u->finish_reduce(/*late=*/false);
      return;
    }
    auto& ctx = context();
    std::shared_ptr<FullyShardUnit> before;
    {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      before = std::move(ctx.reducing);
      ctx.reducing = u;
    }
    if (before) before->finish_reduce(/*late=*/u != nullptr);
    if (u) {
      u->start_reduce();
      if (!u->prefetch_on()) {
        {
          std::lock_guard<std::mutex> lock(ctx.mutex);
          ctx.reducing.reset();
        }
        u->finish_reduce(/*late=*/false);
      }
    }
  }

  static void finish_backward() {
    auto& ctx = context();
    std::vector<std::shared_ptr<FullyShardUnit>> rest;
    {
      std::lock_guard<std::mutex> lock(ctx.mutex);
      rest.assign(ctx.plan.begin() + static_cast<std::ptrdiff_t>(ctx.next), ctx.plan.end());
      ctx.plan.clear();
      ctx.next = 0;
      ctx.last_order = std::move(ctx.forward_order);
      ctx.forward_order.clear();
      ctx.cursor = 0;
      ctx.in_backward = false;
      // Sweep units that are gone.
      ctx.live.erase(std::remove_if(ctx.live.begin(), ctx.live.end(),
                                    [](const auto& w) { return w.expired(); }),
                     ctx.live.end());
    }
    for (auto& u : rest) reduce_unit(u);
    reduce_unit(nullptr);
  }

  DeviceMesh mesh_;
  int64_t dim_;
  int64_t d_;
  int64_t me_;
  bool reshard_after_forward_;
  bool is_root_;
  std::vector<Param> params_;
  std::unordered_map<const at::TensorImpl*, size_t> index_;
  int64_t numel_ = 0, padded_ = 0, shard_numel_ = 0;
  std::vector<int64_t> sizes_;
  at::TensorOptions opts_;
  std::string label_;
  at::Tensor full_;   // [padded_]; its storage is every parameter's storage
  at::Tensor shard_;  // [shard_numel_], the leaf the optimizer steps
  bool gathered_ = false;
  std::map<std::vector<int64_t>, at::Tensor> partial_;
  size_t ready_ = 0;
  bool complete_ = false;
  bool backward_started_ = false;
  // Note [fully_shard prefetch]
  struct InFlightReduction {
    comm::PendingCollective op;  // the reduce-scatter over the data dim, if any
    at::Tensor out;              // this rank's slice once op finished
    std::vector<int64_t> rest;   // domain dims to sum over after it
    bool started = false;        // op is a reduce-scatter in flight
  };
  comm::PendingCollective gather_;  // a started gather
  bool gathering_ = false;
  at::Tensor incoming_, outgoing_;  // its receive buffer and the copy of the shard it sends
  const at::TensorImpl* sent_from_ = nullptr;
  int64_t sent_version_ = 0;
  std::weak_ptr<FullyShardUnit> backward_prev_;  // whose gather this unit's backward started
  std::vector<InFlightReduction> reducing_;
  at::Tensor plain_;  // plain-use gradient slices of the reduction in flight
  bool reduce_any_ = false;
};

}  // namespace detail

namespace detail {
FullyShardOverlapStats fully_shard_overlap_stats() { return overlap_stats(); }
}  // namespace detail

// --- FullyShard --------------------------------------------------------------

namespace {
detail::FullyShardUnit& unit_of(const FullyShard& f) {
  TORCH_CHECK(f.defined(), "fully_shard: undefined FullyShard handle");
  return *f.unit();
}
}  // namespace

const at::Tensor& FullyShard::shard() const { return unit_of(*this).shard(); }
void FullyShard::set_shard(const at::Tensor& t) const { unit_of(*this).set_shard(t); }
int64_t FullyShard::numel() const { return unit_of(*this).numel(); }
int64_t FullyShard::padded_numel() const { return unit_of(*this).padded(); }
int64_t FullyShard::shard_numel() const { return unit_of(*this).shard_numel(); }
const DeviceMesh& FullyShard::mesh() const { return unit_of(*this).mesh(); }
int64_t FullyShard::data_dim() const { return unit_of(*this).dim(); }
bool FullyShard::is_sharded() const { return !unit_of(*this).gathered(); }
void FullyShard::unshard() const { unit_of(*this).unshard(); }
void FullyShard::reshard() const { unit_of(*this).reshard(); }

std::vector<std::string> FullyShard::names() const {
  std::vector<std::string> out;
  for (const auto& p : unit_of(*this).params()) out.push_back(p.name);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShard::full_state_dict() const {
  auto& u = unit_of(*this);
  auto values = u.gather_flat(u.shard());
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < values.size(); ++i) out.emplace_back(u.params()[i].name, values[i]);
  return out;
}

void FullyShard::load_full_state_dict(
    const std::vector<std::pair<std::string, at::Tensor>>& state) const {
  unit_of(*this).load_full(state);
}

at::Tensor FullyShard::shard_of(const at::Tensor& flat_padded) const {
  auto& u = unit_of(*this);
  TORCH_CHECK(flat_padded.dim() == 1 && flat_padded.numel() == u.padded(),
              "fully_shard shard_of: expected a 1-D tensor of ", u.padded(),
              " elements, got shape ", flat_padded.sizes());
  return flat_padded.narrow(0, u.mesh().coordinate()[u.dim()] * u.shard_numel(), u.shard_numel());
}

std::vector<at::Tensor> FullyShard::unflatten(const at::Tensor& shard_like) const {
  return unit_of(*this).gather_flat(shard_like);
}

// --- fully_shard -------------------------------------------------------------

FullyShard fully_shard(const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       const DeviceMesh& mesh, const std::string& dim,
                       const FullyShardOptions& options, bool is_root) {
  TORCH_CHECK(mesh.defined(), "fully_shard: the mesh is undefined");
  const auto& names = mesh.dim_names();
  const auto found = std::find(names.begin(), names.end(), dim);
  TORCH_CHECK(found != names.end(), "fully_shard: '", dim, "' is not a dim of the mesh ",
              mesh.to_string());
  const int64_t d = found - names.begin();
  std::vector<int64_t> all_dims(static_cast<size_t>(mesh.ndim()));
  for (int64_t i = 0; i < mesh.ndim(); ++i) all_dims[static_cast<size_t>(i)] = i;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::ostringstream problems;
  for (const auto& [name, t] : parameters) {
    tensors.emplace_back("parameter " + name, t);
    if (!t.requires_grad()) problems << name << " does not require grad; ";
    if (!parameters.empty() && t.scalar_type() != parameters.front().second.scalar_type())
      problems << name << " is " << t.scalar_type() << " but " << parameters.front().first << " is "
               << parameters.front().second.scalar_type() << "; ";
    if (auto it = detail::param_units().find(t.unsafeGetTensorImpl());
        it != detail::param_units().end() && !it->second.expired())
      problems << name << " is already in a fully_shard unit; ";
    else if (comm::detail::grad_sink_for(t, mesh, all_dims))
      problems << name << " is registered by distribute_module; ";
  }
  for (const auto& [name, t] : buffers) tensors.emplace_back("buffer " + name, t);
  std::ostringstream extra;
  extra << "fully_shard:" << dim << ':' << options.reshard_after_forward() << ':' << is_root;
  nn_detail::agree_on_tensors(tensors, mesh, "fully_shard", extra.str());
  // Same modules on every rank (agreed above), so the same problems everywhere.
  TORCH_CHECK(problems.str().empty(), "fully_shard over mesh dim '", dim, "': ", problems.str(),
              "(a unit holds parameters of one dtype that require grad; apply fully_shard to "
              "submodules first, then to the root, once each)");
  nn_detail::broadcast_from_rank0(tensors, mesh);
  auto unit = std::make_shared<detail::FullyShardUnit>(parameters, mesh, d,
                                                       options.reshard_after_forward(), is_root);
  if (!parameters.empty()) unit->install();
  return FullyShard(std::move(unit));
}

FullyShard fully_shard(torch::nn::Module& module, const DeviceMesh& mesh, const std::string& dim,
                       const FullyShardOptions& options) {
  std::vector<std::pair<std::string, at::Tensor>> params, buffers;
  bool contains_units = false;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    auto it = detail::param_units().find(p.value().unsafeGetTensorImpl());
    if (it != detail::param_units().end() && !it->second.expired()) {
      contains_units = true;
      continue;
    }
    if (!p.value().requires_grad()) continue;  // frozen: stays replicated (broadcast)
    params.emplace_back(p.key(), p.value());
  }
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (!p.value().requires_grad()) buffers.emplace_back("frozen " + p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    buffers.emplace_back(b.key(), b.value());
  return fully_shard(params, buffers, mesh, dim, options, contains_units);
}

std::vector<FullyShard> fully_shard_units(torch::nn::Module& module) {
  std::vector<FullyShard> out;
  std::unordered_set<const detail::FullyShardUnit*> seen;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    auto it = detail::param_units().find(p.unsafeGetTensorImpl());
    if (it == detail::param_units().end()) continue;
    if (auto u = it->second.lock(); u && seen.insert(u.get()).second) out.emplace_back(u);
  }
  return out;
}

std::vector<at::Tensor> fully_shard_parameters(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& u : fully_shard_units(module)) {
    if (u.padded_numel() > 0) out.push_back(u.shard());
  }
  return out;
}

double clip_grad_norm_(const std::vector<FullyShard>& units, double max_norm) {
  if (units.empty()) return 0.0;
  const auto& first = unit_of(units.front());
  double local = 0.0;
  for (const auto& f : units) {
    const auto& u = unit_of(f);
    TORCH_CHECK(u.mesh() == first.mesh() && u.dim() == first.dim(),
                "fully_shard clip_grad_norm_: the units live on different meshes or data dims");
    const at::Tensor& g = u.shard().grad();
    if (g.defined()) local += g.detach().to(at::kDouble).pow(2).sum().item<double>();
  }
  at::Tensor t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
  if (first.mesh().size(first.dim()) > 1) {
    t = comm::all_reduce_nograd(t, first.mesh(), {first.dim()}, ReduceOp::Sum);
  }
  const double norm = std::sqrt(t.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (const auto& f : units) {
      at::Tensor g = unit_of(f).shard().grad();
      if (g.defined()) g.mul_(coef);
    }
  }
  return norm;
}

}  // namespace shardtensor
