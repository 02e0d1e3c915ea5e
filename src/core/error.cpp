#include <shardtensor/core/comm.h>
#include <shardtensor/core/error.h>

#include <string>

namespace shardtensor {

namespace {

// True when MPI calls other than MPI_Initialized/MPI_Finalized are allowed.
[[maybe_unused]] bool mpi_usable() {
  int initialized = 0;
  int finalized = 0;
#if SHARDTENSOR_WITH_MPI
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
#endif
  return initialized != 0 && finalized == 0;
}

}  // namespace

std::string mpi_error_string(int code) {
  std::string out;
#if SHARDTENSOR_WITH_MPI
  if (mpi_usable()) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, buf, &len) == MPI_SUCCESS && len > 0) {
      out.assign(buf, static_cast<size_t>(len));
    } else {
      out = "unknown MPI error";
    }
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    out += " (code " + std::to_string(code) + ") on world rank " + std::to_string(rank);
    return out;
  }
#endif
  {
    out = "MPI error (code " + std::to_string(code) +
          ") on an unknown rank (MPI is not initialized or already finalized)";
  }
  return out;
}

}  // namespace shardtensor
