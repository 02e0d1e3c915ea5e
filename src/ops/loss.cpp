// Losses: mse_loss, l1_loss, smooth_l1_loss, huber_loss, binary_cross_entropy,
// binary_cross_entropy_with_logits (elementwise losses), and nll_loss,
// nll_loss2d, nll_loss_nd, cross_entropy_loss (class losses).
//
// F::cross_entropy reaches the dispatcher as aten::cross_entropy_loss and
// F::nll_loss as aten::nll_loss_nd (both CompositeImplicitAutograd, caught
// whole); nll_loss and nll_loss2d are what nll_loss_nd calls and are handled
// too, as are the elementwise losses (several have dedicated CPU kernels).
//
// Note [sharded loss]: the loss runs on the local pieces with reduction
// 'none', which gives libtorch's own per-element values and gradients; then
//  - none: the per-element loss, laid out like the input (class losses: like
//    the input without its class dim, i.e. like the target);
//  - sum:  local sum, all-reduced over the mesh dims that shard the input ->
//    a plain tensor, identical on every rank;
//  - mean: that sum divided by a global denominator: the global element count
//    (elementwise losses, cross_entropy with probability targets), or the
//    global sum of the class weights of the non-ignored targets (nll_loss,
//    cross_entropy with class indices; the count of non-ignored targets
//    without weights), all-reduced like the sum. label_smoothing > 0 mixes
//    two sums with their own denominators, as libtorch does.
// The denominators are constants (libtorch does not differentiate them), so
// the gradient is that of the local 'none' loss scaled, and needs no
// communication in backward (the all-reduce's adjoint is the identity).
// Targets must be laid out like the input (class-index targets: like the
// input without its class dim); a plain target is sliced to that layout.
// The class dim must not be sharded.
#include <ATen/ATen.h>

#include <string>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;

int64_t arg_index(const c10::OperatorHandle& op, const char* name) {
  const auto& a = op.schema().arguments();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name() == name) return static_cast<int64_t>(i);
  }
  return -1;
}

// A target laid out as `want`: a ShardTensor must already have that layout; a
// plain tensor of the same global shape is sliced to it.
at::Tensor target_local(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                        const at::Tensor& t, const ShardSpec& want, const ShardSpec& input) {
  if (t.sizes().vec() != want.global_shape()) {
    fail(op, args,
         "the target's shape " + c10::str(t.sizes()) + " does not match the expected " +
             c10::str(c10::IntArrayRef(want.global_shape())) + " for an input of shape " +
             c10::str(c10::IntArrayRef(input.global_shape())));
  }
  if (const ShardSpec* s = spec_of(t)) {
    if (*s != want) {
      // Same mesh: move the target to the input's layout (collective over the
      // mesh; every rank sees both specs, so every rank takes this branch).
      if (s->mesh() == want.mesh()) {
        at::Tensor moved = ShardTensor(t).redistribute(want.placements(), want.all_shard_sizes());
        return to_layout(moved, want, input);
      }
      fail(op, args,
           "the target lives on another mesh (" + s->to_string() + ") than the input (" +
               want.to_string() + ")");
    }
  }
  return to_layout(t, want, input);
}

// Sum (or mean with `denom`) of the local per-element loss over every rank of
// the mesh dims that shard the input: a plain tensor, in acc_dtype(l) (Note
// [reduced precision]: float32 for float16/bfloat16; the caller rounds once).
at::Tensor reduce_loss(const at::Tensor& l, const ShardSpec& in, int64_t reduction,
                       const at::Tensor& denom) {
  at::Tensor s = l.sum(acc_dtype(l.scalar_type()));
  auto mdims = sharded_mesh_dims(in);
  if (!mdims.empty()) s = comm::all_reduce(s, in.mesh(), mdims);
  if (reduction == kMean) s = s / denom;
  return s;
}

