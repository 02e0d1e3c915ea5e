// First example: pointwise ops and a full reduction on a tensor sharded along
// its height, forward and backward, checked against single-process libtorch.
//
//   mpirun --oversubscribe -np 4 build/examples/first_example     (or: make demo)
//
// Every rank builds the same full input (same seed), so every rank can also
// compute the single-process reference; rank 0 prints. The exit code is the
// same on every rank: 0 on MATCH, 1 on MISMATCH.
#include <mpi.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <cmath>
#include <exception>
#include <iostream>

namespace st = shardtensor;

namespace {

// The computation, written once: plain libtorch, sharded or not.
at::Tensor model(const at::Tensor& x) { return torch::relu(torch::tanh(x * 2.0 + 1.0) - 0.25); }

double max_abs_error(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return -1.0;  // shape mismatch
  return (a - b).abs().max().item<double>();
}

int run() {
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});  // 1-D mesh over all ranks
  const bool root = st::world_rank() == 0;

  torch::manual_seed(0);
  auto x = torch::randn({1, 8, 64, 64});

  // Sharded: rank 0 scatters; each rank receives its rows of dim 2 (height).
  auto sx = st::scatter_tensor(x, /*src=*/0, mesh, {st::Shard{2}}, /*requires_grad=*/true);
  auto sy = model(sx);    // pointwise ops run on the local pieces, no communication
  auto loss = sy.mean();  // full reduction: a plain scalar, identical on every rank
  loss.backward();        // ordinary libtorch backward
  auto grad = st::ShardTensor(sx).grad();  // ShardTensor, Shard{2}
  TORCH_CHECK(grad.defined(), "no gradient reached the sharded input");
  auto out_full = st::ShardTensor(sy).full_tensor();
  auto grad_full = grad.full_tensor();

  // Reference: the same computation on the full tensor in one process.
  auto xr = x.clone().requires_grad_(true);
  auto yr = model(xr);
  auto loss_r = yr.mean();
  loss_r.backward();

  const double err_loss = std::abs(loss.item<double>() - loss_r.item<double>());
  const double err_out = max_abs_error(out_full, yr.detach());
  const double err_grad = max_abs_error(grad_full, xr.grad());
  const double tol = 1e-5;
  const bool ok = err_loss >= 0 && err_loss <= tol && err_out >= 0 && err_out <= tol &&
                  err_grad >= 0 && err_grad <= tol;

  // A small ShardTensor to show operator<<: 3 rows over the mesh (uneven, maybe empty shards).
  auto small =
      st::distribute_tensor(torch::arange(12, torch::kFloat).reshape({3, 4}), mesh, {st::Shard{0}});

  if (root) {
    std::cout << "shardtensor first example on " << st::world_size() << " rank(s), mesh " << mesh
              << "\n"
              << "input      " << st::ShardTensor(sx).to_string() << "\n"
              << "output     " << st::ShardTensor(sy).to_string() << "\n"
              << "loss       " << loss.item<double>() << " (reference " << loss_r.item<double>()
              << ")\n"
              << "local grad shape on rank 0: " << grad.local().sizes() << "\n"
              << "max |error|: loss " << err_loss << ", output " << err_out << ", input grad "
              << err_grad << "\n"
              << "rank 0 view of a small ShardTensor:\n"
              << small << "\n"
              << (ok ? "MATCH" : "MISMATCH") << std::endl;
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);  // MPI init; finalized when main returns
  try {
    return run();
  } catch (const std::exception& e) {
    // The library throws on every rank; abort anyway so that no rank can be left waiting.
    std::cerr << "[rank " << st::world_rank() << "] error: " << e.what() << std::endl;
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
