#pragma once
/// \file Agreement: the small, non-differentiable collectives that the layers
/// above comm/ use to agree on metadata and errors. This is their one door to
/// the network besides the differentiable primitives (comm/primitives.h): no
/// layer above comm/ includes <mpi.h> or comm/transport.h for these jobs.
///
/// Note [collective discipline]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Every rank must make the same collective calls in the same order. A check
/// that depends on one rank's data (a local extent, a file that one rank
/// cannot open) must therefore not throw on that rank alone: the other ranks
/// would already be waiting in the next collective. Instead, each rank
/// computes its verdict, and check_all() turns any rank's failure into the
/// same c10::Error on every rank, carrying the failing rank's message.
/// Private to the library (not installed).

#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtensor::comm {

/// Collective over every rank of `mesh`. True on every rank iff `ok` is true
/// on every rank. One all-reduce of one int; counted in CommStats.
bool all_ok(const DeviceMesh& mesh, bool ok);

/// Collective over every rank of `mesh`. Returns normally on every rank iff
/// `ok` on every rank. Otherwise throws c10::Error on **every** rank whose
/// message is "<what>: <message of the lowest failing rank> (reported by mesh
/// rank r)", so a check that failed on one rank raises the same error
/// everywhere and no rank is left in a collective. `message` is read only
/// where `ok` is false. Costs one all-reduce when everything is ok, plus two
/// broadcasts when not.
void check_all(const DeviceMesh& mesh, bool ok, const std::string& what,
               const std::string& message = {});

/// Collective over every rank of `mesh`. Every rank's `record` in mesh-rank
/// order. Records may differ in length across ranks. Throws c10::Error on MPI
/// failure.
std::vector<std::vector<int64_t>> all_gather_records(const DeviceMesh& mesh,
                                                     const std::vector<int64_t>& record);

/// Collective over every rank of `mesh`. The `record` of mesh rank `root` on
/// every rank (other ranks' `record` is ignored; its length need not match).
std::vector<int64_t> broadcast_record(const DeviceMesh& mesh, const std::vector<int64_t>& record,
                                      int root = 0);

/// Collective over every rank of `mesh`. Element-wise max / sum of `values`
/// (same length on every rank), in place.
void all_reduce_max(const DeviceMesh& mesh, std::vector<int64_t>& values);
void all_reduce_sum(const DeviceMesh& mesh, std::vector<int64_t>& values);

/// Note [cross-rank cache agreement]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A per-process cache of something every rank builds collectively (a ghost
/// plan whose send lists depend on every rank's ids, Note [index plan cache]
/// in src/ops/graph_ops.cpp) may be reused by a rank only if every rank reuses
/// the entry of the *same* build. Each lookup therefore does one small
/// all-reduce (max) of five integers over the mesh: an error flag (the
/// caller's own check of its data: then comm::check_all raises the failing
/// rank's message on every rank), a miss flag, the entry's build stamp and
/// its negation (max and -min: all equal), and the stamp a new build would
/// take. Stamps are per-process counters made equal by that max at each
/// build; a later build of the same mesh gets a larger stamp on every rank, so
/// two different builds never agree. Unless every rank hit an entry with one
/// stamp, every rank rebuilds (collectively) and stores the new build under
/// CacheAgreement::stamp.

/// Verdict of agree_cache_reuse().
struct CacheAgreement {
  bool all_ok = true;  ///< every rank passed ok = true
  bool reuse = false;  ///< every rank hit an entry of one build: reuse it
  int64_t stamp = 0;   ///< the stamp of a new build (the same on every rank)
};

/// Collective over every rank of `mesh` (Note [cross-rank cache agreement]).
/// `hit_stamp`: the stamp of this rank's cache hit, or nullopt on a miss;
/// `next_stamp`: this process's stamp counter + 1. One all-reduce of five
/// int64, counted in CommStats. Throws c10::Error on transport failure only.
CacheAgreement agree_cache_reuse(const DeviceMesh& mesh, bool ok, std::optional<int64_t> hit_stamp,
                                 int64_t next_stamp);

/// Collective over every rank of `mesh`. Waits until every rank has arrived
/// (for tests and benchmarks that time a phase).
void barrier(const DeviceMesh& mesh);

}  // namespace shardtensor::comm
