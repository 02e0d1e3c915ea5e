#pragma once
/// \file The error channel's communicator (private; Note [carried errors] in
/// comm/error_channel.h).

#include <mpi.h>

namespace shardtensor::detail {

/// Local. The library's duplicate of MPI_COMM_WORLD on which ranks carry
/// errors to each other, made by init() (collective there) and freed by
/// finalize(); MPI_COMM_NULL outside init()..finalize().
MPI_Comm error_channel();

}  // namespace shardtensor::detail
