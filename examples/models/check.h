#pragma once
// The examples' MATCH check: after one optimizer step, the sharded model and a
// single-process reference must agree on the loss and on every parameter
// within |diff| <= atol + rtol |ref|. Shared by unet_train, fno_train and
// gnn_train.
#include <mpi.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace check {

/// Collective over MPI_COMM_WORLD: the largest `v` over all ranks.
inline double max_over_ranks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

/// The worst |diff| / (atol + rtol |ref|) over the loss and every parameter,
/// and where it occurred ("loss" or the parameter's name).
struct StepError {
  double worst = 0;
  std::string where = "loss";
  bool ok() const { return worst <= 1.0; }
};

/// Collective over MPI_COMM_WORLD (the worst error is the maximum over ranks;
/// `where` is this rank's). `net` and `ref` are modules with the same
/// parameter names; `loss` and `ref_loss` are their scalar losses.
inline StepError compare_step(const torch::nn::Module& net, const torch::nn::Module& ref,
                              const at::Tensor& loss, const at::Tensor& ref_loss, double rtol,
                              double atol) {
  StepError e;
  const double l = loss.item<double>(), r = ref_loss.item<double>();
  e.worst = std::abs(l - r) / (atol + rtol * std::abs(r));
  const auto ref_params = ref.named_parameters();
  for (const auto& p : net.named_parameters()) {
    const auto& q = ref_params[p.key()];
    const double err = ((p.value() - q).abs() / (atol + rtol * q.abs())).max().item<double>();
    if (err > e.worst) {
      e.worst = err;
      e.where = p.key();
    }
  }
  e.worst = max_over_ranks(e.worst);
  return e;
}

/// The same for a model whose parameters are given as (name, full value)
/// pairs, e.g. gathered from fully_shard's units (Note [fully_shard]).
inline StepError compare_step(const std::vector<std::pair<std::string, at::Tensor>>& params,
                              const torch::nn::Module& ref, const at::Tensor& loss,
                              const at::Tensor& ref_loss, double rtol, double atol) {
  StepError e;
  const double l = loss.item<double>(), r = ref_loss.item<double>();
  e.worst = std::abs(l - r) / (atol + rtol * std::abs(r));
  const auto ref_params = ref.named_parameters();
  for (const auto& [name, value] : params) {
    const auto& q = ref_params[name];
    const double err = ((value - q).abs() / (atol + rtol * q.abs())).max().item<double>();
    if (err > e.worst) {
      e.worst = err;
      e.where = name;
    }
  }
  e.worst = max_over_ranks(e.worst);
  return e;
}

}  // namespace check
