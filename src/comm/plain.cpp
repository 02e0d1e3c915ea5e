// Plain collectives (comm/plain.h): whole-tensor broadcast, all-gather and
// scatter over a mesh's communicator, for tensor/ and nn/; thin wrappers of the
// transport, so that no layer above comm/ reaches it.
#include "comm/plain.h"

#include "comm/transport.h"

namespace shardtensor::comm {

void broadcast_(const at::Tensor& t, int root, const DeviceMesh& mesh) {
  transport::broadcast_(t, root, mesh.comm());
}

void all_gather_same(const at::Tensor& mine, const at::Tensor& all, const DeviceMesh& mesh) {
  transport::all_gatherv(mine, all,
                         std::vector<int64_t>(mesh.size(), static_cast<int64_t>(mine.nbytes())),
                         mesh.comm());
}

void scatter_(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, const DeviceMesh& mesh) {
  transport::scatterv(send, send_bytes, recv, root, mesh.comm());
}

}  // namespace shardtensor::comm
