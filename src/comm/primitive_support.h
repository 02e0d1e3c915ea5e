#pragma once
/// \file What every differentiable primitive of comm/ shares (private to
/// comm/): the primitives' names for errors, argument checks that collect the
/// first failure, the SHARDTENSOR_DEBUG agreement before any communication,
/// the communicator of a call (one mesh dim: Axis; several: Group), arguments
/// saved for backward, and row-buffer arithmetic. The primitives themselves
/// live by concern: collectives.cpp, repartition.cpp, halo.cpp, ring.cpp;
/// the gradient-sink registry in grad_sink.cpp.
///
/// Note [replicated gradients]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Gradients follow the placement of the value they belong to, so that every
/// rank can run ordinary libtorch backward on its local tensors:
///  - Shard: the gradient is sharded like the value (each rank holds the
///    gradient of its own piece).
///  - Replicate: the gradient of a replicated value is the *full* gradient,
///    identical on every rank. A replicated value consumed by per-rank
///    different (sharded) compute collects a different partial gradient on each
///    rank, so such a use goes through use_replicated(), whose backward sums
///    them (all-reduce).
///  - Partial: the value is the pending sum of the ranks' summands; the
///    gradient with respect to each summand is the gradient of the sum, hence
///    identical on every rank (all_reduce() backward is the identity).
/// The matching inner products, used by the adjoint (dot-product) tests: a
/// replicated space counts once, <x, g>; a sharded space sums local dots over
/// the ranks; a partial value pairs with its replicated gradient as
/// sum_r <x_r, g> = <sum_r x_r, g>. With these, every backward below is the
/// exact adjoint of its forward: <A x, y> == <x, A^T y>.
///
/// Note [collective discipline]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Arguments are validated before any communication. Checks that depend only
/// on arguments that are identical on every rank (sizes, ranges, dims) throw
/// alike everywhere. Checks of the local tensor (its extent along the sharded
/// dim) can fail on one rank only; that rank throws and the others would wait.
/// With SHARDTENSOR_DEBUG=1 every primitive first all-reduces (uncounted) a
/// fingerprint of its arguments plus a "my checks failed" flag over the
/// participating communicator, and throws on every rank, naming the primitive,
/// when the fingerprints differ or any rank's checks failed: a mismatch is an
/// error, not a hang. Without debug mode, a check that fails on some ranks
/// only is carried to the others on the error channel (Note [carried errors]
/// in comm/error_channel.h), so every rank raises then too. Backward passes communicate only if
/// every rank reaches them: a primitive whose output takes part in the loss on some ranks and not
/// on others hangs in backward (as any collective called by a subset would).

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/mesh/device_mesh.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/fingerprint.h"

