// Launcher detection (Note [launcher detection], src/core/launch.cpp) over
// synthetic environments, without MPI. Own main: `test_launch --init` instead
// calls shardtensor::init() and exits 3 with the error on stderr, so that
// tests/launch_check.py can start it the way torchrun does (issue 24).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <shardtensor/core/launch.h>
#include <shardtensor/core/runtime.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace st = shardtensor;

namespace {

using Env = std::map<std::string, std::string>;

st::EnvLookup lookup(const Env& env) {
  return [env](const char* name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

st::LaunchInfo detect(const Env& env) { return st::detect_launch(lookup(env)); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' lacks '" << part << "'";
}

const Env kTorchrun = {{"RANK", "2"},         {"WORLD_SIZE", "4"},
                       {"LOCAL_RANK", "2"},   {"LOCAL_WORLD_SIZE", "4"},
                       {"MASTER_ADDR", "h0"}, {"MASTER_PORT", "29500"}};
const Env kSlurm = {{"SLURM_PROCID", "5"},
                    {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "4"}};
const Env kOpenMpi = {{"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "3"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                      {"PMIX_RANK", "1"}};
const Env kPmi = {{"PMI_RANK", "3"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "0"}};

Env merge(Env a, const Env& b) {
  for (const auto& kv : b) a[kv.first] = kv.second;
  return a;
}

}  // namespace

TEST(DetectLaunch, NoLauncherIsAWorldOfOne) {
  const auto info = detect({});
  EXPECT_EQ(info.launcher, "none");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, -1);
  EXPECT_FALSE(info.mpi_launcher);
  // Empty values count as unset.
  EXPECT_EQ(detect({{"RANK", ""}, {"WORLD_SIZE", ""}}).launcher, "none");
}

TEST(DetectLaunch, EachLauncher) {
  auto t = detect(kTorchrun);
  EXPECT_EQ(t.launcher, "torchrun");
  EXPECT_EQ(t.size_variable, "WORLD_SIZE");
  EXPECT_EQ(t.rank, 2);
  EXPECT_EQ(t.world_size, 4);
  EXPECT_EQ(t.local_rank, 2);
  EXPECT_EQ(t.local_world_size, 4);
  EXPECT_FALSE(t.mpi_launcher);

  auto s = detect(kSlurm);
  EXPECT_EQ(s.launcher, "slurm");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_FALSE(s.mpi_launcher);
  // Heterogeneous "2(x3)" is not a number of local processes.
  EXPECT_EQ(detect(merge(kSlurm, {{"SLURM_NTASKS_PER_NODE", "2(x3)"}})).local_world_size, -1);

  auto o = detect(kOpenMpi);
  EXPECT_EQ(o.launcher, "openmpi");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 3);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_world_size, 3);
  EXPECT_TRUE(o.mpi_launcher);
  // PMIx gives the rank when Open MPI's rank variable is absent.
  auto x = detect({{"PMIX_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_EQ(x.launcher, "openmpi");
  EXPECT_EQ(x.rank_variable, "PMIX_RANK");
  EXPECT_EQ(x.rank, 2);

  auto p = detect(kPmi);
  EXPECT_EQ(p.launcher, "pmi");
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.world_size, 6);
  EXPECT_EQ(p.local_rank, 0);
  EXPECT_TRUE(p.mpi_launcher);
}

TEST(DetectLaunch, PrecedenceTorchSlurmOpenMpiPmi) {
  EXPECT_EQ(detect(merge(merge(merge(kPmi, kOpenMpi), kSlurm), kTorchrun)).launcher, "torchrun");
  EXPECT_EQ(detect(merge(kPmi, kSlurm)).launcher, "slurm");
  // mpirun inside sbatch: the batch step's SLURM_PROCID=0/SLURM_NTASKS stay in every
  // process's environment; Open MPI's own numbers win.
  EXPECT_EQ(detect(merge(merge(kPmi, kOpenMpi), kSlurm)).launcher, "openmpi");
  EXPECT_EQ(detect(merge(kPmi, kOpenMpi)).launcher, "openmpi");
  // srun --mpi=pmi2: Slurm's numbers, and an MPI process manager is present.
  auto s = detect(merge(kSlurm, {{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}}));
  EXPECT_EQ(s.launcher, "slurm");
  EXPECT_TRUE(s.mpi_launcher);
  // torch's variables under mpirun (exported by init(), DeepSpeed, a user).
  auto t = detect(merge(kOpenMpi, {{"RANK", "1"}, {"WORLD_SIZE", "3"}}));
  EXPECT_EQ(t.launcher, "torchrun");
  EXPECT_TRUE(t.mpi_launcher);
}

TEST(DetectLaunch, MalformedValuesThrowNamingTheVariable) {
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kTorchrun, {{"WORLD_SIZE", "four"}}));
                       }),
                       "WORLD_SIZE='four' is not an integer"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kTorchrun, {{"RANK", "1x"}}));
                       }),
                       "RANK='1x' is not an integer"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kSlurm, {{"SLURM_NTASKS", "99999999999999999999"}}));
                       }),
                       "SLURM_NTASKS='99999999999999999999' is not an integer"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kTorchrun, {{"WORLD_SIZE", "0"}}));
                       }),
                       "WORLD_SIZE=0 is not a positive number of processes"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kTorchrun, {{"RANK", "4"}}));
                       }),
                       "RANK=4 is outside [0, 4)"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kPmi, {{"PMI_RANK", "-1"}}));
                       }),
                       "PMI_RANK=-1 is outside [0, 6)"));
  EXPECT_TRUE(contains(error_of([] {
                         detect({{"RANK", "0"}});
                       }),
                       "torchrun's WORLD_SIZE is unset but RANK is set"));
  EXPECT_TRUE(contains(error_of([] {
                         detect({{"OMPI_COMM_WORLD_SIZE", "2"}});
                       }),
                       "openmpi's PMIX_RANK is unset but OMPI_COMM_WORLD_SIZE is set"));
  EXPECT_TRUE(contains(error_of([] {
                         detect(merge(kTorchrun, {{"LOCAL_RANK", "-2"}}));
                       }),
                       "LOCAL_RANK=-2 is negative"));
  // A malformed variable of a later launcher is not read once an earlier one matched.
  EXPECT_EQ(detect(merge(kTorchrun, {{"PMI_SIZE", "x"}})).launcher, "torchrun");
}

