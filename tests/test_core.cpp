// MPI tests of the core and mesh layers: runtime, MPI error checking,
// DeviceMesh over Cartesian communicators, and the observability counters.
#include <c10/core/CPUAllocator.h>
#include <mpi.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport.h"
#include "core/channel.h"
#include "testing.h"

namespace st = shardtensor;
using st::DeviceMesh;
using st::testing::all_ranks;
using Shape = std::vector<int64_t>;

namespace {

// The whole job's size and this rank, asked of the transport directly (not
// through the runtime under test): MPI_COMM_WORLD or the c10d world.
int world_size_mpi() { return st::comm::transport::comm_size(st::detail::world_comm()); }

int world_rank_mpi() { return st::comm::transport::comm_rank(st::detail::world_comm()); }

bool on_mpi() { return st::detail::transport() == "mpi"; }

// For tests that inspect MPI objects (Cartesian topology, error handlers,
// user communicators): the c10d transport has none (Note [c10d handles]).
#define SKIP_UNLESS_MPI_TRANSPORT()                                                           \
  do {                                                                                        \
    if (!on_mpi())                                                                            \
      GTEST_SKIP() << "inspects MPI communicators; transport is " << st::detail::transport(); \
  } while (0)

std::string shape_string(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(s[i]);
  }
  return out + "]";
}

int comm_size(MPI_Comm c) { return st::comm::transport::comm_size(c); }

int comm_rank(MPI_Comm c) { return st::comm::transport::comm_rank(c); }

// Collective over mesh.comm(). Checks everything a created mesh promises:
// the Cartesian communicator, coordinates, one sub-communicator per dim whose
// rank is the coordinate and whose members agree on the other coordinates.
void check_mesh(const DeviceMesh& mesh, const Shape& shape, MPI_Comm base) {
  SCOPED_TRACE("mesh " + mesh.to_string());
  if (base == MPI_COMM_WORLD) base = st::detail::world_comm();
  EXPECT_FALSE(mesh.is_abstract());
  EXPECT_EQ(mesh.shape(), shape);
  EXPECT_EQ(mesh.ndim(), static_cast<int64_t>(shape.size()));
  const int64_t n =
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
  EXPECT_EQ(mesh.size(), n);
  EXPECT_EQ(comm_size(mesh.comm()), n);
  // No reordering: the mesh rank is the rank in the base communicator.
  EXPECT_EQ(mesh.rank(), comm_rank(base));
  EXPECT_EQ(comm_rank(mesh.comm()), mesh.rank());
  const int nd = static_cast<int>(shape.size());
  if (on_mpi()) {
    int topo = MPI_UNDEFINED;
    MPI_Topo_test(mesh.comm(), &topo);
    EXPECT_EQ(topo, MPI_CART);
    std::vector<int> coords(nd, -1);
    MPI_Cart_coords(mesh.comm(), mesh.rank(), nd, coords.data());
    EXPECT_EQ(mesh.coordinate(), Shape(coords.begin(), coords.end()));
  }
  EXPECT_EQ(mesh.coordinate_of(mesh.rank()), mesh.coordinate());
  EXPECT_EQ(mesh.rank_of(mesh.coordinate()), mesh.rank());
  // Round trip over every rank, against MPI's own Cartesian arithmetic.
  for (int r = 0; r < n && on_mpi(); ++r) {
    const auto c = mesh.coordinate_of(r);
    std::vector<int> mc(nd, -1);
    MPI_Cart_coords(mesh.comm(), r, nd, mc.data());
    EXPECT_EQ(c, Shape(mc.begin(), mc.end())) << "rank " << r;
    EXPECT_EQ(mesh.rank_of(c), r);
    int mr = -1;
    MPI_Cart_rank(mesh.comm(), mc.data(), &mr);
    EXPECT_EQ(mr, r);
  }
  for (int d = 0; d < nd; ++d) {
    MPI_Comm sub = mesh.comm(d);
    EXPECT_EQ(comm_size(sub), shape[d]) << "mesh dim " << d;
    EXPECT_EQ(comm_rank(sub), mesh.coordinate()[d]) << "mesh dim " << d;
    EXPECT_EQ(mesh.size(d), shape[d]);
    EXPECT_EQ(mesh.comm(d - nd), sub) << "negative mesh dims wrap";
    // Members of the sub-communicator share every other coordinate: the
    // sum of the row-major "other coordinates" key is size * own key.
    long key = 0;
    for (int e = 0; e < nd; ++e) {
      key = key * 16 + (e == d ? 0 : mesh.coordinate()[e]);
    }
    at::Tensor sum = at::full({1}, static_cast<int64_t>(key), at::kLong);
    {
      st::detail::UncountedComm uncounted;
      st::comm::transport::all_reduce_(sum, st::ReduceOp::Sum, sub);
    }
    EXPECT_EQ(sum.item<int64_t>(), key * shape[d]) << "mesh dim " << d;
  }
  EXPECT_THROW(mesh.comm(nd), c10::Error);
  EXPECT_THROW(mesh.comm(-nd - 1), c10::Error);
}

