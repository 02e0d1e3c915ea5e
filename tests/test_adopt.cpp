// The host application owns MPI: it calls MPI_Init and MPI_Finalize itself,
// and shardtensor::init()/finalize() adopt MPI without finalizing it. Own main
// (not the shared MPI test main), run with 2 ranks.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <shardtensor/core/error.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

namespace st = shardtensor;

namespace {

int world_rank_mpi() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

bool mpi_initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

bool mpi_finalized() {
  int flag = 0;
  MPI_Finalized(&flag);
  return flag != 0;
}

// Collective: true on every rank iff `ok` on every rank.
bool all_ranks(bool ok, MPI_Comm comm = MPI_COMM_WORLD) {
  int local = ok ? 1 : 0;
  int global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MIN, comm);
  return global == 1;
}

}  // namespace

TEST(Adopt, RejectsBadThreadCounts) {
  ASSERT_FALSE(st::is_initialized());
  for (const char* bad : {"garbage", "0", "-3", "4x", " "}) {
    setenv("SHARDTENSOR_NUM_THREADS", bad, 1);
    bool threw = false;
    try {
      st::init();
    } catch (const c10::Error& e) {
      threw = true;
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("SHARDTENSOR_NUM_THREADS"), std::string::npos) << msg;
      EXPECT_NE(msg.find(bad), std::string::npos) << msg;
    }
    EXPECT_TRUE(threw) << "SHARDTENSOR_NUM_THREADS='" << bad << "'";
    EXPECT_FALSE(st::is_initialized());
  }
  // OMP_NUM_THREADS is the fallback and is checked the same way.
  unsetenv("SHARDTENSOR_NUM_THREADS");
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string omp_saved = omp ? omp : "";
  setenv("OMP_NUM_THREADS", "-1", 1);
  EXPECT_THROW(st::init(), c10::Error);
  EXPECT_FALSE(st::is_initialized());
  // SHARDTENSOR_NUM_THREADS wins over OMP_NUM_THREADS.
  setenv("OMP_NUM_THREADS", "3", 1);
  setenv("SHARDTENSOR_NUM_THREADS", "2", 1);
  st::init();
  EXPECT_TRUE(st::is_initialized());
  EXPECT_EQ(at::get_num_threads(), 2);
  st::finalize();
  EXPECT_FALSE(st::is_initialized());
  EXPECT_TRUE(mpi_initialized() && !mpi_finalized());
  unsetenv("SHARDTENSOR_NUM_THREADS");
  if (omp) {
    setenv("OMP_NUM_THREADS", omp_saved.c_str(), 1);
  } else {
    unsetenv("OMP_NUM_THREADS");
  }
}

TEST(Adopt, InitAdoptsAndFinalizeLeavesMpiAlone) {
  MPI_Errhandler world_before = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_before);

  st::init();
  EXPECT_TRUE(st::is_initialized());
  st::init();  // idempotent
  EXPECT_TRUE(st::is_initialized());
  int provided = -1;
  MPI_Query_thread(&provided);
  EXPECT_EQ(st::mpi_thread_level(), provided);
  EXPECT_EQ(st::world_rank(), world_rank_mpi());
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && *omp) {
    EXPECT_EQ(at::get_num_threads(), std::atoi(omp));
  } else {
    EXPECT_EQ(at::get_num_threads(), 1);
  }

  // A mesh over a user communicator: one group per rank parity.
  MPI_Comm user = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank_mpi() % 2, world_rank_mpi(), &user);
  int user_size = 0;
  int user_rank = -1;
  MPI_Comm_size(user, &user_size);
  MPI_Comm_rank(user, &user_rank);
  auto mesh = st::DeviceMesh::create({-1}, {"domain"}, user);
  EXPECT_EQ(mesh.size(), user_size);
  EXPECT_EQ(mesh.rank(), user_rank);
  int sub_size = 0;
  MPI_Comm_size(mesh.comm(0), &sub_size);
  EXPECT_EQ(sub_size, user_size);
  auto world_mesh = st::DeviceMesh::create({-1});
  EXPECT_EQ(world_mesh.size(), 2);

  st::finalize();
  EXPECT_FALSE(st::is_initialized());
  st::finalize();  // idempotent
  EXPECT_FALSE(st::is_initialized());
  // MPI is still the host's and still works.
  EXPECT_TRUE(mpi_initialized());
  EXPECT_FALSE(mpi_finalized());
  int one = 1;
  int total = 0;
  EXPECT_EQ(MPI_Allreduce(&one, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(total, 2);
  total = 0;
  EXPECT_EQ(MPI_Allreduce(&one, &total, 1, MPI_INT, MPI_SUM, user), MPI_SUCCESS);
  EXPECT_EQ(total, user_size);
  // The library freed its own communicators.
  EXPECT_THROW(mesh.comm(), c10::Error);
  EXPECT_THROW(world_mesh.comm(0), c10::Error);
  EXPECT_EQ(mesh.coordinate(), std::vector<int64_t>{user_rank});  // metadata survives
  MPI_Errhandler world_after = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_after);
  EXPECT_TRUE(world_before == world_after);
  MPI_Errhandler_free(&world_before);
  MPI_Errhandler_free(&world_after);
  MPI_Comm_free(&user);

  // Adopting again after finalize() works too.
  st::init();
  EXPECT_TRUE(st::is_initialized());
  auto again = st::DeviceMesh::create({-1});
  EXPECT_EQ(again.size(), 2);
  st::finalize();
  EXPECT_TRUE(mpi_initialized() && !mpi_finalized());
  EXPECT_TRUE(all_ranks(true));
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = world_rank_mpi();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  int failed = 0;
  // A mesh still alive when the host finalizes MPI: its destructor must not call MPI.
  auto late = std::make_unique<st::DeviceMesh>(st::DeviceMesh::create({-1}));
  int global_rc = 0;
  MPI_Allreduce(&rc, &global_rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  late.reset();
  // After MPI_Finalize, init() must refuse clearly and error strings must not crash.
  try {
    st::init();
    std::fprintf(stderr, "[rank %d] init() after MPI_Finalize did not throw\n", rank);
    failed = 1;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("finalized") == std::string::npos) {
      std::fprintf(stderr, "[rank %d] unexpected message: %s\n", rank, msg.c_str());
      failed = 1;
    }
  }
  if (st::mpi_error_string(1).find("code 1") == std::string::npos) {
    std::fprintf(stderr, "[rank %d] mpi_error_string after MPI_Finalize\n", rank);
    failed = 1;
  }
  if (failed == 0 && rank == 0) {
    std::printf("post-finalize checks passed\n");
  }
  return global_rc != 0 ? global_rc : failed;
}
