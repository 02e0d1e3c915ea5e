// Shared machinery of the differentiable primitives (comm/primitive_support.h):
// the SHARDTENSOR_DEBUG agreement, the communicator of a call, argument checks.
#include "comm/primitive_support.h"

#include "comm/diagnostic.h"
#include "comm/error_channel.h"
#include "comm/transport.h"
#include "core/debug.h"

namespace shardtensor::comm::internal {

void agree_or_throw(Prim p, Comm comm, Fingerprint fp, const Checks& checks) {
  // Numbers the call and reads the error channel on every rank, in both modes
  // (Note [carried errors]).
  const errors::CallId call = errors::enter(comm, prim_name(p));
  if (!shardtensor::detail::debug_enabled() || transport::comm_size(comm) == 1) {
    if (!checks.ok()) errors::fail(call, checks.error());
    return;
  }
  fp.add(static_cast<int64_t>(p));
  const Agreement v = diagnostic_agree(comm, fp.value(), checks.ok());
  TORCH_CHECK(checks.ok(), checks.error(), " [SHARDTENSOR_DEBUG: reported on every rank]");
  TORCH_CHECK(v.all_ok, prefix(p),
              "the arguments failed validation on another rank (see that rank's error) "
              "[SHARDTENSOR_DEBUG]");
  TORCH_CHECK(v.same, prefix(p),
              "ranks disagree on the call (primitive, dims, sizes, ranges, dtype or shape "
              "differ between the ranks of the communicator) [SHARDTENSOR_DEBUG]");
}

void check_mesh(Prim p, const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.defined(), prefix(p), "the mesh is undefined");
  TORCH_CHECK(!mesh.is_abstract(), prefix(p), "the mesh is abstract (it has no communicators)");
}

Axis axis(Prim p, const DeviceMesh& mesh, int64_t mesh_dim) {
  check_mesh(p, mesh);
  const int64_t nd = mesh.ndim();
  TORCH_CHECK(mesh_dim >= -nd && mesh_dim < nd, prefix(p), "mesh_dim ", mesh_dim,
              " is out of range for a mesh with ", nd, " dims");
  Axis a;
  a.mesh = mesh;
  a.mesh_dim = mesh_dim < 0 ? mesh_dim + nd : mesh_dim;
  a.comm = mesh.comm(a.mesh_dim);
  a.size = mesh.size(a.mesh_dim);
  a.me = mesh.coordinate()[a.mesh_dim];
  return a;
}

Group group(Prim p, const DeviceMesh& mesh, const std::vector<int64_t>& mesh_dims) {
  check_mesh(p, mesh);
  const int64_t nd = mesh.ndim();
  Group g;
  std::vector<bool> keep(nd, false);
  for (int64_t d : mesh_dims) {
    TORCH_CHECK(d >= -nd && d < nd, prefix(p), "mesh dim ", d, " is out of range for a mesh with ",
                nd, " dims");
    const int64_t w = d < 0 ? d + nd : d;
    TORCH_CHECK(!keep[w], prefix(p), "mesh dim ", w, " is listed twice");
    keep[w] = true;
  }
  for (int64_t d = 0; d < nd; ++d) {
    if (keep[d]) {
      g.dims.push_back(d);
    }
  }
  if (g.dims.empty()) {
    return g;
  }
  g.comm = g.dims.size() == 1 ? mesh.comm(g.dims[0]) : mesh.comm(keep);
  return g;
}

int64_t wrap_dim(Checks& checks, int64_t dim, const at::Tensor& t, const char* what) {
  const int64_t nd = t.dim();
  if (!checks.require(dim >= -nd && dim < nd, what, " ", dim, " is out of range for a local tensor",
                      " with ", nd, " dims")) {
    return 0;
  }
  return dim < 0 ? dim + nd : dim;
}

bool check_sizes(Checks& checks, const std::vector<int64_t>& sizes, const Axis& a,
                 const char* what) {
  if (!checks.require(static_cast<int64_t>(sizes.size()) == a.size, what, " has ", sizes.size(),
                      " entries but mesh dim ", a.mesh_dim, " has ", a.size, " coordinates")) {
    return false;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!checks.require(sizes[i] >= 0, what, "[", i, "] = ", sizes[i], " is negative")) {
      return false;
    }
  }
  return true;
}

}  // namespace shardtensor::comm::internal
