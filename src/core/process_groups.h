#pragma once
/// \file The c10d process groups under the c10d transport: the world group
/// and the sub-groups of meshes (Note [c10d handles] in comm/transport_c10d.h).
/// Private to the library. This is the c10d counterpart of MPI_Init and
/// MPI_Comm_split: the runtime starts the world here, DeviceMesh splits it,
/// and only comm/ moves data over the groups.

#include <c10/util/intrusive_ptr.h>
#include <shardtensor/core/comm.h>

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
bool owns(Comm comm);

/// Collective over every process of the launch: connects to the rendezvous
/// store at addr:port (rank 0 serves it unless `agent_store`: torchrun's
/// agent serves it) and makes the Gloo world group, bounded by `timeout_s`
/// seconds (0: Gloo's default). Throws c10::Error naming the address if the
/// store or the group cannot be made.
void start_world(int rank, int size, const std::string& addr, int port, bool agent_store,
                 double timeout_s);

/// Note [adopted process group]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A host that already runs torch.distributed hands shardtensor its group
/// (Python: torch.distributed's initialized default group is adopted at the
/// first call, or `shardtensor.init(process_group=g)` for a group from
/// new_group; C++: `shardtensor::init(group)`), as a host's MPI is adopted:
/// no second rendezvous and no MASTER_ADDR. The group's members, in its rank
/// order, become shardtensor's world, and its store is the rendezvous:
/// shardtensor makes its Gloo world over the members through that store
/// (keys under `shardtensor/<group name>/`), and meshes' groups are made the
/// same way under their names (split()), so meshes, carried errors and the
/// flight recorder work unchanged. ProcessGroup::splitGroup is not used there:
/// on the host's own Gloo group it returned on one rank and left the other
/// waiting, and on a world made over a host's store it crashed in
/// ProcessGroupGloo::split (torch 2.13, 1 and 2 ranks). The host's group carries
/// none of shardtensor's traffic, so any backend will do; the host keeps it,
/// and stop_world() drops only shardtensor's reference.
///
/// Collective over every rank of `group` (Gloo's rendezvous through its
/// store). Throws c10::Error if the world is already started or Gloo fails.
void adopt_world(const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s);

/// Local. True when the running world is `group` (adopt_world()).
bool is_world(const ::c10d::ProcessGroup* group);

/// Local. Drops every group (no communication). Never throws.
void stop_world() noexcept;

/// Local. The world group's handle; comm_null() when not active().
Comm world();

/// Local. The rendezvous store (under the prefix `shardtensor/`), for the
/// error channel over c10d (Note [carried errors]) and the flight recorder's
/// notices (Note [flight recorder]); nullptr when not active(). Valid until
/// stop_world().
::c10d::Store* store();

/// Local. Size of and this process's rank in a c10d group. Throw if `comm`
/// is not one.
int size(Comm comm);
int rank(Comm comm);
/// Local. World rank of each rank of the group, in group rank order.
const std::vector<int>& world_ranks(Comm comm);
/// Local. The group's name, for messages.
std::string name(Comm comm);
/// Local. The group's c10d object (owned here; valid while the group lives).
::c10d::ProcessGroup& process_group(Comm comm);

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
Comm split(Comm parent, std::vector<int> members, const std::string& what, bool shared = true);

/// Local. Releases a group made by split() (not a shared one, which lives
/// until stop_world()) and sets the handle to comm_null(). Does nothing for comm_null(). Never
/// throws.
void free_group(Comm& comm) noexcept;

/// Local. Groups made by split() and not yet freed (shared ones included).
int64_t live_groups();

}  // namespace shardtensor::detail::pg
