#pragma once
/// \file Sharded checkpoints: one HDF5 file per checkpoint, one global dataset
/// per sharded tensor, written collectively (each rank its hyperslab) and
/// loadable onto any mesh, rank count or placements (each rank reads only what
/// it will own).
///
/// Note [checkpoint layout]: `<dir>/checkpoint.h5` holds
///   - root attributes `step`, `format_version` (1), `mesh_shape` (of the saving mesh);
///   - `tensors/<name>`: one global dataset per named tensor, with the
///     attributes of write_hdf5 (`placements`, `mesh_shape`, `global_shape`,
///     `torch_dtype`);
///   - `module/params/<name>`, `module/buffers/<name>`: the module's
///     replicated parameters and buffers, written once (mesh rank 0);
///   - `optimizer/state`: the optimizer's state as libtorch serializes it
///     (torch::serialize::OutputArchive bytes, uint8), written once.
/// It is ordinary HDF5 (h5py/h5dump read it).
///
/// Note [crash-safe checkpoint]: a save writes `<dir>/checkpoint.h5.tmp`,
/// closes it on every rank, agrees that every rank succeeded, and only then
/// mesh rank 0 renames it to `checkpoint.h5` (rename(2) is atomic on POSIX
/// file systems) and the ranks agree on the rename. A crash or error before
/// that leaves the previous checkpoint (or none) in place, never a partial
/// file under the name that load_checkpoint reads.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>
#include <shardtensor/spec/placement.h>
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace shardtensor::io {

/// Named tensors, in order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
/// TORCH_ARG spells `const T&`: aliases keep the pointee mutable.
using ModulePtr = torch::nn::Module*;
using OptimizerPtr = torch::optim::Optimizer*;

/// What save_checkpoint() writes.
struct CheckpointState {
  /// Named tensors: ShardTensors on the save mesh (each rank writes its
  /// hyperslab; Partial ones are summed first) or plain tensors with the same
  /// value on every rank (mesh rank 0 writes). Names may contain '/' (groups).
  TORCH_ARG(NamedTensors, tensors) = {};
  /// Replicated parameters and buffers (e.g. after distribute_module), or null.
  TORCH_ARG(ModulePtr, module) = nullptr;
  /// Optimizer state (libtorch serialization), or null.
  TORCH_ARG(OptimizerPtr, optimizer) = nullptr;
  TORCH_ARG(int64_t, step) = 0;
};

/// **Collective** over every rank of `mesh` (every ShardTensor in `state` must
/// live on `mesh`). Writes the checkpoint directory `dir` (created if
/// missing) as Note [checkpoint layout] describes, crash-safely (Note
/// [crash-safe checkpoint]); an existing checkpoint in `dir` is replaced only
/// when the new one is complete. Throws c10::Error on every rank (naming the
/// file and the tensor) if the directory cannot be created, a tensor cannot be
/// written, or the rename fails; the previous checkpoint is then untouched.
void save_checkpoint(const std::string& dir, const DeviceMesh& mesh, const CheckpointState& state);

/// Where a named tensor goes when it is loaded.
struct TensorLayout {
  Placements placements;
  std::optional<ShardSizes> sizes = std::nullopt;
};

/// Layout per tensor name.
using TensorLayouts = std::map<std::string, TensorLayout>;

/// What load_checkpoint() restores.
struct LoadOptions {
  /// Layout on the load mesh per named tensor; a tensor without one is
  /// returned as a plain tensor (the whole value on every rank).
  TORCH_ARG(TensorLayouts, layouts) = {};
  /// Parameters and buffers are copied into this module (same names and shapes), or null.
  TORCH_ARG(ModulePtr, module) = nullptr;
  /// Optimizer state is loaded into this optimizer (built over the module's parameters), or null.
  TORCH_ARG(OptimizerPtr, optimizer) = nullptr;
};

/// What load_checkpoint() returns.
struct LoadedCheckpoint {
  /// Every named tensor of the checkpoint: a ShardTensor (at::Tensor handle)
  /// where a layout was given, plain otherwise; in the dtype it was saved in.
  std::map<std::string, at::Tensor> tensors;
  int64_t step = 0;
  /// Shape of the mesh that saved it.
  std::vector<int64_t> saved_mesh_shape;
};

/// **Collective** over every rank of `mesh`, which may differ from the saving
/// mesh in shape and size. Each named tensor with a layout is read with
/// read_hdf5 semantics, so every rank reads only the hyperslab it will own;
/// replicated state (module, optimizer) is read whole by every rank. Throws
/// c10::Error on every rank if `dir` holds no complete checkpoint, a layout
/// names a tensor that is not in it or does not fit its shape, or the module's
/// parameters/buffers do not match the saved ones in name or shape.
LoadedCheckpoint load_checkpoint(const std::string& dir, const DeviceMesh& mesh,
                                 const LoadOptions& opts = {});

/// Note [fully_shard checkpoint]: the units of a module under fully_shard
/// (Note [fully_shard]) are saved as named tensors of the ordinary format:
/// for the k-th unit of fully_shard_units(module), `fsdp/<k>/param` and its
/// optimizer state over the shard (Adam/AdamW: `exp_avg`, `exp_avg_sq`, with
/// amsgrad `max_exp_avg_sq`; SGD with momentum: `momentum_buffer`), each a
/// 1-D global dataset of the unit's numel() elements (padding dropped),
/// written by the data dim's coordinates as Shard(0) hyperslabs, plus
/// `fsdp/<k>/step` (Adam's step count). A checkpoint loads onto any data x
/// domain layout of the same model: each rank reads its new shard.

/// Collective over every rank of `mesh` (the units' mesh). The named tensors
/// that save `module`'s fully sharded units and, if not null, `optimizer`'s
/// state of their shards (Note [fully_shard checkpoint]); put them in
/// CheckpointState::tensors. Throws c10::Error if the optimizer is not Adam,
/// AdamW or SGD, or a unit is on another mesh.
NamedTensors fully_shard_tensors(torch::nn::Module& module, const DeviceMesh& mesh,
                                 torch::optim::Optimizer* optimizer = nullptr);

/// Local. The layouts under which load_checkpoint() reads those tensors onto
/// `mesh` for `module`'s units (already made by fully_shard on `mesh`) and
/// `optimizer` (same kind and options as the saving one).
TensorLayouts fully_shard_layouts(torch::nn::Module& module, const DeviceMesh& mesh,
                                  torch::optim::Optimizer* optimizer = nullptr);

/// Local. Sets the units' shards and `optimizer`'s state of them from a
/// checkpoint loaded with fully_shard_layouts(). Throws c10::Error if a
/// tensor is missing or its size differs from the unit's.
void load_fully_shard_tensors(const LoadedCheckpoint& loaded, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer = nullptr);

/// Local. True if `dir` holds a complete checkpoint (its checkpoint.h5 exists).
bool checkpoint_exists(const std::string& dir);

}  // namespace shardtensor::io