// Every collective-shape mesh that fits `p` ranks, 1-D to 3-D.
std::vector<Shape> shapes_for(int p) {
  std::vector<Shape> out{{p}};
  for (int a = 1; a <= p; ++a) {
    if (p % a == 0) {
      out.push_back({a, p / a});
      for (int b = 1; b <= p / a; ++b) {
        if ((p / a) % b == 0) {
          out.push_back({a, b, p / a / b});
        }
      }
    }
  }
  return out;
}

// Collective. Expects create(shape, names) to throw a c10::Error on every
// rank whose message names the shape, the communicator size and `needles`.
void expect_bad_mesh(const Shape& shape, const std::vector<std::string>& names,
                     const std::vector<std::string>& needles, MPI_Comm comm = MPI_COMM_WORLD) {
  SCOPED_TRACE("shape " + shape_string(shape));
  // MPI_COMM_WORLD names the whole job on either transport (Note [c10d handles]).
  const MPI_Comm job = comm == MPI_COMM_WORLD ? st::detail::world_comm() : comm;
  bool threw = false;
  std::string msg;
  try {
    DeviceMesh::create(shape, names, comm);
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what_without_backtrace();
  }
  EXPECT_TRUE(threw);
  EXPECT_TRUE(all_ranks(threw)) << "some rank did not throw";
  if (threw) {
    EXPECT_NE(msg.find(shape_string(shape)), std::string::npos) << msg;
    EXPECT_NE(msg.find("communicator of size " + std::to_string(comm_size(job))), std::string::npos)
        << msg;
    for (const auto& n : names) {
      EXPECT_NE(msg.find(n), std::string::npos) << msg;
    }
    for (const auto& n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << msg;
    }
  }
  // A later collective still matches on every rank: nothing was left pending.
  at::Tensor total = at::ones({1}, at::kInt);
  {
    st::detail::UncountedComm uncounted;
    st::comm::transport::all_reduce_(total, st::ReduceOp::Sum, job);
  }
  EXPECT_EQ(total.item<int>(), comm_size(job));
}

}  // namespace

// ---- runtime -------------------------------------------------------------------

TEST(Runtime, WorldRankAndSize) {
  EXPECT_TRUE(st::is_initialized());
  EXPECT_EQ(st::world_rank(), world_rank_mpi());
  EXPECT_EQ(st::world_size(), world_size_mpi());
  if (on_mpi()) {
    int provided = -1;
    MPI_Query_thread(&provided);
    EXPECT_EQ(st::mpi_thread_level(), provided);
  }
  st::init();  // idempotent
  EXPECT_TRUE(st::is_initialized());
  EXPECT_EQ(st::world_size(), world_size_mpi());
}