at::Tensor global_sum_nograd(const at::Tensor& t, const ShardSpec& in) {
  auto mdims = sharded_mesh_dims(in);
  if (mdims.empty()) return t;
  return comm::all_reduce_nograd(t.contiguous(), in.mesh(), mdims, ReduceOp::Sum);
}

void check_reduction(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     int64_t r) {
  if (r != kNone && r != kMean && r != kSum) {
    fail(op, args, "unknown reduction " + std::to_string(r));
  }
}

// ---------------------------------------------------------------- elementwise

// mse_loss(self, target, reduction), l1_loss(self, target, reduction),
// smooth_l1_loss(self, target, reduction, beta), huber_loss(self, target,
// reduction, delta), binary_cross_entropy(self, target, weight?, reduction),
// binary_cross_entropy_with_logits(self, target, weight?, pos_weight?, reduction).
void elementwise_loss_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.operator_name().overload_name.empty()) {
    fail(op, args, "no sharding rule for this overload");
  }
  const at::Tensor& x = args[0].toTensor();
  const int64_t ri = arg_index(op, "reduction");
  const int64_t reduction = args[ri].toInt();
  check_reduction(op, args, reduction);
  {
    // Note [reduced precision]: libtorch's verdict on these dtypes, before any
    // communication: the op itself on two-element tensors (weights broadcast).
    std::vector<at::ScalarType> dtypes;
    bool backward = false;
    for (const auto& v : args) {
      if (!v.isTensor()) continue;
      dtypes.push_back(dtype_or_none(v.toTensor()));
      backward = backward || will_backward(v.toTensor());
    }
    const std::string family(op.operator_name().name.substr(6));
    check_dtype_support(op, args, family.c_str(), dtypes, backward,
                        [&](c10::ArrayRef<at::ScalarType> t, bool rg) {
                          Stack s;
                          size_t k = 0;
                          for (const auto& v : args) {
                            if (!v.isTensor()) {
                              s.push_back(v);
                              continue;
                            }
                            at::Tensor p;
                            if (t[k] != at::ScalarType::Undefined) {
                              p = at::full({2}, 0.5, at::TensorOptions().dtype(t[k]));
                              if (k == 0) p.requires_grad_(rg);
                            }
                            ++k;
                            s.push_back(p);
                          }
                          op.callBoxed(&s);
                          return s[0].toTensor();
                        });
  }
  const ShardSpec* xs = spec_of(x);
  const ShardSpec* ts = spec_of(args[1].toTensor());
  // The input's layout decides (or the target's, if only the target is sharded).
  auto spec = std::make_shared<const ShardSpec>(without_partial(xs ? *xs : *ts));
  const ShardSpec& in = *spec;
  if (x.sizes().vec() != in.global_shape() || args[1].toTensor().sizes() != x.sizes()) {
    fail(op, args, "input and target must have the same shape");
  }
  std::vector<c10::IValue> local_args = args;
  local_args[0] = xs ? to_layout(x, in, in) : target_local(op, args, x, in, in);
  local_args[1] = target_local(op, args, args[1].toTensor(), in, in);
  for (size_t i = 2; i < args.size(); ++i) {
    if (!args[i].isTensor() || !args[i].toTensor().defined()) continue;
    const at::Tensor& t = args[i].toTensor();
    if (!at::is_expandable_to(t.sizes(), in.global_shape())) {
      fail(op, args,
           "the " + op.schema().arguments()[i].name() + " of shape " + c10::str(t.sizes()) +
               " does not broadcast to the input");
    }
    local_args[i] = to_layout(t, operand_spec(in, t.sizes()), in);
  }
  local_args[ri] = kNone;
  Stack s = std::move(local_args);
  op.callBoxed(&s);
  at::Tensor l = s[0].toTensor();
  if (reduction == kNone) {
    stack->push_back(wrap(l, spec));
  } else {
    at::Tensor denom = at::scalar_tensor(static_cast<double>(in.numel()),
                                         l.options().dtype(acc_dtype(l.scalar_type())));
    stack->push_back(reduce_loss(l, in, reduction, denom).to(l.scalar_type()));
  }
}