namespace shardtensor::comm::internal {

using shardtensor::detail::Fingerprint;
using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

// ---- names ------------------------------------------------------------------

enum class Prim : int64_t {
  AllReduce = 1,
  AllReduceNograd,
  UseReplicated,
  AllGather,
  ShardSlice,
  ReduceScatter,
  ReplicateToPartial,
  AllToAll,
  Repartition,
  GatherRange,
  HaloExchange,
  AccumulateRange,
  BoxExchange,
};

inline const char* prim_name(Prim p) {
  switch (p) {
    case Prim::AllReduce:
      return "all_reduce";
    case Prim::AllReduceNograd:
      return "all_reduce_nograd";
    case Prim::UseReplicated:
      return "use_replicated";
    case Prim::AllGather:
      return "all_gather";
    case Prim::ShardSlice:
      return "shard_slice";
    case Prim::ReduceScatter:
      return "reduce_scatter";
    case Prim::ReplicateToPartial:
      return "replicate_to_partial";
    case Prim::AllToAll:
      return "all_to_all";
    case Prim::Repartition:
      return "repartition";
    case Prim::GatherRange:
      return "gather_range";
    case Prim::HaloExchange:
      return "halo_exchange";
    case Prim::AccumulateRange:
      return "accumulate_range";
    case Prim::BoxExchange:
      return "box_exchange";
  }
  return "?";
}

inline std::string prefix(Prim p) {
  return std::string("shardtensor::comm::") + prim_name(p) + ": ";
}

/// Arguments that backward needs, kept in ctx->saved_data as an opaque capsule
/// (IValue cannot hold a DeviceMesh or a plan directly).
template <class T>
struct Boxed : torch::CustomClassHolder {
  explicit Boxed(T v) : value(std::move(v)) {}
  T value;
};

template <class T>
void save_args(AutogradContext* ctx, T value) {
  ctx->saved_data["shardtensor_args"] =
      c10::IValue::make_capsule(c10::make_intrusive<Boxed<T>>(std::move(value)));
}

template <class T>
const T& saved_args(AutogradContext* ctx) {
  auto holder = ctx->saved_data.at("shardtensor_args").toCapsule();
  // The capsule stays alive in ctx->saved_data.
  return static_cast<Boxed<T>*>(holder.get())->value;
}

/// Collects the first failed argument check instead of throwing at once, so
/// that in debug mode every rank can first agree (see Note [collective discipline]).
class Checks {
 public:
  explicit Checks(Prim p) : prim_(p) {}
  template <class... Args>
  bool require(bool cond, const Args&... args) {
    if (!cond && error_.empty()) {
      error_ = prefix(prim_) + c10::str(args...);
    }
    return cond;
  }
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  Prim prim_;
  std::string error_;
};

/// Collective over `comm` when SHARDTENSOR_DEBUG is set, local otherwise.
/// Throws c10::Error (on every rank in debug mode) if a check failed here or,
/// in debug mode, on another rank, or if the fingerprints differ.
void agree_or_throw(Prim p, Comm comm, Fingerprint fp, const Checks& checks);

// ---- the communicator of a call -----------------------------------------------

/// One mesh dim as seen from this rank.
struct Axis {
  DeviceMesh mesh;
  int64_t mesh_dim = 0;
  Comm comm = comm_null();
  int64_t size = 1;  // number of coordinates along the mesh dim
  int64_t me = 0;    // this rank's coordinate
};

/// Throws at once (identically on every rank) when the mesh is undefined or abstract.
void check_mesh(Prim p, const DeviceMesh& mesh);

/// Throws at once (identically on every rank) when mesh_dim is invalid: without
/// it there is no communicator to agree on.
Axis axis(Prim p, const DeviceMesh& mesh, int64_t mesh_dim);

/// The communicator over several mesh dims (sorted, deduplicated, wrapped).
struct Group {
  Comm comm = comm_null();  // comm_null(): no dims, nothing to do
  std::vector<int64_t> dims;
};

/// Validates and wraps `mesh_dims` (throws at once, identically on every rank).
Group group(Prim p, const DeviceMesh& mesh, const std::vector<int64_t>& mesh_dims);

// ---- argument checks ----------------------------------------------------------

/// Wraps a tensor dim; records an error instead of throwing.
int64_t wrap_dim(Checks& checks, int64_t dim, const at::Tensor& t, const char* what);

/// Checks a partition vector: one non-negative entry per coordinate.
bool check_sizes(Checks& checks, const std::vector<int64_t>& sizes, const Axis& a,
                 const char* what);

// ---- row-buffer arithmetic ----------------------------------------------------

inline int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

inline std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) {
    out[i] = out[i - 1] + sizes[i - 1];
  }
  return out;
}

inline std::vector<int64_t> shape_with(at::IntArrayRef shape, int64_t dim, int64_t extent) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out[dim] = extent;
  return out;
}

/// Number of elements in one index of `dim` (product of the other extents).
inline int64_t row_numel(at::IntArrayRef shape, int64_t dim) {
  int64_t n = 1;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    n *= d == dim ? 1 : shape[d];
  }
  return n;
}

/// Shape of a row buffer: `rows` indices of `dim`, which is moved to the front.
inline std::vector<int64_t> rows_shape(at::IntArrayRef shape, int64_t dim, int64_t rows) {
  std::vector<int64_t> out = {rows};
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (d != dim) {
      out.push_back(shape[d]);
    }
  }
  return out;
}

}  // namespace shardtensor::comm::internal