TEST(ResolveTransport, MpiLaunchesAndWorldsOfOne) {
  for (const Env& env : {Env{}, kSlurm, kOpenMpi, kPmi, merge(kOpenMpi, kTorchrun)}) {
    EXPECT_EQ(st::resolve_transport(detect(env), lookup(env)), "mpi");
  }
  // torchrun --nproc-per-node 1 is a torchrun launch too: one process on Gloo.
  const Env one{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  EXPECT_EQ(st::resolve_transport(detect(one), lookup(one)), "gloo");
}

TEST(ResolveTransport, TorchrunOnlyLaunchUsesGloo) {
  // torch's variables without an MPI process manager: the c10d transport
  // (Note [c10d handles]), so no process runs alone.
  EXPECT_EQ(st::resolve_transport(detect(kTorchrun), lookup(kTorchrun)), "gloo");
}

TEST(ResolveTransport, BackendOverride) {
  for (const char* t : {"mpi", "gloo"}) {
    for (const Env& base : {Env{}, kOpenMpi, kTorchrun}) {
      const Env env = merge(base, {{"SHARDTENSOR_BACKEND", t}});
      EXPECT_EQ(st::resolve_transport(detect(env), lookup(env)), t);
    }
  }
  for (const Env& base : {Env{}, kOpenMpi, kTorchrun}) {
    const Env env = merge(base, {{"SHARDTENSOR_BACKEND", "nccl"}});
    const std::string e = error_of([&] { st::resolve_transport(detect(env), lookup(env)); });
    EXPECT_TRUE(contains(e,
                         "SHARDTENSOR_BACKEND=nccl asks for NCCL, which this build does not "
                         "have yet"));
    EXPECT_TRUE(contains(e, "SHARDTENSOR_BACKEND=gloo"));
  }
  for (const char* bad : {"MPI", "ucc", " mpi"}) {
    const Env env = merge(kOpenMpi, {{"SHARDTENSOR_BACKEND", bad}});
    const std::string e = error_of([&] { st::resolve_transport(detect(env), lookup(env)); });
    EXPECT_TRUE(contains(e, std::string("SHARDTENSOR_BACKEND='") + bad +
                                "' is not one of the accepted values mpi, gloo, nccl"));
  }
  // An empty override is no override.
  const Env empty = merge(kOpenMpi, {{"SHARDTENSOR_BACKEND", ""}});
  EXPECT_EQ(st::resolve_transport(detect(empty), lookup(empty)), "mpi");
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--init") == 0) {
    try {
      st::init(&argc, &argv);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s\n", e.what_without_backtrace());
      return 3;
    }
    std::printf("shardtensor::init: rank %d of %d\n", st::world_rank(), st::world_size());
    std::fflush(stdout);
    st::finalize();
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
