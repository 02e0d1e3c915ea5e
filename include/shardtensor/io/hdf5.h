#pragma once
/// \file Parallel HDF5: every rank reads (writes) only its own hyperslab of a
/// global dataset, straight into (out of) its local piece.
///
/// The files are ordinary HDF5 (h5dump, h5py, NetCDF-4 readers see them); the
/// library is HDF5's parallel build, MPI-IO underneath, opened on the mesh's
/// communicator. No public header here includes <hdf5.h>.
///
/// ```
/// auto mesh = st::DeviceMesh::create({-1});
/// // Rank r reads rows [offset_r, offset_r + rows_r) of /fields/u, and nothing else.
/// at::Tensor u = st::io::read_hdf5("run.h5", "fields/u", mesh, {st::Shard{0}});
/// st::io::write_hdf5("out.h5", "fields/u2", u * 2, st::io::WriteOptions().units("K"));
/// ```
///
/// Note [io errors]: every check that can fail on one rank only (a file one
/// rank cannot see, an HDF5 call that fails) is agreed over the mesh
/// (comm::check_all) before the next collective HDF5 call, so a failure raises
/// the same c10::Error, naming the file and the dataset, on **every** rank and
/// no rank is left waiting inside MPI-IO.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <shardtensor/mesh/device_mesh.h>
#include <shardtensor/spec/placement.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtensor::io {

/// MPI-IO transfer mode of the dataset read/write itself.
enum class Transfer {
  /// Every rank takes part in one collective MPI-IO call (two-phase I/O:
  /// aggregators read large contiguous stripes and scatter them). Default.
  Collective,
  /// Every rank issues its own independent MPI-IO requests.
  Independent,
};

/// What a halo holds where it crosses the edge of the (selected) domain.
enum class HaloMode {
  /// No ghost cells past the edge: the with-halo piece is shorter there.
  None,
  /// Ghost cells past the edge are zero.
  Zeros,
  /// Ghost cells past the edge repeat the edge value.
  Replicate,
  /// Ghost cells past the edge come from the far end of the domain (periodic).
  Circular,
};

/// A global box of the dataset: `start[d]`, `count[d]` per dataset dim
/// (`count[d] == -1`: to the end of the dim). The result's global shape is
/// `count` (no dim is dropped: one time step of a [T, H, W] dataset is [1, H, W]).
struct Selection {
  std::vector<int64_t> start;
  std::vector<int64_t> count;
};

/// Options of read_hdf5() / read_hdf5_with_halo().
struct ReadOptions {
  /// Explicit extents per mesh dim (as ShardTensor::from_local): uneven and
  /// empty pieces. Default: balanced-block.
  TORCH_ARG(std::optional<ShardSizes>, sizes) = std::nullopt;
  /// dtype of the result; default: the dataset's own type (float32 -> Float,
  /// float64 -> Double, int8/16/32/64 -> Char/Short/Int/Long, uint8 -> Byte,
  /// uint16/uint32 -> Int/Long). HDF5 converts in memory. Integer datasets
  /// convert to any of these; floating-point datasets only to floating-point
  /// dtypes (truncation to an integer is refused).
  TORCH_ARG(std::optional<at::ScalarType>, dtype) = std::nullopt;
  /// Read only this box of the dataset (its global shape becomes the result's).
  TORCH_ARG(std::optional<Selection>, select) = std::nullopt;
  /// Halo width per tensor dim (symmetric; empty: none). read_hdf5_with_halo() only.
  TORCH_ARG(std::vector<int64_t>, halo) = {};
  /// Global-edge behaviour of the halo (edges of the selected box).
  TORCH_ARG(HaloMode, halo_mode) = HaloMode::Zeros;
  TORCH_ARG(Transfer, transfer) = Transfer::Collective;
};

/// **Collective** over every rank of `mesh` (the file is opened with MPI-IO on
/// `mesh.comm()`). Reads dataset `dataset` (a path inside the file, groups
/// separated by '/') of the HDF5 file `path` as a ShardTensor with
/// `placements` (one per mesh dim; Shard and Replicate) and `opts.sizes()`:
/// each rank selects exactly its own hyperslab (H5Sselect_hyperslab) and
/// reads it into its local piece; a rank with an empty piece still takes part
/// with an empty selection. Replicate mesh dims read the same piece on each of
/// their coordinates. io_stats().bytes_read grows by the rank's piece only.
///
/// Returns an at::Tensor handle that is a ShardTensor (Note [factories return at::Tensor]).
///
/// Throws c10::Error on every rank, naming the file and the dataset, if: the
/// file cannot be opened or the dataset does not exist; the number of
/// placements differs from mesh.ndim(); a placement is Partial or shards a dim
/// the dataset does not have; `sizes` does not fit; the selection is out of
/// range or of the wrong rank; the dataset's type is not an integer or float
/// type or cannot convert to `dtype`; `opts.halo()` is not empty (use
/// read_hdf5_with_halo); or the HDF5 read fails.
at::Tensor read_hdf5(const std::string& path, const std::string& dataset, const DeviceMesh& mesh,
                     Placements placements, const ReadOptions& opts = {});

