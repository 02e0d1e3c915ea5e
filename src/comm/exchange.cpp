// Split-phase block exchange (comm/exchange.h) over the transport's
// start_exchange on the mesh's communicator.
#include "comm/exchange.h"

#include "comm/transport.h"

namespace shardtensor::comm {

BlockExchange start_block_exchange(const DeviceMesh& mesh, const std::vector<PeerBlock>& sends,
                                   const std::vector<PeerBlock>& recvs, int tag) {
  if (sends.empty() && recvs.empty()) return BlockExchange();
  std::vector<transport::PeerBuffer> s, r;
  s.reserve(sends.size());
  r.reserve(recvs.size());
  for (const auto& b : sends) s.push_back({b.peer, b.buffer});
  for (const auto& b : recvs) r.push_back({b.peer, b.buffer});
  return BlockExchange(std::make_unique<transport::PendingExchange>(
      transport::start_exchange(s, r, mesh.comm(), tag)));
}

}  // namespace shardtensor::comm
