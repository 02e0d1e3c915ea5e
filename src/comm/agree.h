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

/// Collective over every rank of `mesh`. Waits until every rank has arrived
/// (for tests and benchmarks that time a phase).
void barrier(const DeviceMesh& mesh);

}  // namespace shardtensor::comm
