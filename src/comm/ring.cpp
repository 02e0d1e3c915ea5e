// Split-phase ring shift (see comm/ring.h).
#include "comm/ring.h"

#include <ATen/ATen.h>

namespace shardtensor::comm {

RingShift RingShift::start(const at::Tensor& send, c10::IntArrayRef recv_shape,
                           const DeviceMesh& mesh, int64_t mesh_dim, int tag) {
  RingShift r;
  const int64_t p = mesh.size(mesh_dim);
  if (p == 1) {
    r.recv_ = send;
    return r;
  }
  Comm comm = mesh.comm(mesh_dim);
  const int me = transport::comm_rank(comm);
  const int next = static_cast<int>((me + 1) % p);
  const int prev = static_cast<int>((me + p - 1) % p);
  r.send_ = transport::send_buffer(send);
  r.recv_ = at::empty(recv_shape, send.options().memory_format(at::MemoryFormat::Contiguous));
  r.pending_ = transport::start_exchange({transport::PeerBuffer{next, r.send_}},
                                         {transport::PeerBuffer{prev, r.recv_}}, comm, tag);
  return r;
}

at::Tensor RingShift::finish() {
  pending_.finish();
  send_ = at::Tensor();
  return std::move(recv_);
}

}  // namespace shardtensor::comm
