#pragma once
// Note [gradient carriers] (private; used by the reduction and selection
// rules): a value computed outside autograd (from detached pieces and
// non-differentiable collectives) gets its gradient from a local carrier.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>

#include "ops/common.h"

namespace shardtensor::ops {

/// Hand-written: it attaches a value computed outside autograd to a carrier's
/// gradient path (Note [gradient carriers]); no communication of its own.
/// `inexact` (empty: exact) names the op whose carrier has the right gradient
/// but not the right second derivative: double backward then throws.
struct CarryGrad : public torch::autograd::Function<CarryGrad> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& carrier, std::string inexact, bool none) {
    ctx->saved_data["inexact"] = std::move(inexact);
    ctx->saved_data["none"] = none;
    return value.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("CarryGrad::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static torch::autograd::variable_list backward_formula(torch::autograd::AutogradContext* ctx,
                                                         torch::autograd::variable_list grads) {
    const std::string inexact = ctx->saved_data.at("inexact").toStringRef();
    // The same graph, hence the same verdict, on every rank.
    TORCH_CHECK(inexact.empty() || !at::GradMode::is_enabled(),
                "double backward (create_graph=true) through a sharded ", inexact,
                " is not supported: its gradient is attached as a constant-weight carrier "
                "(Note [gradient carriers]), whose second derivative would be silently wrong");
    // `none`: libtorch's backward gives no gradient at all (x.norm(0)): an
    // undefined gradient, so that x.grad stays None as it does there.
    if (ctx->saved_data.at("none").toBool())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    return {at::Tensor(), grads[0], at::Tensor(), at::Tensor()};
  }
};

/// Local. Whether a gradient will be needed for `t`. Some rules skip a
/// collective (a tie count) when it is not; grad mode and requires_grad are
/// the same on every rank for the same program.
inline bool needs_grad(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

/// Note [gradient carriers]: `value` in forward, the gradient of `carrier`
/// (same shape) in backward. `make_carrier` is only evaluated when a gradient
/// is needed. `none`: the op has no gradient in libtorch (it returns an
/// undefined one), so neither does this: backward hands nothing to the carrier.
template <class F>
at::Tensor carry_grad(const at::Tensor& value, const at::Tensor& local, F make_carrier,
                      std::string inexact = {}, bool none = false) {
  if (!needs_grad(local)) return value;
  return CarryGrad::apply(value, make_carrier(), std::move(inexact), none);
}

}  // namespace shardtensor::ops
