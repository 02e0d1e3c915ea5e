#pragma once
/// \file DeviceMesh: an N-d Cartesian grid of ranks.

#include <c10/core/Device.h>
#include <shardtensor/core/comm.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace shardtensor {

namespace detail {
struct MeshState;
}

/// An N-d Cartesian grid of ranks over a base group (a `Comm`, Note [c10d-only
/// build] in shardtensor/core/comm.h), with one sub-group per mesh dimension.
/// Under the MPI transport these are a duplicate of the base communicator
/// (MPI_Cart_create) and its MPI_Cart_sub communicators, which use
/// MPI_ERRORS_RETURN (the base communicator is left as it is); under the c10d
/// transport they are c10d groups (Note [c10d group reuse]). Copies share the
/// same groups.
class DeviceMesh {
 public:
  DeviceMesh() = default;

  /// Collective over `comm` (comm_world(): every process of the job, under
  /// either transport). `shape` may contain one -1 entry, inferred from
  /// the size of `comm`. `dim_names` is empty or has one distinct name per dim.
  /// Throws c10::Error (on every rank, before any communication) if the shape
  /// product differs from the communicator size, if more than one entry is -1,
  /// if an entry is 0 or below -1, or if names are duplicated or miscounted.
  static DeviceMesh create(std::vector<int64_t> shape, std::vector<std::string> dim_names = {},
                           Comm comm = comm_world());

  /// Collective over `comm`, as create(shape, dim_names, comm), for a mesh
  /// whose pieces live on devices of type `device_type` (PhysicsNeMo's and
  /// PyTorch's `DeviceMesh("cuda", ...)`): the factories put each rank's
  /// piece on device(). Throws c10::Error before any communication for a
  /// device type other than CPU and CUDA, or CUDA in a process that sees no
  /// CUDA device (the check is this process's own: on a machine where some
  /// ranks see a device and others none, only the latter throw). Note [host
  /// staging] in comm/transport_mpi.cpp says how device buffers travel.
  static DeviceMesh create(c10::DeviceType device_type, std::vector<int64_t> shape,
                           std::vector<std::string> dim_names = {}, Comm comm = comm_world());

  /// Local. A mesh with no communicators, seen from `coordinate`: for
  /// metadata-only use (ShardSpec arithmetic, unit tests without MPI).
  /// comm() throws on it. Throws if the coordinate is out of range.
  static DeviceMesh abstract(std::vector<int64_t> shape, std::vector<int64_t> coordinate,
                             std::vector<std::string> dim_names = {});

  /// Local accessors.
  bool defined() const { return state_ != nullptr; }
  int64_t ndim() const;
  const std::vector<int64_t>& shape() const;
  int64_t size() const;                  ///< number of ranks in the mesh
  int64_t size(int64_t mesh_dim) const;  ///< extent of one mesh dim (negative dims wrap)
  const std::vector<std::string>& dim_names() const;
  /// Throws if no dim has this name.
  int64_t dim_index(const std::string& name) const;
  /// This rank's coordinate in the grid.
  std::vector<int64_t> coordinate() const;
  /// This rank's rank in comm().
  int rank() const;
  /// Rank in comm() of the process at `coordinate`.
  int rank_of(const std::vector<int64_t>& coordinate) const;
  /// Coordinate of the process with rank `rank` in comm().
  std::vector<int64_t> coordinate_of(int rank) const;
  bool is_abstract() const;
  /// Local. The type of device the mesh's pieces live on: CPU unless given to create().
  c10::DeviceType device_type() const;
  /// Local. This rank's device: the CPU for a CPU mesh; for a CUDA mesh the
  /// CUDA device local_rank() % (number of visible devices), so that each
  /// process of a node takes its own GPU (torchrun's LOCAL_RANK, or the
  /// node-local rank under mpirun; shardtensor/core/runtime.h). Throws
  /// c10::Error for a CUDA mesh when this process sees no CUDA device.
  c10::Device device() const;

  /// The Cartesian communicator over all ranks of the mesh.
  Comm comm() const;
  /// The sub-communicator along one mesh dim: its rank is this process's coordinate on that dim.
  Comm comm(int64_t mesh_dim) const;
  /// The sub-communicator spanning the mesh dims whose flag is true (cached).
  /// Local after the first call for a given mask, which is collective over comm().
  Comm comm(const std::vector<bool>& keep_dims) const;

  /// Two meshes are equal when they are the same mesh (copies of one create()).
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }

  std::string to_string() const;

 private:
  std::shared_ptr<detail::MeshState> state_;
};

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh);

}  // namespace shardtensor
