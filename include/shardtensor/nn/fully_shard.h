#pragma once
/// \file Fully sharded parameters (FSDP / ZeRO) over one mesh dim, beside
/// domain parallelism over the others (Note [fully_shard], docs/architecture.md).

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace shardtensor {

namespace detail {
class FullyShardUnit;
}

/// Options of fully_shard().
struct FullyShardOptions {
  /// true (ZeRO-3): a unit's gathered parameters are freed when the next
  /// unit's forward starts, and gathered again just before its backward.
  /// false (ZeRO-2): they stay gathered from the unit's forward until its
  /// gradients are reduce-scattered. Either way they are freed after that.
  /// A unit that contains other units (the root) is never freed between
  /// forward and backward.
  TORCH_ARG(bool, reshard_after_forward) = true;
};

/// Handle of one fully sharded unit (a module's parameters not owned by an
/// inner unit), made by fully_shard(). Copies share the unit.
class FullyShard {
 public:
  FullyShard() = default;
  explicit FullyShard(std::shared_ptr<detail::FullyShardUnit> unit) : unit_(std::move(unit)) {}
  bool defined() const { return unit_ != nullptr; }

  /// Local. This rank's shard of the unit's flattened, padded parameters: a
  /// 1-D leaf tensor of shard_numel() elements that requires grad. Give it
  /// to the optimizer (fully_shard_parameters() collects every unit's); its
  /// grad() is set by backward (Note [fully_shard]).
  const at::Tensor& shard() const;
  /// Local. Makes `t` (a 1-D leaf of shard_numel() elements and the unit's
  /// dtype, e.g. a Python nn.Parameter) the shard, copying the current shard
  /// into it. Throws c10::Error if its shape or dtype differs.
  void set_shard(const at::Tensor& t) const;
  /// Local. Total elements of the unit's parameters, that total rounded up
  /// to a multiple of D (the data dim's size), and that divided by D.
  int64_t numel() const;
  int64_t padded_numel() const;
  int64_t shard_numel() const;
  /// Local. The unit's parameter names (as given to fully_shard), in order.
  std::vector<std::string> names() const;
  /// Local. The mesh and the mesh dim the unit is sharded over.
  const DeviceMesh& mesh() const;
  int64_t data_dim() const;
  /// Local. Whether the parameters are currently freed (only the shard held).
  bool is_sharded() const;

  /// Collective over the data dim (all-gather). Gathers the parameters into
  /// the module's own tensors; a no-op when they are gathered. A use in
  /// sharded compute does this by itself (Note [fully_shard]); call it
  /// before using the parameters in plain code. Throws c10::Error on
  /// communication failure.
  void unshard() const;
  /// Local. Frees the gathered parameters; a no-op when sharded.
  void reshard() const;

  /// Collective over the data dim. The full value of every parameter of the
  /// unit (fresh tensors), named as names(), on every rank.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() const;
  /// Local. Sets the shard from full parameter values (every rank passes the
  /// same values; each takes its slice); the gathered parameters, if any,
  /// are freed. Throws c10::Error (on every rank alike when every rank passes
  /// the same) if a name is missing or a shape or dtype differs.
  void load_full_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state) const;

  /// Local. The shard-layout slice of a flat, padded tensor of
  /// padded_numel() elements, e.g. to place per-parameter optimizer state.
  at::Tensor shard_of(const at::Tensor& flat_padded) const;
  /// Collective over the data dim. All-gathers a tensor laid out like
  /// shard() (e.g. an Adam moment of it) and returns it split per parameter,
  /// with the parameters' shapes (padding dropped).
  std::vector<at::Tensor> unflatten(const at::Tensor& shard_like) const;

  detail::FullyShardUnit* unit() const { return unit_.get(); }

 private:
  std::shared_ptr<detail::FullyShardUnit> unit_;
};

/// Collective over every rank of `mesh`. Makes `module`'s parameters that
/// require grad and are not already in a unit (those of submodules passed to
/// fully_shard before) one fully sharded unit over mesh dim `dim` (Note
/// [fully_shard]): every parameter and buffer of `module` is first broadcast
/// from mesh rank 0, then each rank keeps 1/D of the unit's flattened,
/// padded parameters (D = mesh.size(dim)) in shard() and frees the module's
/// own parameter storage. The module's parameters keep their shapes and are
/// gathered over `dim` when first used in sharded compute (or by unshard()),
/// freed again per `options`, and gathered again for backward. Backward
/// reduce-scatters the parameters' gradients over `dim` and sums them over
/// the mesh dims the sharded compute ran on, so shard().grad() is this
/// rank's slice of the single-process gradient; the module's parameters
/// get no grad(). Apply it to blocks first, then to the root.
///
/// Requirements: the unit's parameters share one dtype; every rank runs the
/// same forward and backward; a unit's forward runs once per step (units are
/// gathered again for backward in the reverse of their forward order);
/// backward() without create_graph. Throws c10::Error on every rank if the
/// ranks' modules or options differ, `dim` is not a mesh dim, the dtypes are
/// mixed, or a parameter is already in a unit of another module or
/// registered by distribute_module.
FullyShard fully_shard(torch::nn::Module& module, const DeviceMesh& mesh, const std::string& dim,
                       const FullyShardOptions& options = FullyShardOptions());

/// Collective over every rank of `mesh`. The same for named parameters and
/// buffers given directly (the Python package's entry). `is_root`: the unit
/// contains other units and is never freed between forward and backward.
FullyShard fully_shard(const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       const DeviceMesh& mesh, const std::string& dim,
                       const FullyShardOptions& options, bool is_root);

/// Local. The units of `module`'s parameters (its own and its submodules'),
/// each once, in the order of module.parameters().
std::vector<FullyShard> fully_shard_units(torch::nn::Module& module);

/// Local. The shards of fully_shard_units(module) with at least one element
/// on some rank: what the optimizer steps.
std::vector<at::Tensor> fully_shard_parameters(torch::nn::Module& module);

/// Collective over the data dim of the units (all must share one mesh and
/// data dim). Scales every unit's shard gradient so that the global 2-norm
/// of all their gradients is at most `max_norm` (torch's clip_grad_norm_:
/// coefficient max_norm / (norm + 1e-6), capped at 1) and returns the norm
/// before clipping. Units without a gradient count as zero. Throws
/// c10::Error if the units' meshes or data dims differ.
double clip_grad_norm_(const std::vector<FullyShard>& units, double max_norm);

}  // namespace shardtensor
