// distribute_module: make every rank's copy of a module identical, and sum the
// parameters' gradients over the mesh in buckets (Note [gradient buckets]).
#include <shardtensor/core/error.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/nn/module.h>
#include <shardtensor/tensor/shard_tensor.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>

#include "comm/agree.h"
#include "comm/async_reduce.h"
#include "comm/grad_sink.h"
#include "comm/plain.h"
#include "core/fingerprint.h"
#include "nn/module_support.h"

// Note [gradient buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Without a reducer every use of a replicated parameter in sharded compute
// goes through comm::use_replicated(), whose backward all-reduces that use's
// gradient: one small blocking collective per parameter use. distribute_module
// instead registers each parameter that requires grad with a GradReducer (a
// comm::detail::ReplicatedGradSink). use_replicated() of a registered leaf
// over *all* dims of the reducer's mesh then has a backward that adds this
// rank's partial gradient into the parameter's slot of a flat bucket and
// passes nothing on to autograd. Everything else reaches .grad() through
// autograd as before: contributions of plain (replicated) uses are already the
// full gradient on every rank; uses over a subset of mesh dims or on another
// mesh are all-reduced by use_replicated itself. A use through a view of a
// registered leaf (linear's w.t()) marks the leaf and re-takes the view
// (as_strided), so autograd maps the view's gradient back onto the leaf. So
// grad = (full contributions, via autograd) + sum over ranks (bucket slots),
// which is the single-process gradient whatever mix of uses a parameter has:
// nothing is summed twice and nothing is left unsummed.
//
// Buckets: parameters in reverse registration order (roughly the order in
// which backward completes them), one dtype per bucket, at most
// bucket_cap_bytes each. What libtorch offers (1.13 and 2.13 alike; 2.x's
// post-accumulate-grad hooks hold Python hooks only; each point below
// rechecked on 2.13 with a small C++ program) and what is used:
//  - torch::autograd::impl::grad_accumulator(p)->add_post_hook(): runs after
//    p's AccumulateGrad node, i.e. after every node that feeds p (all its
//    use_replicated backwards) has run; it marks p ready. The reducer holds
//    the accumulators (shared_ptr before 2.13, intrusive_ptr since), because
//    the variable keeps only a weak reference and a fresh accumulator (without
//    the hook) would be made for the next graph otherwise. The hook runs even
//    when the accumulator's input is undefined (every use was sharded).
//  - A bucket whose parameters are all ready is started with MPI_Iallreduce
//    (comm::ReduceChannel::start_sum_) on the reducer's own duplicate of the
//    mesh communicator, strictly in bucket order, so every rank starts the
//    same reductions in the same order even if hooks fire in another order;
//    later hooks MPI_Test the started ones to drive progress while the rest of
//    backward computes. (A parameter without a gradient therefore holds back
//    its bucket and all later ones until the end: no overlap, still correct.)
//  - Engine::get_default_engine().queue_callback(), called from the first
//    hook or slot write of a backward, runs at the end of that backward (before
//    backward() returns, on the calling thread). It starts the remaining
//    buckets (parameters that got no gradient contribute zeros, identically on
//    every rank when every rank runs the same graph), waits for all, adds each
//    slot to p.grad() (defining it if needed, so accumulation over several
//    backwards adds up), and zeroes the buckets for the next backward.
//  - Note [gradient defined everywhere]: whether p.grad() is defined after a
//    backward must not depend on the rank. A parameter's accumulator may run on
//    some ranks only (a branch taken only where this rank's piece is
//    non-empty, e.g. a custom layer that skips an empty piece), and its summed
//    slot may be all zeros (a dead ReLU). Deciding per rank ("ready, touched
//    or a nonzero sum") then left .grad zero-filled on some ranks and
//    undefined on others, and optimizers with state drift: SGD with momentum
//    or weight decay and Adam step, and keep state, only where .grad is
//    defined. So each bucket carries, after its slots, one flag element per
//    parameter (1 where this rank's backward reached it: accumulator ran or a
//    slot was written), summed by the same all-reduce; a sum > 0 defines .grad
//    on every rank (a sum of ones cannot round to 0 in any float dtype). Cost:
//    one element per parameter in each bucket (bytes, no extra message).
//    Gradients that reach .grad through autograd directly (plain uses) are
//    full on every rank and must come from the same graph on every rank.
//  - torch::autograd::grad(outputs, inputs) with `inputs` does not run the
//    accumulators: a slot written without its hook firing is detected in the
//    callback and throws (on every rank) instead of returning a wrong gradient.
//  - create_graph=True: the slot path is not differentiable, so
//    use_replicated falls back to its all-reduce under grad mode.

