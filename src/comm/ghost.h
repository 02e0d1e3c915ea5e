#pragma once
// Private: the data behind a GhostPlan (Note [ghost plans],
// shardtensor/comm/ghost.h), shared with the ops/ layer's message-passing
// helpers and neighbour search.
#include <ATen/core/Tensor.h>
#include <shardtensor/comm/ghost.h>
#include <shardtensor/core/comm.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <vector>

namespace shardtensor::detail {

struct GhostPlanData {
  DeviceMesh mesh;
  int64_t mesh_dim = 0;
  Comm comm = comm_null();
  int64_t me = 0;                       // this rank's coordinate along mesh_dim
  int64_t P = 1;                        // coordinates along mesh_dim
  std::vector<int64_t> sizes, offsets;  // offsets: exclusive prefix sums of sizes
  at::Tensor ghost_ids;                 // int64 [num_ghost], sorted
  // Ghost rows come from recv_peer[i]: recv_count[i] rows at ghost row recv_start[i].
  std::vector<int64_t> recv_peer, recv_count, recv_start;
  // Owned rows (local indices) sent to send_peer[i].
  std::vector<int64_t> send_peer;
  std::vector<at::Tensor> send_rows;
  int64_t num_send_rows = 0;
};

}  // namespace shardtensor::detail
