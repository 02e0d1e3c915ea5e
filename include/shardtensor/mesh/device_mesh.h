#pragma once
/// \file DeviceMesh: an N-d Cartesian grid of MPI ranks.

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace shardtensor {

namespace detail {
struct MeshState;
}

/// An N-d Cartesian grid of ranks over a duplicate of a base communicator
/// (MPI_Cart_create), with one sub-communicator per mesh dimension
/// (MPI_Cart_sub). Copies share the same communicators. The library's
/// communicators use MPI_ERRORS_RETURN; the base communicator is left as it is.
class DeviceMesh {
 public:
  DeviceMesh() = default;

  /// Collective over `comm`. `shape` may contain one -1 entry, inferred from
  /// the size of `comm`. `dim_names` is empty or has one distinct name per dim.
  /// Throws c10::Error (on every rank, before any communication) if the shape
  /// product differs from the communicator size, if more than one entry is -1,
  /// if an entry is 0 or below -1, or if names are duplicated or miscounted.
  static DeviceMesh create(std::vector<int64_t> shape, std::vector<std::string> dim_names = {},
                           MPI_Comm comm = MPI_COMM_WORLD);

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

  /// The Cartesian communicator over all ranks of the mesh.
  MPI_Comm comm() const;
  /// The sub-communicator along one mesh dim: its rank is this process's coordinate on that dim.
  MPI_Comm comm(int64_t mesh_dim) const;
  /// The sub-communicator spanning the mesh dims whose flag is true (cached).
  /// Local after the first call for a given mask, which is collective over comm().
  MPI_Comm comm(const std::vector<bool>& keep_dims) const;

  /// Two meshes are equal when they are the same mesh (copies of one create()).
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }

  std::string to_string() const;

 private:
  std::shared_ptr<detail::MeshState> state_;
};

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh);

}  // namespace shardtensor