TEST(Runtime, ThreadPolicy) {
  // The test environment sets OMP_NUM_THREADS=1; SHARDTENSOR_NUM_THREADS wins if set.
  int expected = 1;
  if (const char* v = std::getenv("SHARDTENSOR_NUM_THREADS"); v && *v) {
    expected = std::atoi(v);
  } else if (const char* v2 = std::getenv("OMP_NUM_THREADS"); v2 && *v2) {
    expected = std::atoi(v2);
  }
  EXPECT_EQ(at::get_num_threads(), expected);
}

// Note [OMPIO vulcan write corruption] (src/core/runtime.cpp): internal, declared here.
namespace shardtensor::detail {
std::string mpi_library_version();
bool is_open_mpi_4_1(const std::string& library_version);
bool ompio_vulcan_workaround_applied();
}  // namespace shardtensor::detail

TEST(Runtime, OmpioWorkaroundOnlyOnOpenMpi41) {
  SKIP_UNLESS_MPI_TRANSPORT();
  // The version test on the strings MPI_Get_library_version returns.
  EXPECT_TRUE(st::detail::is_open_mpi_4_1(
      "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"));
  EXPECT_TRUE(st::detail::is_open_mpi_4_1("Open MPI v4.1.8"));
  EXPECT_FALSE(st::detail::is_open_mpi_4_1(
      "Open MPI v5.0.7, package: Debian OpenMPI, ident: 5.0.7, repo rev: v5.0.7, Feb 14, 2025"));
  EXPECT_FALSE(st::detail::is_open_mpi_4_1("Open MPI v4.0.7"));
  EXPECT_FALSE(st::detail::is_open_mpi_4_1("Open MPI v4.10.0"));
  EXPECT_FALSE(st::detail::is_open_mpi_4_1("MPICH Version:      4.1.2\nMPICH Release date: ..."));
  EXPECT_FALSE(st::detail::is_open_mpi_4_1(""));

  // This process: the test main's Runtime started MPI, so init() decided. OMPI_MCA_fcoll
  // is set exactly when the library is Open MPI 4.1 and nothing overrode the choice
  // (OMPI_MCA_io, SHARDTENSOR_KEEP_OMPIO_VULCAN, or an OMPI_MCA_fcoll of the user's own).
  const std::string library = st::detail::mpi_library_version();
  const bool is41 = st::detail::is_open_mpi_4_1(library);
  const bool applied = st::detail::ompio_vulcan_workaround_applied();
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0';
  };
  const char* fcoll = std::getenv("OMPI_MCA_fcoll");
  const bool user_fcoll = set("OMPI_MCA_fcoll") && !applied;
  const bool overridden = set("OMPI_MCA_io") || set("SHARDTENSOR_KEEP_OMPIO_VULCAN") || user_fcoll;
  SCOPED_TRACE("library: " + library + "; OMPI_MCA_fcoll=" + (fcoll ? fcoll : "(unset)"));
  EXPECT_EQ(applied, is41 && !overridden);
  if (applied) {
    EXPECT_STREQ(fcoll, "dynamic");
  }
  if (!overridden) {
    EXPECT_EQ(set("OMPI_MCA_fcoll"), is41);
  }
}

// ---- errors ------------------------------------------------------------------

TEST(Error, MpiErrorString) {
  SKIP_UNLESS_MPI_TRANSPORT();
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(MPI_ERR_RANK, buf, &len);
  const std::string s = st::mpi_error_string(MPI_ERR_RANK);
  EXPECT_NE(s.find(std::string(buf, len)), std::string::npos) << s;
  EXPECT_NE(s.find("(code " + std::to_string(MPI_ERR_RANK) + ")"), std::string::npos) << s;
  EXPECT_NE(s.find("on world rank " + std::to_string(world_rank_mpi())), std::string::npos) << s;
}