// ---------------------------------------------------------------- class losses

// The layout of a class-index target: the input's without the class dim.
ShardSpec without_class_dim(const ShardSpec& in, int64_t cdim) {
  Placements p;
  ShardSizes sizes;
  for (int64_t m = 0; m < in.mesh().ndim(); ++m) {
    const auto& pl = in.placements()[m];
    if (is_shard(pl)) {
      const int64_t d = shard_dim(pl);
      p.push_back(Shard{d > cdim ? d - 1 : d});
      sizes.push_back(in.shard_sizes(m));
    } else {
      p.push_back(pl);
      sizes.push_back({});
    }
  }
  std::vector<int64_t> shape = in.global_shape();
  shape.erase(shape.begin() + cdim);
  return ShardSpec(in.mesh(), p, shape, sizes);
}

// Collective over the mesh dims that shard the input. The global sum of the
// class weights of the non-ignored targets (their count without weights).
at::Tensor weight_sum(const at::Tensor& target, const at::Tensor& w, int64_t ignore_index,
                      const ShardSpec& in, at::ScalarType dtype) {
  at::NoGradGuard ng;
  at::Tensor valid = target != ignore_index;
  at::Tensor s;
  if (w.defined()) {
    at::Tensor idx = target.masked_fill(~valid, 0).flatten();
    s = w.detach().index_select(0, idx).masked_fill(~valid.flatten(), 0).sum();
  } else {
    s = valid.sum();
  }
  return global_sum_nograd(s.to(dtype).reshape({1}), in).reshape({});
}

