#pragma once
/// \file Private to io/: an open HDF5 file shared by several dataset reads and
/// writes (checkpoints write many datasets into one file). Every call that
/// takes a File is collective over the file's mesh when it has one, local
/// otherwise, and raises errors on every rank (Note [io errors]).
/// hid_t is HDF5's int64_t handle; <hdf5.h> stays in io/'s .cpp files.

#include <shardtensor/io/hdf5.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardtensor::io::detail {

enum class OpenMode { Read, ReadWrite, Truncate };

/// An open HDF5 file: MPI-IO on `mesh.comm()` when a mesh is given (every
/// rank of the mesh must make the same calls), the default serial driver
/// otherwise. Closing is collective; the destructor closes without checking,
/// close() checks and agrees.
class File {
 public:
  /// Collective over `mesh` when given. Throws on every rank if the file
  /// cannot be opened/created (message names the path).
  /// `context` (e.g. "read_hdf5('f.h5', 'u')") leads the error messages.
  File(const std::string& path, const std::optional<DeviceMesh>& mesh, OpenMode mode,
       const std::string& context = {});
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  /// Collective. Closes the file and agrees that it closed cleanly (flush errors).
  void close();

  const std::string& path() const { return path_; }
  const std::optional<DeviceMesh>& mesh() const { return mesh_; }
  int64_t id() const { return id_; }

  /// Collective. Whether `dataset` exists (every path component checked).
  bool exists(const std::string& dataset) const;

  /// Throws on every rank (when the file has a mesh) if `ok` is false on any.
  void agree(bool ok, const std::string& what, const std::string& message) const;

 private:
  std::string path_;
  std::optional<DeviceMesh> mesh_;
  int64_t id_ = -1;
  int64_t fapl_ = -1;
};

/// Collective over `mesh`. The read behind read_hdf5/read_hdf5_with_halo on an open file.
HaloRead read_dataset(File& file, const std::string& dataset, const DeviceMesh& mesh,
                      Placements placements, const ReadOptions& opts, bool with_halo);

/// Collective over the file's mesh. The write behind write_hdf5 on an open file.
/// For a plain tensor on a file with a mesh, mesh rank 0 writes.
void write_dataset(File& file, const std::string& dataset, const at::Tensor& tensor,
                   const WriteOptions& opts);

/// Collective over the file's mesh. Info about one dataset (as read_hdf5_info).
DatasetInfo dataset_info(File& file, const std::string& dataset);

/// Collective. Integer attribute `name` on the file's root group (write: every
/// rank passes the same value). read_root_int throws everywhere if it is missing.
void write_root_int(File& file, const std::string& name, int64_t value);
int64_t read_root_int(File& file, const std::string& name);

/// Names of the datasets directly inside group `group` (sorted), {} if it does not exist.
std::vector<std::string> list_group(File& file, const std::string& group);

/// Local. "what('path', 'dataset')" for error messages.
std::string describe(const char* what, const std::string& path, const std::string& dataset);

}  // namespace shardtensor::io::detail
