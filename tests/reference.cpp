// Reference checks: run a function on plain tensors and on ShardTensors and
// compare outputs and gradients. Kept apart from testing.cpp so that test
// binaries which never touch ShardTensors do not pull it in.
#include "testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <sstream>

namespace shardtensor::testing {

at::Tensor gathered(const at::Tensor& t) {
  if (ShardTensor::is_shard_tensor(t)) {
    return ShardTensor(t).full_tensor();
  }
  return t;
}

::testing::AssertionResult reference_check(const RefFn& fn, const std::vector<RefInput>& inputs,
                                           const DeviceMesh& mesh,
                                           const std::vector<at::Tensor>& params, double rtol,
                                           double atol, bool check_backward) {
  std::vector<at::Tensor> ref_in, sh_in, ref_p, sh_p;
  for (const auto& in : inputs) {
    bool rg = in.requires_grad && in.full.is_floating_point();
    ref_in.push_back(in.full.detach().clone().requires_grad_(rg));
    if (in.placements) {
      sh_in.push_back(distribute_tensor(in.full, mesh, *in.placements, rg, in.sizes));
    } else {
      sh_in.push_back(in.full.detach().clone().requires_grad_(rg));
    }
  }
  for (const auto& p : params) {
    ref_p.push_back(p.detach().clone().requires_grad_(true));
    sh_p.push_back(p.detach().clone().requires_grad_(true));
  }
  at::Tensor ref_out = fn(ref_in, ref_p);
  at::Tensor sh_out = fn(sh_in, sh_p);
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  bool ok = true;
  std::ostringstream msg;
  auto compare = [&](const std::string& what, const at::Tensor& a, const at::Tensor& b) {
    auto r = all_close(a, b, rtol, atol);
    if (!r) {
      ok = false;
      msg << "\n  " << what << ": " << r.message();
    }
  };
  compare("output", gathered(sh_out), ref_out);
  if (check_backward && ref_out.requires_grad()) {
    // A fixed cotangent, identical on every rank.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    auto cot = at::randn(ref_out.sizes(), gen, ref_out.options().requires_grad(false));
    ref_out.backward(cot);
    shardtensor::backward(sh_out, cot);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!ref_in[i].requires_grad()) continue;
      at::Tensor g = sh_in[i].defined() && ShardTensor::is_shard_tensor(sh_in[i])
                         ? ShardTensor(sh_in[i]).grad()
                         : sh_in[i].grad();
      at::Tensor ref_g = ref_in[i].grad();
      if (!ref_g.defined()) ref_g = torch::zeros_like(ref_in[i]);
      if (!g.defined()) g = torch::zeros_like(ref_g);
      compare("grad of input " + std::to_string(i), gathered(g), ref_g);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor ref_g = ref_p[i].grad();
      at::Tensor g = sh_p[i].grad();
      if (!ref_g.defined()) ref_g = torch::zeros_like(ref_p[i]);
      if (!g.defined()) g = torch::zeros_like(ref_g);
      compare("grad of param " + std::to_string(i), g, ref_g);
    }
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

}  // namespace shardtensor::testing
