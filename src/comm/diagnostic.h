#pragma once
/// \file The SHARDTENSOR_DEBUG agreement (private): do all ranks make the same
/// call? Uncounted, so CommStats are the same with and without
/// SHARDTENSOR_DEBUG (Note [traffic accounting]). The switch itself is
/// detail::debug_enabled() (core/debug.h); fingerprints are FNV-1a
/// (core/fingerprint.h), identical on every rank.

#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>

namespace shardtensor::comm {

/// Verdict of diagnostic_agree().
struct Agreement {
  bool same = true;    ///< every rank passed the same fingerprint
  bool all_ok = true;  ///< every rank passed ok = true
};

/// Collective over every rank of `mesh` (uncounted; one all-reduce of 5 int64
/// values). Whether every rank passed the same `fingerprint`, and whether
/// every rank passed `ok`. Local (everything true) on a mesh of one rank.
Agreement diagnostic_agree(const DeviceMesh& mesh, uint64_t fingerprint, bool ok = true);

/// The same over an explicit communicator of the mesh (mesh.comm(dim) or a
/// sub-communicator of several dims); for comm/ itself.
Agreement diagnostic_agree(Comm comm, uint64_t fingerprint, bool ok = true);

}  // namespace shardtensor::comm