namespace shardtensor {

namespace {

namespace autograd = torch::autograd;

class GradReducer : public comm::detail::ReplicatedGradSink,
                    public std::enable_shared_from_this<GradReducer> {
 public:
  GradReducer(std::vector<at::Tensor> params, const DeviceMesh& mesh, int64_t cap_bytes)
      : mesh_(mesh), channel_(mesh) {
    // Reverse registration order; a new bucket when the dtype or device
    // changes or the cap is reached. A bucket lives on its parameters' device.
    using Kind = std::pair<at::ScalarType, std::string>;  // dtype, device
    std::map<Kind, size_t> open;                          // -> bucket being filled
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      Param p;
      p.var = *it;
      const int64_t bytes = p.var.numel() * p.var.element_size();
      const Kind kind{p.var.scalar_type(), p.var.device().str()};
      auto o = open.find(kind);
      if (o == open.end() ||
          (buckets_[o->second].bytes + bytes > cap_bytes && !buckets_[o->second].params.empty())) {
        buckets_.emplace_back();
        buckets_.back().dtype = p.var.scalar_type();
        buckets_.back().device = p.var.device();
        open[kind] = buckets_.size() - 1;
        o = open.find(kind);
      }
      Bucket& b = buckets_[o->second];
      p.bucket = o->second;
      p.offset = b.bytes / p.var.element_size();
      b.bytes += bytes;
      b.params.push_back(params_.size());
      index_[p.var.unsafeGetTensorImpl()] = params_.size();
      params_.push_back(std::move(p));
    }
    // Note [gradient defined everywhere]: one flag element per parameter after the slots.
    for (auto& b : buckets_) {
      b.elements = static_cast<int64_t>(b.bytes / c10::elementSize(b.dtype));
      b.flat = at::zeros({b.elements + static_cast<int64_t>(b.params.size())},
                         at::TensorOptions().dtype(b.dtype).device(b.device));
      b.pending = b.params.size();
    }
  }

  /// Hooks the accumulators and registers the parameters as sink targets.
  void install() {
    std::weak_ptr<GradReducer> self = shared_from_this();
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.accumulator = autograd::impl::grad_accumulator(p.var);
      TORCH_INTERNAL_ASSERT(p.accumulator, "distribute_module: no gradient accumulator");
      p.accumulator->add_post_hook(std::make_unique<ReadyHook>(self, p.var.unsafeGetTensorImpl()));
      comm::detail::set_grad_sink(p.var, mesh_, shared_from_this());
    }
  }

  size_t num_buckets() const { return buckets_.size(); }

  void add_partial(const at::TensorImpl* leaf, const at::Tensor& grad,
                   const std::vector<int64_t>& /*mesh_dims: all of them*/) override {
    auto it = index_.find(leaf);
    TORCH_INTERNAL_ASSERT(it != index_.end(), "gradient reducer: unknown parameter");
    Param& p = params_[it->second];
    begin_backward();
    TORCH_CHECK(!buckets_[p.bucket].started,
                "distribute_module: a gradient arrived for a parameter whose bucket is already "
                "being reduced (the backward graph runs a parameter's accumulator before all "
                "its uses?)");
    slot(p).add_(grad.reshape({-1}));
    p.touched = true;
  }