TEST(Error, MpiCheckTurnsMpiErrorsIntoExceptions) {
  SKIP_UNLESS_MPI_TRANSPORT();
  auto mesh = st::testing::test_mesh();
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(MPI_ERR_RANK, buf, &len);
  const std::string rank_error(buf, len);
  // Sending to rank == size is invalid; the library's communicators return
  // the error instead of aborting, and the macro turns it into a c10::Error.
  for (MPI_Comm c : {mesh.comm(), mesh.comm(0), mesh.comm(mesh.ndim() - 1)}) {
    const int size = comm_size(c);
    int payload = 0;
    bool threw = false;
    try {
      SHARDTENSOR_MPI_CHECK(MPI_Send(&payload, 1, MPI_INT, size, 0, c));
    } catch (const c10::Error& e) {
      threw = true;
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("MPI_Send"), std::string::npos) << msg;
      EXPECT_NE(msg.find(rank_error), std::string::npos) << msg;
      EXPECT_NE(msg.find("on world rank " + std::to_string(world_rank_mpi())), std::string::npos)
          << msg;
    }
    EXPECT_TRUE(threw);
  }
  // MPI_SUCCESS passes through.
  int r = -1;
  EXPECT_NO_THROW(SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(mesh.comm(), &r)));
  EXPECT_EQ(r, mesh.rank());
  EXPECT_TRUE(all_ranks(true));
}

TEST(Error, HostErrorHandlersAreUntouched) {
  SKIP_UNLESS_MPI_TRANSPORT();
  MPI_Errhandler world_before = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_before);
  // A user communicator with a handler of its own.
  MPI_Comm user = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &user);
  MPI_Comm_set_errhandler(user, MPI_ERRORS_ARE_FATAL);
  {
    auto a = DeviceMesh::create({-1});
    auto b = DeviceMesh::create({-1}, {}, user);
    auto c = st::testing::test_mesh();
    (void)a.comm(std::vector<bool>(1, true));
    // The library's own communicators return errors.
    MPI_Errhandler lib = MPI_ERRHANDLER_NULL;
    MPI_Comm_get_errhandler(b.comm(), &lib);
    EXPECT_TRUE(lib == MPI_ERRORS_RETURN);
    MPI_Errhandler_free(&lib);
    MPI_Comm_get_errhandler(b.comm(0), &lib);
    EXPECT_TRUE(lib == MPI_ERRORS_RETURN);
    MPI_Errhandler_free(&lib);
  }
  MPI_Errhandler world_after = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_after);
  EXPECT_TRUE(world_before == world_after);
  MPI_Errhandler user_after = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(user, &user_after);
  EXPECT_TRUE(user_after == MPI_ERRORS_ARE_FATAL);
  MPI_Errhandler_free(&world_before);
  MPI_Errhandler_free(&world_after);
  MPI_Errhandler_free(&user_after);
  MPI_Comm_free(&user);
}

// ---- DeviceMesh ------------------------------------------------------------------

TEST(DeviceMesh, InfersMinusOne) {
  const int p = world_size_mpi();
  auto m = DeviceMesh::create({-1});
  EXPECT_EQ(m.shape(), Shape{p});
  check_mesh(m, {p}, MPI_COMM_WORLD);
  auto m2 = DeviceMesh::create({1, -1});
  check_mesh(m2, {1, p}, MPI_COMM_WORLD);
  auto m3 = DeviceMesh::create({-1, 1});
  check_mesh(m3, {p, 1}, MPI_COMM_WORLD);
  if (p % 2 == 0) {
    auto m4 = DeviceMesh::create({2, -1, 1});
    check_mesh(m4, {2, p / 2, 1}, MPI_COMM_WORLD);
  }
}

