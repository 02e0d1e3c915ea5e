#pragma once
/// \file Process-wide runtime: MPI initialization and the thread policy.

#include <string>

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

/// Local. This process's rank among the processes of its node: the
/// launcher's LOCAL_RANK (torchrun, Slurm, Open MPI/PMIx), else the node-local
/// rank that init() took from MPI under mpirun and exported as LOCAL_RANK;
/// 0 for a single process. It picks each rank's GPU (DeviceMesh::device()).
/// Throws if shardtensor is not initialized or LOCAL_RANK is not a number.
int local_rank();

/// Local. The MPI thread level actually provided (MPI_THREAD_*).
int mpi_thread_level();

/// Whether the MPI library reads and writes CUDA device memory itself, and
/// how that was decided (Note [CUDA-aware MPI] in src/comm/transport_mpi.cpp).
struct MpiCudaSupport {
  bool aware = false;
  /// One sentence, e.g. "Open MPI was built without CUDA support
  /// (MPIX_CUDA_AWARE_SUPPORT is 0 in mpi-ext.h)" or
  /// "SHARDTENSOR_MPI_CUDA_AWARE=1".
  std::string reason;
};

/// Local. SHARDTENSOR_MPI_CUDA_AWARE=1 or 0 decides; otherwise Open MPI is
/// asked (MPIX_CUDA_AWARE_SUPPORT at build time, MPIX_Query_cuda_support()
/// at run time, once MPI is initialized); any other MPI, or a build without
/// MPI, is not CUDA-aware. The answer is kept once MPI is initialized. When
/// it is aware, the MPI transport hands CUDA buffers to MPI without host
/// copies. Throws c10::Error if SHARDTENSOR_MPI_CUDA_AWARE is set to anything
/// but 0 or 1.
MpiCudaSupport mpi_cuda_support();

/// Ends the whole job now (every rank of MPI_COMM_WORLD) with exit code
/// `code`: MPI_Abort if MPI is initialized and not finalized, otherwise
/// std::_Exit. Flushes stdout and stderr first. For fatal errors on one rank
/// (e.g. an uncaught Python exception) where the other ranks may be waiting in
/// a collective and MPI_Finalize would hang. Not collective; never returns.
[[noreturn]] void abort(int code);
/// Note [watchdog]
/// ~~~~~~~~~~~~~~~
/// Every blocking wait of the transport (collectives, split-phase exchanges,
/// ring steps, the gradient reducer's pending all-reduces) polls its MPI
/// requests against a deadline instead of blocking forever. When a wait
/// exceeds the timeout, the rank prints one line to stderr naming the op being
/// run (see OpLabel), the transport primitive and MPI call, the communicator
/// (its name, e.g. the mesh dim, its size and this rank's place in it), the
/// peers still outstanding for point-to-point waits, and how long it waited,
/// then ends the whole job with MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode),
/// so that `mpirun`/`srun` return promptly instead of burning an allocation.
/// For an MPI collective, which ranks never joined it comes from the wait
/// board (src/core/wait_board.h): a store beside MPI on which waits longer
/// than min(1 s, 5 % of the timeout) post their call; after a short grace
/// every rank in the call prints the members that did not post it (Note
/// [flight recorder], src/comm/flight_recorder.h, says what is exact), then
/// the first MPI_Abort ends the job.
/// Typical causes: a rank raised an error (or exited) between collectives that
/// the others entered, or ranks called collectives in different orders.
/// The timeout is read from the environment variable `SHARDTENSOR_TIMEOUT`
/// (seconds, default 600, 0 disables the watchdog) the first time it is
/// needed, and set_timeout() overrides it at any time.

/// Exit code of a job ended by the watchdog (MPI_Abort's error code; mpirun
/// returns it). Distinct from timeout(1)'s 124.
constexpr int kWatchdogExitCode = 85;

/// Local. Sets the watchdog timeout in seconds for every later wait of this
/// process (0 disables the watchdog: waits block as long as MPI does). Set the
/// same value on every rank. Throws c10::Error if `seconds` is negative or not
/// finite.
void set_timeout(double seconds);

/// Local. The current watchdog timeout in seconds (0 = disabled): the last
/// set_timeout(), else `SHARDTENSOR_TIMEOUT`, else 600. Throws c10::Error if
/// `SHARDTENSOR_TIMEOUT` is not a non-negative number.
double timeout();

/// Local. RAII label of the operation this thread is running (e.g.
/// "aten::conv2d"), named in watchdog messages. Scopes nest; the innermost
/// label is reported. `label` must outlive the scope (a string literal or an
/// op schema's name).
class OpLabel {
 public:
  explicit OpLabel(const char* label);
  ~OpLabel();
  OpLabel(const OpLabel&) = delete;
  OpLabel& operator=(const OpLabel&) = delete;
  /// Local. The innermost label of this thread, or "" if none.
  static const char* current();

 private:
  const char* previous_;
};

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
