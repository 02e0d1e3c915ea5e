// Reference checks: run a function on plain tensors and on ShardTensors and
// compare outputs and gradients. Kept apart from testing.cpp so that test
// binaries which never touch ShardTensors do not pull it in.
#include "testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
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
    bool rg = in.requires_grad && (in.full.is_floating_point() || in.full.is_complex());
    ref_in.push_back(in.full.detach().clone().requires_grad_(rg));
    if (in.placements) {
      sh_in.push_back(distribute_tensor(in.full, mesh, *in.placements, rg, in.sizes));
    } else {
      sh_in.push_back(in.full.detach().clone().requires_grad_(rg));
    }
  }
  for (const auto& p : params) {
    const bool rg = p.is_floating_point() || p.is_complex();  // integer parameters: no gradient
    ref_p.push_back(p.detach().clone().requires_grad_(rg));
    sh_p.push_back(p.detach().clone().requires_grad_(rg));
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
  // An undefined gradient (None) is compared as such, never as zeros: where
  // libtorch's is undefined ours must be undefined too, and the other way
  // round. Definedness is agreed first, so no rank gathers alone.
  auto compare_grad = [&](const std::string& what, const at::Tensor& g, const at::Tensor& ref_g) {
    const bool ours_all = all_ranks(g.defined()), ours_none = all_ranks(!g.defined());
    const bool ref_all = all_ranks(ref_g.defined()), ref_none = all_ranks(!ref_g.defined());
    if (!ours_all && !ours_none) {
      ok = false;
      msg << "\n  " << what << ": defined on some ranks only";
    } else if (ours_none != ref_none || ours_all != ref_all) {
      ok = false;
      msg << "\n  " << what << ": " << (ours_none ? "undefined" : "defined") << ", libtorch's is "
          << (ref_none ? "undefined (None)" : "defined");
    } else if (ours_all) {
      compare(what, gathered(g), ref_g);
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
      compare_grad("grad of input " + std::to_string(i), g, ref_in[i].grad());
    }
    for (size_t i = 0; i < params.size(); ++i) {
      compare_grad("grad of param " + std::to_string(i), sh_p[i].grad(), ref_p[i].grad());
    }
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

namespace {

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.defined() && t.is_floating_point() ? t.to(dtype) : t;
}

// One run of Note [precision check]: the gathered output and gradients.
struct Run {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

// `ins` and `params` are already in the run's dtype; `mesh` null: plain tensors.
Run run_once(const RefFn& fn, const std::vector<RefInput>& inputs,
             const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& params,
             const DeviceMesh* mesh, at::ScalarType lowp, bool check_backward) {
  std::vector<at::Tensor> x, p;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool rg = inputs[i].requires_grad && ins[i].is_floating_point();
    if (mesh != nullptr && inputs[i].placements) {
      x.push_back(distribute_tensor(ins[i], *mesh, *inputs[i].placements, rg, inputs[i].sizes));
    } else {
      x.push_back(ins[i].detach().clone().requires_grad_(rg));
    }
  }
  for (const auto& t : params) p.push_back(t.detach().clone().requires_grad_(true));
  Run r;
  at::Tensor out = fn(x, p);
  r.out = gathered(out);
  if (!check_backward || !out.requires_grad()) return r;
  // A fixed cotangent rounded to the low dtype: the same values in every run, on every rank.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  const at::Tensor cot = at::randn(out.sizes(), gen, at::kFloat).to(lowp);
  shardtensor::backward(out, cot.to(out.scalar_type()));
  for (size_t i = 0; i < x.size(); ++i) {
    if (!x[i].requires_grad()) continue;
    at::Tensor g = ShardTensor::is_shard_tensor(x[i]) ? ShardTensor(x[i]).grad() : x[i].grad();
    // Undefined stays undefined (compared as such in `within`, never as zeros).
    r.grads.push_back(all_ranks(g.defined()) ? gathered(g) : at::Tensor());
  }
  for (size_t i = 0; i < p.size(); ++i) r.grads.push_back(p[i].grad());
  return r;
}

// Note [precision check] for one tensor; local (every rank holds the same gathered values).
bool within(const at::Tensor& sh, const at::Tensor& si, const at::Tensor& ex, double factor,
            double unit, std::string* why, double* ratio) {
  std::ostringstream os;
  if (!sh.defined() || !si.defined()) {
    // An undefined gradient (None) must be undefined in both runs.
    *ratio = 0;
    if (sh.defined() == si.defined()) return true;
    *why = sh.defined() ? "sharded gradient defined, single-process's undefined (None)"
                        : "sharded gradient undefined, single-process's defined";
    return false;
  }
  if (sh.scalar_type() != si.scalar_type() || sh.sizes() != si.sizes()) {
    os << "sharded " << sh.scalar_type() << sh.sizes() << " vs single-process " << si.scalar_type()
       << si.sizes();
    *why = os.str();
    return false;
  }
  if (sh.numel() == 0) return true;
  const at::Tensor a = sh.detach().to(at::kDouble), b = si.detach().to(at::kDouble),
                   e = ex.detach().to(at::kDouble);
  const at::Tensor fin = torch::isfinite(e), si_fin = torch::isfinite(b) & fin;
  auto max_of = [](const at::Tensor& t, const at::Tensor& mask) {
    return mask.any().item<bool>() ? t.masked_select(mask).max().item<double>() : 0.0;
  };
  const double e_single = max_of((b - e).abs(), si_fin);
  const double scale = max_of(e.abs(), fin);
  const double tol = factor * e_single + unit * scale;
  const at::Tensor d = (a - e).abs();
  const at::Tensor a_fin = torch::isfinite(a);
  // Where single-process is finite: finite and within tol.
  const bool ok_fin = !(si_fin & (~a_fin | (d > tol))).any().item<bool>();
  // Overflow of single-process: the same non-finite value, or within tol.
  const at::Tensor over = fin & ~si_fin;
  const at::Tensor same = (a == b) | (torch::isnan(a) & torch::isnan(b));
  const bool ok_over = !(over & ~same & ~(a_fin & (d <= tol))).any().item<bool>();
  // Non-finite exact values: as single-process.
  const bool ok_nonfin = !(~fin & ~same).any().item<bool>();
  const double e_sharded = max_of(d, si_fin & a_fin);
  *ratio = e_single > 0 ? e_sharded / e_single : (e_sharded > 0 ? 1e300 : 0.0);
  os << "E_sharded = " << e_sharded << ", E_single = " << e_single << ", bound " << tol
     << " (max|exact| = " << scale << ")";
  if (!ok_fin) os << "; sharded outside the bound where single-process is finite";
  if (!ok_over) os << "; sharded neither the single-process overflow value nor within the bound";
  if (!ok_nonfin) os << "; non-finite exact values differ from single-process";
  *why = os.str();
  return ok_fin && ok_over && ok_nonfin;
}

}  // namespace

::testing::AssertionResult precision_check(const RefFn& fn, const std::vector<RefInput>& inputs,
                                           const DeviceMesh& mesh, at::ScalarType dtype,
                                           const std::vector<at::Tensor>& params, double factor,
                                           bool check_backward) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "precision_check: dtype must be kHalf, kBFloat16 or kFloat");
  const double unit = dtype == at::kHalf       ? std::ldexp(1.0, -11)
                      : dtype == at::kBFloat16 ? std::ldexp(1.0, -8)
                                               : std::ldexp(1.0, -24);
  std::vector<at::Tensor> low, exact, low_p, exact_p;
  for (const auto& in : inputs) {
    low.push_back(as_dtype(in.full, dtype));
    exact.push_back(as_dtype(low.back(), at::kDouble));
  }
  for (const auto& p : params) {
    low_p.push_back(as_dtype(p, dtype));
    exact_p.push_back(as_dtype(low_p.back(), at::kDouble));
  }
  Run ex = run_once(fn, inputs, exact, exact_p, nullptr, dtype, check_backward);
  Run si = run_once(fn, inputs, low, low_p, nullptr, dtype, check_backward);
  Run sh = run_once(fn, inputs, low, low_p, &mesh, dtype, check_backward);
  bool ok = true;
  std::ostringstream msg, report;
  auto compare = [&](const std::string& what, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& e) {
    std::string why;
    double ratio = 0;
    const bool good = within(a, b, e, factor, unit, &why, &ratio);
    report << " " << what << " " << ratio;
    if (!good) {
      ok = false;
      msg << "\n  " << what << ": " << why;
    }
  };
  compare("output", sh.out, si.out, ex.out);
  if (sh.grads.size() != si.grads.size() || ex.grads.size() != si.grads.size()) {
    ok = false;
    msg << "\n  gradients: " << sh.grads.size() << " sharded, " << si.grads.size()
        << " single-process, " << ex.grads.size() << " exact";
  } else {
    for (size_t i = 0; i < si.grads.size(); ++i) {
      compare("grad " + std::to_string(i), sh.grads[i], si.grads[i], ex.grads[i]);
    }
  }
  if (std::getenv("SHARDTENSOR_PRECISION_REPORT") != nullptr && mesh.rank() == 0) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::printf("[precision] %s.%s %s E_sharded/E_single:%s\n", info->test_suite_name(),
                info->name(), c10::toString(dtype), report.str().c_str());
  }
  if (all_ranks(ok)) return ::testing::AssertionSuccess();
  if (ok) msg << " (another rank failed; see its report)";
  return ::testing::AssertionFailure() << "(" << c10::toString(dtype) << ")" << msg.str();
}

}  // namespace shardtensor::testing
