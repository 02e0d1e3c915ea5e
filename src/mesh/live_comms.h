#pragma once
// Private to the library (tests include it): how many MPI communicators the
// library holds, so that a long run can assert the number stays constant
// (issue 15, "long runs stay flat").
#include <cstdint>

namespace shardtensor::detail {
/// Local. Communicators owned by live DeviceMeshes: each mesh's Cartesian
/// communicator, its per-dim communicators and the cached sub-meshes'.
int64_t live_mesh_communicators();
}  // namespace shardtensor::detail
