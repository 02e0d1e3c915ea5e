// Downstream smoke test: built against an installed shardtensor package.
// Collective over MPI_COMM_WORLD; prints OK on rank 0 and exits 0 on success.
#include <ATen/ATen.h>
#include <shardtensor/shardtensor.h>

#include <iostream>

namespace st = shardtensor;

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  at::manual_seed(0);
  auto x = at::randn({2, 5, 7});
  auto sx = st::distribute_tensor(x, mesh, {st::Shard{1}});
  const bool ok = st::ShardTensor::is_shard_tensor(sx) && sx.sizes() == x.sizes() &&
                  at::equal(st::ShardTensor(sx).full_tensor(), x);
  int local_ok = ok ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&local_ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (st::world_rank() == 0) {
    std::cout << st::ShardTensor(sx).to_string() << "\n" << (all_ok ? "OK" : "FAILED") << std::endl;
  }
  return all_ok ? 0 : 1;
}
