#pragma once
// shardtensor_bench: the workload interface and registry.
//
// A workload builds one model (or none) and names its inputs: each input is a
// global shape and the tensor dims that the mesh dims shard, in order. The
// driver (main.cpp) makes every input from a deterministic function of the
// global coordinates (make_piece), so a rank builds only its own piece and the
// single-process baseline sees exactly the same global tensor.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace bench {

/// What the command line says about the problem (every workload reads what it needs).
struct Problem {
  /// Spatial extents (images: 2 or 3 values; attention: {S}).
  std::vector<int64_t> shape;
  int64_t batch = 1;
  int64_t in_channels = 1;
  int64_t out_channels = 1;
  int64_t base_channels = 16;
  int64_t depth = 3;
  int64_t layers = 6;          // conv_stack
  int64_t heads = 4;           // attention
  int64_t head_dim = 32;       // attention
  std::string norm = "group";  // unet: none | group | batch
  bool causal = false;         // attention
};

struct Input {
  std::vector<int64_t> global_shape;
  /// Tensor dims sharded by mesh dims 0, 1, ... (extra entries unused).
  std::vector<int64_t> shard_dims;
  bool requires_grad = false;
};

/// One instance of a workload: a model and a forward function. The same
/// instance code runs on ShardTensors (sharded run) and plain tensors (baseline).
struct Instance {
  std::shared_ptr<torch::nn::Module> module;  // may be null (no parameters)
  std::vector<Input> inputs;
  /// Number of spatial dims that grow with Problem::shape (for size searches).
  int spatial_dims = 2;
  std::function<at::Tensor(const std::vector<at::Tensor>&)> forward;
};

struct Workload {
  std::string name;
  std::string description;
  /// Default spatial shape when the command line gives none.
  std::vector<int64_t> default_shape;
  /// Spatial sizes must be multiples of this (e.g. 2^depth for a U-Net).
  std::function<int64_t(const Problem&)> size_multiple;
  /// Builds a fresh instance. The caller seeds libtorch first, so every
  /// rank (and the baseline) gets identical parameters.
  std::function<Instance(const Problem&)> make;
};

std::map<std::string, Workload>& registry();

struct Registrar {
  explicit Registrar(Workload w) { registry()[w.name] = std::move(w); }
};

}  // namespace bench
