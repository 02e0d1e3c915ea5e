// The wait board (core/wait_board.h; Note [flight recorder] in
// comm/flight_recorder.h).
#include "core/wait_board.h"

#include <shardtensor/config.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#if SHARDTENSOR_WITH_MPI
#include <mpi.h>
#endif

namespace shardtensor::detail::board {

namespace {

bool g_tried = false;                 // start() ran (init() is serialized by the runtime's mutex)
::c10d::TCPStore* g_store = nullptr;  // leaked: rank 0's server thread lives as long as the process

}  // namespace

void start() noexcept {
#if SHARDTENSOR_WITH_MPI
  if (g_tried) return;  // every rank alike: each ran the first start()
  g_tried = true;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const char* env = std::getenv("SHARDTENSOR_WAIT_BOARD");
  const bool wanted = env == nullptr || std::strcmp(env, "0") != 0;
  struct Address {
    int port = 0;  // 0: no board
    char host[MPI_MAX_PROCESSOR_NAME] = {0};
  } addr;
  c10::intrusive_ptr<::c10d::TCPStore> store;
  ::c10d::TCPStoreOptions so;
  so.waitWorkers = false;
  so.numWorkers = std::nullopt;
  so.timeout = std::chrono::milliseconds(5000);
  if (rank == 0 && wanted) {
    try {
      so.port = 0;  // the system picks a free port
      so.isServer = true;
      store = c10::make_intrusive<::c10d::TCPStore>("127.0.0.1", so);
      addr.port = store->getPort();
      int len = 0;
      MPI_Get_processor_name(addr.host, &len);
    } catch (...) {
      store.reset();
      addr.port = 0;
    }
  }
  MPI_Bcast(&addr, static_cast<int>(sizeof(addr)), MPI_BYTE, 0, MPI_COMM_WORLD);
  int ok = addr.port != 0 ? 1 : 0;
  if (ok) {
    try {
      if (rank != 0) {
        char mine[MPI_MAX_PROCESSOR_NAME] = {0};
        int len = 0;
        MPI_Get_processor_name(mine, &len);
        so.port = static_cast<uint16_t>(addr.port);
        so.isServer = false;
        const std::string host = std::strcmp(mine, addr.host) == 0 ? "127.0.0.1" : addr.host;
        store = c10::make_intrusive<::c10d::TCPStore>(host, so);
      }
      store->setTimeout(std::chrono::milliseconds(2000));
      store->set("wait/" + std::to_string(rank), std::vector<uint8_t>{});
    } catch (...) {
      ok = 0;
    }
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all == 1) {
    g_store = store.release();
  } else if (store) {
    // Another rank could not connect: nobody uses the board. Rank 0's server
    // stays up (leaked) so that no peer sees a connection close mid-operation.
    (void)store.release();
  }
#endif
}

::c10d::Store* store() noexcept { return g_store; }

}  // namespace shardtensor::detail::board