TEST(DeviceMesh, NamesAndDimIndex) {
  auto m = DeviceMesh::create({-1}, {"domain"});
  EXPECT_EQ(m.dim_names(), std::vector<std::string>{"domain"});
  EXPECT_EQ(m.dim_index("domain"), 0);
  bool threw = false;
  try {
    m.dim_index("nope");
  } catch (const c10::Error& e) {
    threw = true;
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("nope"), std::string::npos) << msg;
    EXPECT_NE(msg.find("domain"), std::string::npos) << msg;
  }
  EXPECT_TRUE(threw);
  auto d = DeviceMesh::create({1, -1, 1});
  EXPECT_EQ(d.dim_names(), (std::vector<std::string>{"dim0", "dim1", "dim2"}));
  EXPECT_EQ(d.dim_index("dim2"), 2);
  auto n = DeviceMesh::create({-1, 1}, {"x", "y"});
  EXPECT_EQ(n.dim_index("x"), 0);
  EXPECT_EQ(n.dim_index("y"), 1);
}

TEST(DeviceMesh, EveryShapeUpTo3D) {
  const int p = world_size_mpi();
  for (const auto& shape : shapes_for(p)) {
    auto m = DeviceMesh::create(shape);
    check_mesh(m, shape, MPI_COMM_WORLD);
  }
}

TEST(DeviceMesh, TestMesh) {
  auto m = st::testing::test_mesh();
  const int p = world_size_mpi();
  if (st::testing::is_mesh_2x2()) {
    check_mesh(m, {2, 2}, MPI_COMM_WORLD);
  } else {
    check_mesh(m, {p}, MPI_COMM_WORLD);
  }
}

TEST(DeviceMesh, OverUserCommunicator) {
  SKIP_UNLESS_MPI_TRANSPORT();
  // Two groups (even and odd world ranks); a mesh over each.
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank_mpi() % 2, world_rank_mpi(), &half);
  const int n = comm_size(half);
  {
    auto m = DeviceMesh::create({-1}, {"half"}, half);
    check_mesh(m, {n}, half);
    auto m2 = DeviceMesh::create({1, -1}, {}, half);
    check_mesh(m2, {1, n}, half);
  }
  MPI_Comm_free(&half);
}

TEST(DeviceMesh, CommKeepDims) {
  const int p = world_size_mpi();
  for (const auto& shape : shapes_for(p)) {
    if (shape.size() != 3) {
      continue;
    }
    SCOPED_TRACE("shape " + shape_string(shape));
    auto m = DeviceMesh::create(shape);
    const auto c = m.coordinate();
    EXPECT_EQ(m.comm(std::vector<bool>{true, true, true}), m.comm());
    MPI_Comm c02 = m.comm(std::vector<bool>{true, false, true});
    EXPECT_EQ(comm_size(c02), shape[0] * shape[2]);
    EXPECT_EQ(comm_rank(c02), c[0] * shape[2] + c[2]);
    EXPECT_EQ(m.comm(std::vector<bool>{true, false, true}), c02) << "cached";
    MPI_Comm c1 = m.comm(std::vector<bool>{false, true, false});
    EXPECT_EQ(comm_size(c1), shape[1]);
    EXPECT_EQ(comm_rank(c1), c[1]);
    MPI_Comm none = m.comm(std::vector<bool>{false, false, false});
    EXPECT_EQ(comm_size(none), 1);
    // Members of c02 share coordinate 1.
    const int64_t key = c[1];
    at::Tensor sum = at::full({1}, key, at::kLong);
    {
      st::detail::UncountedComm uncounted;
      st::comm::transport::all_reduce_(sum, st::ReduceOp::Sum, c02);
    }
    EXPECT_EQ(sum.item<int64_t>(), key * shape[0] * shape[2]);
    EXPECT_THROW(m.comm(std::vector<bool>{true, false}), c10::Error);
    // A copy shares the cache.
    DeviceMesh copy = m;
    EXPECT_EQ(copy.comm(std::vector<bool>{true, false, true}), c02);
  }
  auto t = st::testing::test_mesh();
  EXPECT_EQ(t.comm(std::vector<bool>(t.ndim(), true)), t.comm());
  if (t.ndim() == 2) {
    MPI_Comm c0 = t.comm(std::vector<bool>{true, false});
    EXPECT_EQ(comm_size(c0), t.size(0));
    EXPECT_EQ(comm_rank(c0), t.coordinate()[0]);
  }
}

