#pragma once
/// \file Running shardtensor on a c10d process group the host already runs
/// (Note [adopted process group] in src/core/process_groups.h). Not included by
/// shardtensor/shardtensor.h: include it where a torch.distributed group is
/// handed over.

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace shardtensor {

/// Collective over every rank of `group`. Starts shardtensor on a c10d process
/// group the host already runs (torch.distributed's default group, or one from
/// new_group) instead of its own MPI or Gloo start: the group's ranks become
/// the world, meshes split it, and no rendezvous address is needed. The host
/// keeps the group; finalize() only drops shardtensor's reference. Sets the
/// thread policy as init() does. Idempotent for the same group. Throws
/// c10::Error if shardtensor already runs on anything else, or if Gloo
/// cannot connect the members through the group's store.
void init(const c10::intrusive_ptr<::c10d::ProcessGroup>& group);

}  // namespace shardtensor
