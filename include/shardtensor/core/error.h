#pragma once
/// \file Error handling: user errors are `c10::Error` (thrown by `TORCH_CHECK`),
/// MPI failures are turned into `c10::Error` by `SHARDTENSOR_MPI_CHECK`.

#include <c10/util/Exception.h>

#include <string>

namespace shardtensor {

/// Local. Formats an MPI error code as "<MPI error string> (code N) on world rank R".
std::string mpi_error_string(int code);

}  // namespace shardtensor

/// Calls an MPI function and throws `c10::Error` naming the call, the MPI
/// error string and the rank when it does not return MPI_SUCCESS. The
/// library's communicators use MPI_ERRORS_RETURN so that failures reach here.
#define SHARDTENSOR_MPI_CHECK(call)                                                 \
  do {                                                                              \
    int shardtensor_mpi_rc_ = (call);                                               \
    TORCH_CHECK(shardtensor_mpi_rc_ == 0 /* MPI_SUCCESS */, "MPI call ", #call,     \
                " failed: ", ::shardtensor::mpi_error_string(shardtensor_mpi_rc_)); \
  } while (0)