TEST(DeviceMesh, Equality) {
  auto a = DeviceMesh::create({-1});
  auto b = DeviceMesh::create({-1});
  DeviceMesh a2 = a;
  EXPECT_TRUE(a == a2);
  EXPECT_EQ(a.comm(), a2.comm());
  EXPECT_TRUE(a != b) << "two create() calls are two meshes";
  EXPECT_TRUE(a != DeviceMesh());
  EXPECT_TRUE(a != DeviceMesh::abstract(a.shape(), a.coordinate(), a.dim_names()));
  EXPECT_FALSE(a.to_string().empty());
}

TEST(DeviceMesh, BadShapesThrowOnEveryRank) {
  const int p = world_size_mpi();
  expect_bad_mesh({-1, -1}, {}, {"-1"});
  expect_bad_mesh({0, -1}, {}, {"entry 0 is 0"});
  expect_bad_mesh({-2}, {}, {"entry 0 is -2"});
  expect_bad_mesh({p, 0}, {}, {"entry 1 is 0"});
  expect_bad_mesh({p + 1}, {}, {});
  expect_bad_mesh({p, 2}, {}, {});
  expect_bad_mesh({p + 1, -1}, {}, {});
  for (int k = 2; k < p; ++k) {
    if (p % k != 0) {  // 3 ranks: {2, -1}; 4 ranks: {3, -1}
      expect_bad_mesh({k, -1}, {}, {"not divisible by " + std::to_string(k)});
      break;
    }
  }
  expect_bad_mesh({}, {}, {});
  expect_bad_mesh({-1}, {"a", "b"}, {"expected 1 dim names"});
  expect_bad_mesh({-1, 1}, {"a"}, {"expected 2 dim names"});
  expect_bad_mesh({-1, 1}, {"same", "same"}, {"duplicate"});
  // Over a user communicator, the size in the message is that communicator's
  // (the c10d transport has no user communicators, Note [c10d handles]).
  if (!on_mpi()) return;
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank_mpi() % 2, world_rank_mpi(), &half);
  expect_bad_mesh({comm_size(half) + 1}, {"x"}, {}, half);
  MPI_Comm_free(&half);
}

// ---- observability ---------------------------------------------------------------

TEST(Stats, CommStatsCounters) {
  st::reset_comm_stats();
  auto s = st::comm_stats();
  EXPECT_EQ(s.bytes_sent, 0);
  EXPECT_EQ(s.bytes_received, 0);
  EXPECT_EQ(s.messages, 0);
  st::detail::record_comm(100, 30, 2);
  st::detail::record_comm(1, 2, 1);
  s = st::comm_stats();
  EXPECT_EQ(s.bytes_sent, 101);
  EXPECT_EQ(s.bytes_received, 32);
  EXPECT_EQ(s.messages, 3);
  // Concurrent recording from several threads loses nothing.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 10000; ++i) {
        st::detail::record_comm(1, 2, 1);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  s = st::comm_stats();
  EXPECT_EQ(s.bytes_sent, 101 + 40000);
  EXPECT_EQ(s.bytes_received, 32 + 80000);
  EXPECT_EQ(s.messages, 3 + 40000);
  st::reset_comm_stats();
  s = st::comm_stats();
  EXPECT_EQ(s.bytes_sent, 0);
  EXPECT_EQ(s.bytes_received, 0);
  EXPECT_EQ(s.messages, 0);
}

