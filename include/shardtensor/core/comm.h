#pragma once
/// \file The communicator handle: what names a group of ranks in shardtensor's
/// API and in its transport seam (Note [transport seam]).
///
/// Note [c10d-only build]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// A `Comm` names a group of ranks. With MPI (SHARDTENSOR_WITH_MPI=1, the
/// default) it is `MPI_Comm`: a real MPI communicator under the MPI transport,
/// or the handle of a c10d group under the c10d transport (Note [c10d handles]
/// in src/comm/transport_c10d.h), so that a host's MPI communicator can be
/// passed wherever a group is asked for. A c10d-only build (CMake option
/// SHARDTENSOR_WITH_MPI=OFF) has no MPI at all: `Comm` is an opaque pointer
/// to a c10d group, the library needs only torch and a compiler, mpirun
/// launches and MPI communicators are unavailable, and parallel HDF5 I/O
/// (which needs MPI-IO) raises a clear error instead. Either way a `Comm` is
/// only compared, stored and passed back to shardtensor.

#include <shardtensor/config.h>

#if SHARDTENSOR_WITH_MPI
#include <mpi.h>
#endif

namespace shardtensor {

#if SHARDTENSOR_WITH_MPI
/// A group of ranks (Note [c10d-only build]): an MPI communicator or the
/// handle of a c10d group.
using Comm = MPI_Comm;
/// Local. The handle of every process of the job: MPI_COMM_WORLD (under the
/// c10d transport it stands for the c10d world group). Never throws.
inline Comm comm_world() { return MPI_COMM_WORLD; }
/// Local. No group. Never throws.
inline Comm comm_null() { return MPI_COMM_NULL; }
#else
struct CommGroup;
/// A group of ranks (Note [c10d-only build]): the handle of a c10d group.
using Comm = CommGroup*;
/// Local. The handle of every process of the job (the c10d world group; a
/// fixed value, valid before init()). Never throws.
Comm comm_world();
/// Local. No group. Never throws.
inline Comm comm_null() { return nullptr; }
#endif

}  // namespace shardtensor
