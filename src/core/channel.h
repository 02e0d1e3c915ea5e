#pragma once
/// \file The error channel's communicator (private; Note [carried errors] in
/// comm/error_channel.h).

#include <shardtensor/core/comm.h>

#include <string>

namespace shardtensor::detail {

/// Local. The library's duplicate of MPI_COMM_WORLD on which ranks carry
/// errors to each other, made by init() (collective there) and freed by
/// finalize(); comm_null() outside init()..finalize().
Comm error_channel();

/// Local. The communicator of every process of the job: MPI_COMM_WORLD under
/// the MPI transport, the c10d world's handle under the c10d transport (Note
/// [c10d handles]). For the test harness and tools that need the whole job.
Comm world_comm();

/// Local. While one lives on this thread, record_comm() and
/// record_comm_time() count nothing: for the test harness's own agreement
/// messages, which are not the library's traffic (defined in core/stats.cpp).
class UncountedComm {
 public:
  UncountedComm();
  ~UncountedComm();
  UncountedComm(const UncountedComm&) = delete;
  UncountedComm& operator=(const UncountedComm&) = delete;
};

/// Local. The transport init() chose ("mpi" or "gloo"); empty before init().
std::string transport();

}  // namespace shardtensor::detail
