// Non-blocking sums on a private duplicate communicator (comm/async_reduce.h),
// over the transport's start_all_reduce_.
#include "comm/async_reduce.h"

#include "comm/transport.h"

namespace shardtensor::comm {

ReduceChannel::ReduceChannel(const DeviceMesh& mesh) : comm_(transport::duplicate(mesh.comm())) {}

ReduceChannel::~ReduceChannel() { transport::free_duplicate(comm_); }

PendingSum ReduceChannel::start_sum_(const at::Tensor& t) {
  return PendingSum(std::make_unique<transport::PendingReduce>(
      transport::start_all_reduce_(t, ReduceOp::Sum, comm_)));
}

}  // namespace shardtensor::comm