  /// A parameter's accumulator ran: its local contributions are complete.
  void on_ready(const at::TensorImpl* leaf) {
    auto it = index_.find(leaf);
    if (it == index_.end()) return;
    Param& p = params_[it->second];
    begin_backward();
    if (p.ready) return;
    p.ready = true;
    Bucket& b = buckets_[p.bucket];
    --b.pending;
    start_ready_buckets();
    for (size_t i = 0; i < next_start_; ++i) buckets_[i].request.test();  // progress
  }

 private:
  struct Param {
    at::Tensor var;
    decltype(autograd::Edge::function)
        accumulator;  // shared_ptr before torch 2.13, intrusive_ptr since
    size_t bucket = 0;
    int64_t offset = 0;  // elements into the bucket
    bool ready = false;
    bool touched = false;
  };
  struct Bucket {
    at::ScalarType dtype = at::kFloat;
    at::Device device = at::kCPU;
    int64_t bytes = 0;  // of the slots
    int64_t elements =
        0;  // slots; then one flag per parameter (Note [gradient defined everywhere])
    std::vector<size_t> params;
    at::Tensor flat;
    size_t pending = 0;
    bool started = false;
    comm::PendingSum request;
  };

  struct ReadyHook : autograd::FunctionPostHook {
    ReadyHook(std::weak_ptr<GradReducer> r, const at::TensorImpl* l)
        : reducer(std::move(r)), leaf(l) {}
    autograd::variable_list operator()(const autograd::variable_list& outputs,
                                       const autograd::variable_list& /*inputs*/) override {
      if (auto r = reducer.lock()) r->on_ready(leaf);
      return outputs;
    }
    std::weak_ptr<GradReducer> reducer;
    const at::TensorImpl* leaf;
  };

  at::Tensor slot(const Param& p) {
    return buckets_[p.bucket].flat.narrow(0, p.offset, p.var.numel());
  }

  void begin_backward() {
    if (in_backward_) return;
    in_backward_ = true;
    std::weak_ptr<GradReducer> self = shared_from_this();
    autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto r = self.lock()) r->finish_backward();
    });
  }

  void start_ready_buckets() {
    while (next_start_ < buckets_.size() && buckets_[next_start_].pending == 0)
      start(next_start_++);
  }

  void start(size_t i) {
    Bucket& b = buckets_[i];
    // Note [gradient defined everywhere]: this rank's flags ride with the sum.
    for (size_t j = 0; j < b.params.size(); ++j) {
      const Param& p = params_[b.params[j]];
      b.flat[b.elements + static_cast<int64_t>(j)].fill_(p.ready || p.touched ? 1 : 0);
    }
    b.started = true;
    b.request = channel_.start_sum_(b.flat);
  }

  void finish_backward() {
    // Named in watchdog messages (Note [watchdog]): a backward that reached
    // the parameters on some ranks only leaves these all-reduces waiting.
    const OpLabel label("distribute_module gradient buckets (end of backward)");
    // Parameters without a gradient in this backward contribute their zeros.
    while (next_start_ < buckets_.size()) start(next_start_++);
    std::string error;
    torch::NoGradGuard no_grad;
    for (auto& b : buckets_) {
      b.request.finish();
      // Summed flags: nonzero iff some rank's backward reached the parameter.
      const at::Tensor somewhere =
          b.flat.narrow(0, b.elements, static_cast<int64_t>(b.params.size())).ne(0).cpu();
      const auto* reached = somewhere.data_ptr<bool>();
      for (size_t j = 0; j < b.params.size(); ++j) {
        Param& p = params_[b.params[j]];
        at::Tensor s = slot(p).view(p.var.sizes());
        if (p.touched && !p.ready && error.empty()) {
          error =
              "distribute_module: a parameter's sharded gradient was produced but its "
              "gradient accumulator did not run (torch::autograd::grad with `inputs`?); "
              "parameters registered by distribute_module need backward()";
        }
        at::Tensor& g = p.var.mutable_grad();
        if (!g.defined()) {
          if (reached[j]) g = s.clone();  // on every rank or on none
        } else {
          g.add_(s);
        }
        p.ready = false;
        p.touched = false;
      }
      b.flat.zero_();
      b.pending = b.params.size();
      b.started = false;
    }
    next_start_ = 0;
    in_backward_ = false;
    TORCH_CHECK(error.empty(), error);
  }

  DeviceMesh mesh_;
  comm::ReduceChannel channel_;  // destroyed after the buckets' pending sums
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::unordered_map<const at::TensorImpl*, size_t> index_;
  size_t next_start_ = 0;
  bool in_backward_ = false;
};

}  // namespace

