// Convolution example (the canonical scenario of issue 3): a 1x8x1024x1024
// field sharded along its height, one Conv2d(8, 8, 3, padding 1), forward and
// backward, checked against single-process libtorch.
//
//   mpirun --oversubscribe -np 4 build/examples/conv_example
//
// No manual padding or communication: the convolution rule exchanges the
// one-row halos with the neighbours in forward and sends the halo gradients
// back in backward. Every rank builds the same input and module (same seed),
// so every rank also computes the reference; rank 0 prints. The exit code is
// the same on every rank: 0 on MATCH, 1 on MISMATCH.
#include <mpi.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <algorithm>
#include <exception>
#include <iostream>

namespace st = shardtensor;

namespace {

// max |a - b| / max |b|: the error relative to the tensor's scale.
double max_rel_error(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return -1.0;  // shape mismatch
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

int run() {
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const bool root = st::world_rank() == 0;

  torch::manual_seed(0);
  auto x = torch::randn({1, 8, 1024, 1024});
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(8, 8, 3).padding(1));
  torch::nn::Conv2d ref(torch::nn::Conv2dOptions(8, 8, 3).padding(1));
  {
    torch::NoGradGuard no_grad;
    ref->weight.copy_(conv->weight);
    ref->bias.copy_(conv->bias);
  }

  // Sharded: rank 0 scatters the rows of dim 2; the module is an ordinary one.
  auto sx = st::scatter_tensor(x, /*src=*/0, mesh, {st::Shard{2}}, /*requires_grad=*/true);
  st::distribute_module(*conv, mesh);  // same weights everywhere, gradients summed
  auto out = conv(sx);
  auto cot = torch::randn(out.sizes());    // a fixed random cotangent, same on every rank
  st::backward(out, cot);                  // sharded output: shardtensor::backward
  auto grad = st::ShardTensor(sx).grad();  // ShardTensor, Shard{2}
  TORCH_CHECK(grad.defined(), "no gradient reached the sharded input");
  auto out_full = st::ShardTensor(out).full_tensor();
  auto grad_full = grad.full_tensor();

  // Reference: one process, the full field (float32, as a user would run it).
  auto xr = x.clone().requires_grad_(true);
  auto outr = ref(xr);
  outr.backward(cot);
  // The weight and bias gradients are sums over ~8M terms (every pixel); a
  // float32 sum of that length is itself only good to ~1e-5, in whatever
  // order it is taken. Judge them against an exact (float64) reference, the
  // same way for the sharded and the single-process result.
  torch::nn::Conv2d ref64(torch::nn::Conv2dOptions(8, 8, 3).padding(1));
  {
    torch::NoGradGuard no_grad;
    ref64->to(torch::kFloat64);
    ref64->weight.copy_(conv->weight.detach());
    ref64->bias.copy_(conv->bias.detach());
  }
  ref64(x.to(torch::kFloat64)).backward(cot.to(torch::kFloat64));

  const double tol = 1e-5;  // float32, relative to the tensor's scale
  const double e_out = max_rel_error(out_full, outr.detach());
  const double e_grad = max_rel_error(grad_full, xr.grad());
  const double e_w = max_rel_error(conv->weight.grad().to(torch::kFloat64), ref64->weight.grad());
  const double e_b = max_rel_error(conv->bias.grad().to(torch::kFloat64), ref64->bias.grad());
  const double e_w32 = max_rel_error(ref->weight.grad().to(torch::kFloat64), ref64->weight.grad());
  const double e_b32 = max_rel_error(ref->bias.grad().to(torch::kFloat64), ref64->bias.grad());
  // Output and input gradient: equal to single-process at 1e-5. Parameter
  // gradients: at least as close to the exact value as single-process float32
  // is (and within 1e-5 whenever single-process is).
  bool ok = true;
  for (double e : {e_out, e_grad}) ok = ok && e >= 0 && e <= tol;
  ok = ok && e_w >= 0 && e_w <= std::max(tol, e_w32);
  ok = ok && e_b >= 0 && e_b <= std::max(tol, e_b32);

  if (root) {
    std::cout << "shardtensor conv example on " << st::world_size() << " rank(s), mesh " << mesh
              << "\n"
              << "input      " << st::ShardTensor(sx).to_string() << "\n"
              << "output     " << st::ShardTensor(out).to_string() << "\n"
              << "local grad shape on rank 0: " << grad.local().sizes() << "\n"
              << "max relative error vs single-process float32: output " << e_out << ", input grad "
              << e_grad << "\n"
              << "max relative error vs float64: weight grad " << e_w << ", bias grad " << e_b
              << " (single-process float32: " << e_w32 << ", " << e_b32 << ")\n"
              << (ok ? "MATCH" : "MISMATCH") << std::endl;
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  try {
    return run();
  } catch (const std::exception& e) {
    std::cerr << "[rank " << st::world_rank() << "] error: " << e.what() << std::endl;
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