// nll_loss / nll_loss2d / nll_loss_nd (self, target, weight?, reduction, ignore_index)
// cross_entropy_loss(self, target, weight?, reduction, ignore_index, label_smoothing)
void class_loss_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.operator_name().overload_name.empty()) {
    fail(op, args, "no sharding rule for this overload");
  }
  const bool ce = op.operator_name().name == "aten::cross_entropy_loss";
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& t = args[1].toTensor();
  const at::Tensor w = opt_tensor(args[2]);
  const int64_t reduction = args[3].toInt();
  const int64_t ignore_index = args[4].toInt();
  const double smoothing = ce ? args[5].toDouble() : 0.0;
  check_reduction(op, args, reduction);
  const ShardSpec* xs = spec_of(x);
  if (!xs) fail(op, args, "the input must be a ShardTensor when the target is one");
  auto spec = std::make_shared<const ShardSpec>(without_partial(*xs));
  const ShardSpec& in = *spec;
  const int64_t cdim = in.ndim() >= 2 ? 1 : 0;
  if (in.ndim() == 0) fail(op, args, "the input must have a class dim");
  if (in.mesh_dim_of(cdim) >= 0) {
    fail(op, args,
         "the class dim (dim " + std::to_string(cdim) +
             ") is sharded; shard the batch or spatial dims instead (the class dim must be "
             "whole on every rank)");
  }
  const int64_t classes = in.global_shape()[cdim];
  if (w.defined() && (w.dim() != 1 || w.size(0) != classes)) {
    fail(op, args,
         "weight should be a 1-D tensor of " + std::to_string(classes) + " entries, got " +
             c10::str(w.sizes()));
  }
  const bool prob_targets = ce && at::isFloatingType(t.scalar_type());
  // Note [reduced precision]: libtorch's verdict on these dtypes, before any communication.
  check_dtype_support(
      op, args, ce ? "cross_entropy_loss" : "nll_loss",
      {x.scalar_type(), prob_targets ? t.scalar_type() : at::ScalarType::Undefined,
       dtype_or_none(w)},
      will_backward(x) || will_backward(w),
      [ce, prob_targets, smoothing](c10::ArrayRef<at::ScalarType> d, bool rg) {
        at::Tensor input = probe_ones({2, 3}, d[0], rg);
        at::Tensor target = prob_targets ? probe_ones({2, 3}, d[1])
                                         : at::zeros({2}, at::TensorOptions().dtype(at::kLong));
        at::Tensor weight = probe_ones({3}, d[2]);
        return ce ? at::cross_entropy_loss(input, target, weight, kNone, -100, smoothing)
                  : at::nll_loss_nd(input, target, weight, kNone, -100);
      });
  auto out_spec = std::make_shared<const ShardSpec>(without_class_dim(in, cdim));
  auto tspec = prob_targets ? spec : out_spec;
  if (!prob_targets && at::isFloatingType(t.scalar_type())) {
    fail(op, args, "expected class-index targets of an integer dtype");
  }
  at::Tensor xl = to_layout(x, in, in);
  at::Tensor tl = target_local(op, args, t, *tspec, in);
  at::Tensor wl;
  if (w.defined()) {
    wl = to_layout(
        w, ShardSpec(in.mesh(), Placements(in.mesh().ndim(), Replicate{}), w.sizes().vec()), in);
  }
  // Per-element losses on this rank (Note [sharded loss]).
  auto none_loss = [&](const at::Tensor& input, bool smooth_part) -> at::Tensor {
    if (input.numel() == 0) return input.sum(cdim) * 0;  // empty piece: empty result
    if (smooth_part) {
      // -(sum_c w_c * log p_c), zero where the target is ignored.
      at::Tensor lp = input;
      if (wl.defined()) {
        std::vector<int64_t> shape(input.dim(), 1);
        shape[cdim] = classes;
        lp = lp * wl.view(shape);
      }
      return -lp.sum(cdim).masked_fill(tl == ignore_index, 0);
    }
    return at::nll_loss_nd(input, tl, wl, kNone, ignore_index);
  };
  at::Tensor l;
  std::vector<c10::IValue> local_args = args;
  if (ce && (prob_targets || smoothing == 0.0 || reduction != kMean)) {
    if (xl.numel() == 0) {
      l = xl.sum(cdim) * 0;
    } else {
      l = at::cross_entropy_loss(xl, tl, wl, kNone, ignore_index, smoothing);
    }
  } else if (ce) {
    // Mean with label smoothing: two sums, two denominators, as libtorch does.
    at::Tensor lp = xl.numel() == 0 ? xl : at::log_softmax(xl, cdim);
    l = none_loss(lp, false);
    at::Tensor smooth = none_loss(lp, true);
    at::Tensor denom = weight_sum(tl, wl, ignore_index, in, acc_dtype(xl.scalar_type()));
    at::Tensor a = reduce_loss(l, in, kMean, denom);
    at::Tensor b = reduce_loss(smooth, in, kMean, denom);
    stack->push_back((a * (1.0 - smoothing) + b * (smoothing / static_cast<double>(classes)))
                         .to(l.scalar_type()));
    return;
  } else {
    l = none_loss(xl, false);
  }
  if (reduction == kNone) {
    stack->push_back(wrap(l, out_spec));
    return;
  }
  at::Tensor denom;
  {
    at::NoGradGuard ng;
    const at::ScalarType acc = acc_dtype(l.scalar_type());
    if (prob_targets) {
      denom = at::scalar_tensor(static_cast<double>(out_spec->numel()), xl.options().dtype(acc));
    } else {
      denom = weight_sum(tl, wl, ignore_index, in, acc);
    }
  }
  stack->push_back(reduce_loss(l, in, reduction, denom).to(l.scalar_type()));
}

const RuleRegistrar r_elementwise({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                                   "binary_cross_entropy", "binary_cross_entropy_with_logits"},
                                  elementwise_loss_rule);
const RuleRegistrar r_class({"nll_loss", "nll_loss2d", "nll_loss_nd", "cross_entropy_loss"},
                            class_loss_rule);

}  // namespace
}  // namespace shardtensor::ops
