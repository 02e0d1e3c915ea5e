#pragma once
/// \file Process-wide runtime: MPI initialization and the thread policy.

namespace shardtensor {

/// Collective over MPI_COMM_WORLD (MPI_Init_thread). Idempotent. If MPI is
/// already initialized by the host application it is adopted and left alone:
/// its communicators and error handlers are not touched, and finalize() will
/// not finalize it. Sets libtorch's intra-op threads to 1 per rank unless
/// `SHARDTENSOR_NUM_THREADS` or `OMP_NUM_THREADS` says otherwise.
/// Throws c10::Error if MPI cannot be initialized or was already finalized.
void init(int* argc = nullptr, char*** argv = nullptr);

/// Collective. Frees the library's communicators and finalizes MPI only if
/// init() started it. Idempotent; a no-op if init() was never called.
void finalize();

/// Local. True between init() and finalize().
bool is_initialized();

/// Local. This process's rank and the size of MPI_COMM_WORLD. Throw if MPI is not initialized.
int world_rank();
int world_size();

/// Local. The MPI thread level actually provided (MPI_THREAD_*).
int mpi_thread_level();

/// Ends the whole job now (every rank of MPI_COMM_WORLD) with exit code
/// `code`: MPI_Abort if MPI is initialized and not finalized, otherwise
/// std::_Exit. Flushes stdout and stderr first. For fatal errors on one rank
/// (e.g. an uncaught Python exception) where the other ranks may be waiting in
/// a collective and MPI_Finalize would hang. Not collective; never returns.
[[noreturn]] void abort(int code);

/// RAII wrapper around init()/finalize(). Collective on construction and destruction.
class Runtime {
 public:
  Runtime(int* argc, char*** argv);
  Runtime() : Runtime(nullptr, nullptr) {}
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
};

}  // namespace shardtensor
