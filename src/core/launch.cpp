#include <c10/util/Exception.h>
#include <shardtensor/core/launch.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

namespace shardtensor {

// Note [launcher detection]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A process learns how many siblings it has from its launcher's environment
// variables, checked in PhysicsNeMo DistributedManager's order: torch's
// (torchrun, or any launcher that exports RANK/WORLD_SIZE, as DeepSpeed and
// init() do under mpirun), Slurm's, Open MPI's (and PMIx's PMIX_RANK), PMI's
// (MPICH/Hydra). MPI is the only transport in this build, so the answer is a
// check, not a choice: init() compares it with MPI_COMM_WORLD, and a launch
// that says N > 1 processes but gets an MPI world of one (torchrun, or srun
// without PMI) is an error on every process instead of N silent copies
// (issue 24). A torchrun-only launch fails before MPI_Init: it needs the c10d
// transport (Gloo/NCCL), which is not in this build yet. `mpi_launcher` says
// whether an MPI process manager started the process at all. One exception to
// the order: `mpirun` inside a Slurm allocation (sbatch) leaves the batch
// step's SLURM_PROCID/SLURM_NTASKS in every process's environment, so when
// Open MPI's OMPI_COMM_WORLD_SIZE is set, Open MPI's numbers win over Slurm's.

namespace {

std::optional<std::string> lookup(const EnvLookup& env, const char* name) {
  auto v = env(name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

int parse_int(const std::string& value, const char* name) {
  errno = 0;
  char* end = nullptr;
  const long n = std::strtol(value.c_str(), &end, 10);
  while (end != nullptr && (*end == ' ' || *end == '\t' || *end == '\n')) ++end;
  TORCH_CHECK(errno == 0 && end != value.c_str() && end != nullptr && *end == '\0' &&
                  n >= INT_MIN && n <= INT_MAX,
              "shardtensor::detect_launch: environment variable ", name, "='", value,
              "' is not an integer");
  return static_cast<int>(n);
}

std::optional<int> get_int(const EnvLookup& env, const char* name) {
  auto v = lookup(env, name);
  if (!v) return std::nullopt;
  return parse_int(*v, name);
}

struct Scheme {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* alt_rank;  // used for the rank when `rank` is unset (PMIx)
  const char* local_rank;
  const char* local_size;
};

}  // namespace

LaunchInfo detect_launch(const EnvLookup& env) {
  static const Scheme schemes[] = {
      {"torchrun", "RANK", "WORLD_SIZE", nullptr, "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", nullptr, "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"pmi", "PMI_RANK", "PMI_SIZE", nullptr, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
  };
  LaunchInfo info;
  info.mpi_launcher = lookup(env, "OMPI_COMM_WORLD_SIZE") || lookup(env, "OMPI_COMM_WORLD_RANK") ||
                      lookup(env, "PMIX_RANK") || lookup(env, "PMI_RANK") ||
                      lookup(env, "PMI_SIZE");
  const bool open_mpi = lookup(env, "OMPI_COMM_WORLD_SIZE").has_value();
  for (const Scheme& s : schemes) {
    if (open_mpi && std::string(s.launcher) == "slurm") continue;
    const char* rank_name = s.rank;
    auto rank = get_int(env, s.rank);
    if (!rank && s.alt_rank != nullptr) {
      rank = get_int(env, s.alt_rank);
      rank_name = s.alt_rank;
    }
    auto size = get_int(env, s.size);
    if (!rank && !size) continue;
    TORCH_CHECK(rank && size, "shardtensor::detect_launch: ", s.launcher, "'s ",
                rank ? s.size : rank_name, " is unset but ", rank ? rank_name : s.size,
                " is set; set both or neither");
    TORCH_CHECK(*size >= 1, "shardtensor::detect_launch: ", s.launcher, "'s ", s.size, "=", *size,
                " is not a positive number of processes");
    TORCH_CHECK(*rank >= 0 && *rank < *size, "shardtensor::detect_launch: ", s.launcher, "'s ",
                rank_name, "=", *rank, " is outside [0, ", *size, ") (", s.size, "=", *size, ")");
    info.launcher = s.launcher;
    info.rank_variable = rank_name;
    info.size_variable = s.size;
    info.rank = *rank;
    info.world_size = *size;
    if (auto lr = get_int(env, s.local_rank)) {
      TORCH_CHECK(*lr >= 0, "shardtensor::detect_launch: ", s.launcher, "'s ", s.local_rank, "=",
                  *lr, " is negative");
      info.local_rank = *lr;
    }
    // Slurm's SLURM_NTASKS_PER_NODE may be a list ("2(x3)"); only a plain number counts.
    auto ls = lookup(env, s.local_size);
    if (ls && ls->find_first_not_of("0123456789") == std::string::npos) {
      info.local_world_size = parse_int(*ls, s.local_size);
    }
    return info;
  }
  return info;
}

EnvLookup process_env() {
  return [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

LaunchInfo detect_launch() { return detect_launch(process_env()); }

std::string resolve_transport(const LaunchInfo& info, const EnvLookup& env) {
  auto backend = lookup(env, "SHARDTENSOR_BACKEND");
#if !SHARDTENSOR_WITH_MPI
  // A c10d-only build (Note [c10d-only build]): every launch uses Gloo.
  TORCH_CHECK(!backend || *backend != "mpi",
              "shardtensor::init: SHARDTENSOR_BACKEND=mpi asks for MPI, but this shardtensor was "
              "built without MPI (SHARDTENSOR_WITH_MPI=OFF): use SHARDTENSOR_BACKEND=gloo, or "
              "a build with MPI");
  if (!backend || *backend == "gloo") return "gloo";
#endif
  if (backend) {
    if (*backend == "mpi" || *backend == "gloo") return *backend;
    TORCH_CHECK(*backend != "nccl",
                "shardtensor::init: SHARDTENSOR_BACKEND=nccl asks for NCCL, which this build "
                "does not have yet (CPU pieces only; issue 24): use SHARDTENSOR_BACKEND=gloo "
                "(torchrun's CPU transport) or mpi");
    TORCH_CHECK(false, "shardtensor::init: environment variable SHARDTENSOR_BACKEND='", *backend,
                "' is not one of the accepted values mpi, gloo, nccl");
  }
  // Note [launcher detection]: torch's variables without an MPI process
  // manager are a torchrun launch, whose transport is c10d (Gloo).
  if (info.launcher == "torchrun" && !info.mpi_launcher) return "gloo";
  return "mpi";
}

}  // namespace shardtensor