/// Result of read_hdf5_with_halo().
///
/// Note [halo read layout]: `with_halo` is a plain local tensor: this rank's
/// piece extended along every tensor dim d by `halo_left[d]` elements before
/// and `halo_right[d]` after it, exactly as shardtensor::halo_exchange(tensor,
/// d, h, h, mode) would return it (so it replaces the first halo exchange of a
/// stencil pipeline). Ghost cells inside the domain come from the file (never
/// from a neighbour over MPI); past the edge of the selected box they follow
/// `halo_mode`. With HaloMode::None, `halo_left/right[d]` are shorter at the
/// edge (0 at a global edge). `tensor` is the ShardTensor without halo
/// (a view of the interior made contiguous).
struct HaloRead {
  at::Tensor tensor;
  at::Tensor with_halo;
  std::vector<int64_t> halo_left;
  std::vector<int64_t> halo_right;
};

/// **Collective** over every rank of `mesh`. Like read_hdf5(), but each rank
/// also reads its ghost cells from the file: `opts.halo()[d]` elements on each
/// side along every tensor dim d (usually the sharded ones; on an unsharded
/// dim only the edge rule applies). Every rank reads its piece plus halo in
/// one hyperslab union (io_stats counts each file element once, so a periodic
/// halo that wraps onto the rank's own piece is not read twice).
/// Throws as read_hdf5() does, and if `opts.halo()` has a length other than
/// the dataset's rank or a negative entry, or HaloMode::Replicate/Circular
/// meets an empty global extent.
HaloRead read_hdf5_with_halo(const std::string& path, const std::string& dataset,
                             const DeviceMesh& mesh, Placements placements,
                             const ReadOptions& opts);

/// Options of write_hdf5().
struct WriteOptions {
  /// For a plain (non-sharded) tensor: the mesh whose ranks all call
  /// write_hdf5 with the same value; mesh rank 0 writes, the others take part
  /// with an empty selection. Without a mesh a plain tensor is written by the
  /// calling process alone (serial HDF5 access, **local**).
  TORCH_ARG(std::optional<DeviceMesh>, mesh) = std::nullopt;
  /// Chunk shape (one entry per dim, each >= 1); empty: contiguous layout.
  TORCH_ARG(std::vector<int64_t>, chunks) = {};
  /// Stored as the string attribute "units" when not empty.
  TORCH_ARG(std::string, units) = "";
  /// false: throw if the dataset exists; true: replace it.
  TORCH_ARG(bool, overwrite) = true;
  /// true: start a new file (truncating an existing one); false: add to the
  /// file if it exists.
  TORCH_ARG(bool, truncate) = false;
  TORCH_ARG(Transfer, transfer) = Transfer::Collective;
};

/// **Collective** over every rank of the tensor's mesh (a ShardTensor) or of
/// `opts.mesh()` (a plain tensor; **local** without it). Creates (or
/// replaces) dataset `dataset` of the global shape and the tensor's dtype
/// (Float/Double/Int/Long/Short/Char/Byte; Bool is stored as uint8, Half and
/// BFloat16 as float32, with a "torch_dtype" attribute) in `path`, creating
/// the file and intermediate groups as needed. Each rank writes only its own
/// hyperslab; of ranks holding the same piece (Replicate mesh dims) only
/// coordinate 0 writes. A Partial tensor is first summed (redistribute, collective).
/// Attributes: "global_shape" (int64), "placements" (e.g. "[Shard(0), Replicate()]",
/// "" for a plain tensor), "mesh_shape" (int64, empty for a plain tensor),
/// "torch_dtype", and "units" when given.
///
/// Throws c10::Error on every rank, naming the file and the dataset, if the
/// file cannot be created or opened for writing, the dataset exists and
/// `overwrite` is false, `chunks` does not fit, the dtype cannot be stored,
/// or an HDF5 call fails.
void write_hdf5(const std::string& path, const std::string& dataset, const at::Tensor& tensor,
                const WriteOptions& opts = {});

/// What read_hdf5_info() finds: the dataset's shape, a dtype it reads as by
/// default, and its string/int attributes written by write_hdf5.
struct DatasetInfo {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::string placements;           ///< attribute "placements" ("" if absent)
  std::vector<int64_t> mesh_shape;  ///< attribute "mesh_shape" ({} if absent)
  std::string torch_dtype;          ///< attribute "torch_dtype" ("" if absent)
  std::string units;                ///< attribute "units" ("" if absent)
};

/// **Collective** over every rank of `mesh` (opens the file with MPI-IO).
/// Shape, default dtype and attributes of one dataset; reads no data.
/// Throws as read_hdf5() does for a missing file or dataset or an unsupported type.
DatasetInfo read_hdf5_info(const std::string& path, const std::string& dataset,
                           const DeviceMesh& mesh);

}  // namespace shardtensor::io
