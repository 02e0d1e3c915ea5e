// Non-blocking sums on a private duplicate communicator, and the split-phase
// flat all-gather and reduce-scatter (comm/async_reduce.h), over the transport.
#include "comm/async_reduce.h"

#include "comm/transport.h"

namespace shardtensor::comm {

ReduceChannel::ReduceChannel(const DeviceMesh& mesh) : comm_(transport::duplicate(mesh.comm())) {}

ReduceChannel::~ReduceChannel() { transport::free_duplicate(comm_); }

PendingSum ReduceChannel::start_sum_(const at::Tensor& t) {
  return PendingSum(std::make_unique<transport::PendingReduce>(
      transport::start_all_reduce_(t, ReduceOp::Sum, comm_)));
}

namespace {
void check_flat(const at::Tensor& piece, const at::Tensor& full, const DeviceMesh& mesh,
                int64_t mesh_dim, const char* what) {
  TORCH_CHECK(mesh_dim >= 0 && mesh_dim < mesh.ndim(), "shardtensor ", what, ": mesh dim ",
              mesh_dim, " is out of range for a ", mesh.ndim(), "-D mesh");
  const int64_t d = mesh.size(mesh_dim);
  TORCH_CHECK(piece.dim() == 1 && full.dim() == 1 && piece.is_contiguous() &&
                  full.is_contiguous() && piece.scalar_type() == full.scalar_type() &&
                  full.numel() == d * piece.numel(),
              "shardtensor ", what, ": expected contiguous 1-D tensors of one dtype, the full one ",
              d, " times the piece, got piece ", piece.scalar_type(), piece.sizes(), " and full ",
              full.scalar_type(), full.sizes());
}
}  // namespace

PendingCollective start_all_gather_flat(const at::Tensor& piece, const at::Tensor& out,
                                        const DeviceMesh& mesh, int64_t mesh_dim) {
  check_flat(piece, out, mesh, mesh_dim, "start_all_gather_flat");
  const int64_t d = mesh.size(mesh_dim);
  std::vector<int64_t> bytes(static_cast<size_t>(d), piece.numel() * piece.element_size());
  return PendingCollective(std::make_unique<transport::PendingCollective>(
      transport::start_all_gatherv(piece, out, bytes, mesh.comm(mesh_dim))));
}

PendingCollective start_reduce_scatter_flat(const at::Tensor& full, const at::Tensor& out,
                                            const DeviceMesh& mesh, int64_t mesh_dim) {
  check_flat(out, full, mesh, mesh_dim, "start_reduce_scatter_flat");
  const int64_t d = mesh.size(mesh_dim);
  std::vector<int64_t> numel(static_cast<size_t>(d), out.numel());
  return PendingCollective(std::make_unique<transport::PendingCollective>(
      transport::start_reduce_scatter(full, out, numel, ReduceOp::Sum, mesh.comm(mesh_dim))));
}

}  // namespace shardtensor::comm