namespace nn_detail {

void agree_on_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const DeviceMesh& mesh, const char* what, const std::string& extra) {
  // Every rank must hold the same list: compare a fingerprint before moving
  // any data, so a mismatch throws on every rank (Note [collective discipline]).
  std::ostringstream fp;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(!ShardTensor::is_shard_tensor(t), what, ": ", name,
                " is a ShardTensor; parameters and buffers must be plain tensors");
    fp << name << ':' << t.sizes() << ':' << t.scalar_type() << ':' << t.requires_grad() << ';';
  }
  fp << extra;
  // FNV-1a: the same value on every rank for the same text (std::hash is not).
  const auto h = static_cast<int64_t>(detail::fingerprint(fp.str()) >> 2);
  std::vector<int64_t> agree{h, -h};
  comm::all_reduce_max(mesh, agree);
  TORCH_CHECK(agree[0] == -agree[1], what,
              ": ranks hold modules with different parameters or buffers "
              "(names, shapes, dtypes or requires_grad differ) or different options; this rank "
              "has: ",
              fp.str());
}

void broadcast_from_rank0(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const DeviceMesh& mesh) {
  // One broadcast per dtype: parameters and buffers packed into one bucket.
  std::map<at::ScalarType, std::vector<at::Tensor>> buckets;
  for (const auto& [name, t] : tensors) {
    if (t.numel() > 0) buckets[t.scalar_type()].push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, list] : buckets) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.detach().reshape({-1}));
    at::Tensor bucket = at::cat(flat).contiguous();
    comm::broadcast_(bucket, 0, mesh);
    int64_t off = 0;
    for (auto& t : list) {
      t.detach().copy_(bucket.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace nn_detail

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh) {
  distribute_module(module, mesh, DistributeOptions());
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const DistributeOptions& options) {
  TORCH_CHECK(mesh.defined(), "distribute_module: the mesh is undefined");
  TORCH_CHECK(options.bucket_cap_bytes() >= 1,
              "distribute_module: bucket_cap_bytes must be positive, got ",
              options.bucket_cap_bytes());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<at::Tensor> params;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    tensors.emplace_back("parameter " + p.key(), p.value());
    if (p.value().requires_grad()) params.push_back(p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    tensors.emplace_back("buffer " + b.key(), b.value());
  }
  {
    std::ostringstream extra;
    extra << "bucket:" << options.bucket_gradients() << ':' << options.bucket_cap_bytes();
    nn_detail::agree_on_tensors(tensors, mesh, "distribute_module", extra.str());
    nn_detail::broadcast_from_rank0(tensors, mesh);
  }
  if (!options.bucket_gradients()) {
    for (const auto& p : params) comm::detail::set_grad_sink(p, mesh, nullptr);
    return;
  }
  if (params.empty()) return;
  auto reducer = std::make_shared<GradReducer>(params, mesh, options.bucket_cap_bytes());
  reducer->install();
}

}  // namespace shardtensor
