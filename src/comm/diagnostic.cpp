// The SHARDTENSOR_DEBUG agreement (comm/diagnostic.h): one uncounted max
// all-reduce of (hi, lo, -hi, -lo, failed) gives both the max and the min of
// the fingerprint's two halves, which are equal iff every rank agrees.
#include "comm/diagnostic.h"

#include <vector>

#include "comm/transport.h"

namespace shardtensor::comm {

Agreement diagnostic_agree(Comm comm, uint64_t fingerprint, bool ok) {
  Agreement a;
  a.all_ok = ok;
  if (transport::comm_size(comm) == 1) return a;
  const auto hi = static_cast<int64_t>(fingerprint >> 32);
  const auto lo = static_cast<int64_t>(fingerprint & 0xffffffffu);
  std::vector<int64_t> v = {hi, lo, -hi, -lo, ok ? 0 : 1};
  transport::diagnostic_max_(v, comm);
  a.same = v[0] == -v[2] && v[1] == -v[3];
  a.all_ok = v[4] == 0;
  return a;
}

Agreement diagnostic_agree(const DeviceMesh& mesh, uint64_t fingerprint, bool ok) {
  return diagnostic_agree(mesh.comm(), fingerprint, ok);
}

}  // namespace shardtensor::comm