// comm_seconds: a timing (not asserted beyond its sign), zero after reset,
// and growing only through transport calls that reach another rank.
TEST(Stats, CommSecondsTimesTransportCalls) {
  auto mesh = st::DeviceMesh::create({-1});
  st::reset_comm_stats();
  EXPECT_EQ(st::comm_stats().comm_seconds, 0.0);
  st::detail::record_comm(1, 1, 1);  // byte counters do not touch the timer
  EXPECT_EQ(st::comm_stats().comm_seconds, 0.0);
  st::detail::record_comm_time(1500000000);
  EXPECT_DOUBLE_EQ(st::comm_stats().comm_seconds, 1.5);
  st::reset_comm_stats();
  EXPECT_EQ(st::comm_stats().comm_seconds, 0.0);
  at::Tensor x = st::comm::all_reduce(torch::ones({1000}), mesh, {0});
  EXPECT_EQ(x[0].item<float>(), static_cast<float>(mesh.size()));
  const double t = st::comm_stats().comm_seconds;
  if (mesh.size() > 1) {
    EXPECT_GT(t, 0.0);  // one MPI_Allreduce was timed
  } else {
    EXPECT_EQ(t, 0.0);  // a communicator of one moves nothing and is not timed
  }
  st::reset_comm_stats();
}

TEST(Stats, MemoryStatsTrackTensorAllocations) {
  constexpr int64_t kMiB = 1 << 20;
  const auto before = st::memory_stats();
  EXPECT_GE(before.current_bytes, 0);
  EXPECT_GE(before.peak_bytes, before.current_bytes);
  st::reset_peak_memory_stats();
  EXPECT_EQ(st::memory_stats().peak_bytes, st::memory_stats().current_bytes);
  {
    auto t = torch::empty({kMiB / 4}, torch::kFloat);  // exactly 1 MiB
    const auto with = st::memory_stats();
    EXPECT_GE(with.current_bytes - before.current_bytes, kMiB);
    EXPECT_GE(with.peak_bytes, with.current_bytes);
    auto u = torch::ones({kMiB / 8}, torch::kDouble);  // another MiB
    EXPECT_GE(st::memory_stats().current_bytes - with.current_bytes, kMiB);
  }
  const auto after = st::memory_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes) << "freeing lowers current";
  EXPECT_GE(after.peak_bytes, before.current_bytes + 2 * kMiB) << "peak remembers";
  st::reset_peak_memory_stats();
  EXPECT_EQ(st::memory_stats().peak_bytes, after.current_bytes);
  {
    auto big = torch::zeros({3 * kMiB}, torch::kUInt8);
    big.add_(1);  // in place: no new allocation
    const auto s = st::memory_stats();
    EXPECT_GE(s.current_bytes, after.current_bytes + 3 * kMiB);
    EXPECT_GE(s.peak_bytes, s.current_bytes);
  }
  const auto end = st::memory_stats();
  EXPECT_EQ(end.current_bytes, after.current_bytes);
  EXPECT_GE(end.peak_bytes, after.current_bytes + 3 * kMiB);
  EXPECT_LT(end.peak_bytes, after.current_bytes + 4 * kMiB);
  // Empty tensors are fine.
  auto e = torch::empty({0});
  EXPECT_EQ(st::memory_stats().current_bytes, end.current_bytes);
}

TEST(Stats, TrackingAllocatorRawInterfaceAndAlignment) {
  // Some CPU kernels (e.g. gelu) use raw_allocate()/raw_deallocate() on the
  // CPU allocator: they must work and be counted.
  c10::Allocator* cpu = c10::GetCPUAllocator();
  const auto before = st::memory_stats();
  void* p = cpu->raw_allocate(1000);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(st::memory_stats().current_bytes, before.current_bytes + 1000);
  cpu->raw_deallocate(p);
  EXPECT_EQ(st::memory_stats().current_bytes, before.current_bytes);
  for (int64_t n : {1, 3, 17, 4096}) {
    auto t = torch::empty({n}, torch::kUInt8);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u) << n << " bytes";
  }
  auto x = torch::randn({1000});
  auto y = torch::gelu(x);
  EXPECT_TRUE(y.allclose(0.5 * x * (1 + torch::erf(x / std::sqrt(2.0))), 1e-5, 1e-6));
}
