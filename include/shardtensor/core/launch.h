#pragma once
/// \file Launcher detection (Note [launcher detection]): which launcher started
/// this process, and how many processes it says there are.

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtensor {

/// What the environment says about this launch. `launcher` is one of
/// "torchrun", "slurm", "openmpi", "pmi" or "none" (no launcher variables: a
/// world of one). rank/world_size come from the variables named in
/// rank_variable/size_variable; local_rank/local_world_size are -1 when the
/// launcher does not give them.
struct LaunchInfo {
  std::string launcher = "none";
  std::string rank_variable;
  std::string size_variable;
  int rank = 0;
  int world_size = 1;
  int local_rank = -1;
  int local_world_size = -1;
  /// An MPI process manager started this process (Open MPI, PMIx or PMI
  /// variables are set), so MPI_Init joins the other processes.
  bool mpi_launcher = false;
};

/// Looks up one environment variable; std::nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const char*)>;

/// Local. Detects the launcher from `env`, in this order (PhysicsNeMo's
/// DistributedManager order): torchrun's RANK/WORLD_SIZE (LOCAL_RANK,
/// LOCAL_WORLD_SIZE), Slurm's SLURM_PROCID/SLURM_NTASKS (SLURM_LOCALID,
/// SLURM_NTASKS_PER_NODE), Open MPI's OMPI_COMM_WORLD_RANK/SIZE (LOCAL_RANK,
/// LOCAL_SIZE; PMIX_RANK for the rank under PMIx), PMI's PMI_RANK/PMI_SIZE
/// (MPICH/Hydra's MPI_LOCALRANKID). A launcher counts when its rank and size
/// variables are both set; an empty variable counts as unset.
/// Throws c10::Error naming the variable if a value is not an integer, a size
/// is < 1, a rank is outside [0, size), or only one of a rank/size pair is set.
LaunchInfo detect_launch(const EnvLookup& env);

/// Local. This process's environment (std::getenv) as an EnvLookup. Does not throw.
EnvLookup process_env();

/// Local. detect_launch() over this process's environment (std::getenv).
LaunchInfo detect_launch();

/// Local. The transport for this launch: "gloo" (the c10d transport, Note
/// [c10d handles]) for a torchrun launch (torch's variables and no MPI process
/// manager), else "mpi". `SHARDTENSOR_BACKEND` (read through `env`) overrides
/// the choice: "mpi" or "gloo" (under an MPI launcher, gloo keeps MPI up for
/// the host and runs the library's groups on Gloo). Throws c10::Error if it
/// is "nccl" (not in this build yet) or any other value (names the variable
/// and the accepted values).
std::string resolve_transport(const LaunchInfo& info, const EnvLookup& env);

/// Local. The transport init() chose: "mpi" or "gloo" (the c10d transport,
/// which the environment alone no longer tells once MPI was initialized by a
/// host, e.g. an mpi4py singleton); empty outside init()..finalize(). Does not throw.
std::string current_transport();

/// Local. The variables init() exported under an MPI launch (torch's RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, each
/// only where it was unset), so that torch.distributed.init_process_group
/// works under mpirun too; empty before init() or when nothing was exported.
/// Does not throw.
std::vector<std::pair<std::string, std::string>> exported_launch_env();

}  // namespace shardtensor
