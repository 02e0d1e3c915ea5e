// A DeviceMesh kept in an autograd Function's context, for its backward.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <shardtensor/mesh/device_mesh.h>

namespace shardtensor::ops {

struct SavedMesh : torch::CustomClassHolder {
  explicit SavedMesh(DeviceMesh m) : mesh(std::move(m)) {}
  DeviceMesh mesh;
};

/// Local. Stores `mesh` in ctx->saved_data under "mesh".
inline void save_mesh(torch::autograd::AutogradContext* ctx, const DeviceMesh& mesh) {
  ctx->saved_data["mesh"] = c10::IValue::make_capsule(c10::make_intrusive<SavedMesh>(mesh));
}

/// Local. The mesh stored by save_mesh(); throws (c10::Error) if none was stored.
inline const DeviceMesh& saved_mesh(torch::autograd::AutogradContext* ctx) {
  return static_cast<SavedMesh*>(ctx->saved_data.at("mesh").toCapsule().get())->mesh;
}

}  // namespace shardtensor::ops
