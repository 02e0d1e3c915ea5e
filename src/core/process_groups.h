#pragma once
/// \file The c10d process groups under the c10d transport: the world group
/// and the sub-groups of meshes (Note [c10d handles] in comm/transport_c10d.h).
/// Private to the library. This is the c10d counterpart of MPI_Init and
/// MPI_Comm_split: the runtime starts the world here, DeviceMesh splits it,
/// and only comm/ moves data over the groups.

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace shardtensor::detail::pg {

/// Local. True while the process runs on the c10d transport (between
/// start_world() and stop_world()).
bool active();

/// Local. True when `comm` is a handle of a live c10d group.
bool owns(MPI_Comm comm);

/// Collective over every process of the launch: connects to the rendezvous
/// store at addr:port (rank 0 serves it unless `agent_store`: torchrun's
/// agent serves it) and makes the Gloo world group, bounded by `timeout_s`
/// seconds (0: Gloo's default). Throws c10::Error naming the address if the
/// store or the group cannot be made.
void start_world(int rank, int size, const std::string& addr, int port, bool agent_store,
                 double timeout_s);

/// Local. Drops every group (no communication). Never throws.
void stop_world() noexcept;

/// Local. The world group's handle; MPI_COMM_NULL when not active().
MPI_Comm world();

/// Local. The rendezvous store (under the prefix `shardtensor/`), for the
/// error channel over c10d (Note [carried errors]) and the flight recorder's
/// notices (Note [flight recorder]); nullptr when not active(). Valid until
/// stop_world().
::c10d::Store* store();

/// Local. Size of and this process's rank in a c10d group. Throw if `comm`
/// is not one.
int size(MPI_Comm comm);
int rank(MPI_Comm comm);
/// Local. World rank of each rank of the group, in group rank order.
const std::vector<int>& world_ranks(MPI_Comm comm);
/// Local. The group's name, for messages.
std::string name(MPI_Comm comm);
/// Local. The group's c10d object (owned here; valid while the group lives).
::c10d::ProcessGroup& process_group(MPI_Comm comm);

/// Collective over the ranks of `parent` that are listed in `members` (group
/// ranks of `parent`, including this rank): the group of those ranks. Every
/// rank of `parent` calls split() the same number of times in the same order
/// (Note [collective discipline]), each with the member list of its own
/// group. `what` names it in messages.
///
/// Note [c10d group reuse]
/// ~~~~~~~~~~~~~~~~~~~~~~~
/// Making a Gloo group connects every pair of its members (and Gloo sometimes
/// waits 5 s in that rendezvous), so meshes do not make a group each: a
/// `shared` group is made once per set of world ranks and returned to every
/// later request for the same set, living until stop_world(); free_group()
/// leaves it alone. Sharing is safe because ranks issue operations on a group
/// in the same order whatever mesh they come from (Note [collective
/// discipline]). A group that must not share its message stream (a
/// duplicate, transport::duplicate()) passes shared = false and gets a new one.
/// Throws c10::Error if this rank is not listed, a rank is out of range, or
/// Gloo fails.
MPI_Comm split(MPI_Comm parent, std::vector<int> members, const std::string& what,
               bool shared = true);

/// Local. Releases a group made by split() (not a shared one, which lives
/// until stop_world()) and sets the handle to MPI_COMM_NULL. Does nothing for MPI_COMM_NULL. Never
/// throws.
void free_group(MPI_Comm& comm) noexcept;

/// Local. Groups made by split() and not yet freed (shared ones included).
int64_t live_groups();

}  // namespace shardtensor::detail::pg
