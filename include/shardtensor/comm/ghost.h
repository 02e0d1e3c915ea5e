#pragma once
/// \file Index halos: the unstructured analogue of halo_exchange.
///
/// Note [ghost plans]
/// ~~~~~~~~~~~~~~~~~~
/// Items (graph nodes, particles, mesh vertices) are sharded by rows along one
/// mesh dim: coordinate c owns the contiguous block of global ids
/// [offset_c, offset_c + sizes[c]) (any sizes, zeros included). A rank that
/// needs foreign items (the far endpoints of its edges, the neighbours found
/// by knn) names their global ids; GhostPlan::build() turns those lists into
/// a plan, i.e. metadata only: for every peer, which of my owned rows it
/// needs (send lists) and how many ghost rows I get from it (receive counts).
/// The plan is built once (one all-to-allv of counts and one of ids) and
/// reused by every exchange of every step; rebuilding it after a change of
/// partition costs the same two all-to-allvs.
///
/// A rank's *extended* rows are `[owned | ghost]`: its sizes[me] owned rows
/// followed by num_ghost() ghost rows, ordered by global id (which groups them
/// by owner). local_index() maps global ids to rows of that layout.
///
///  - ghost_exchange(owned) -> extended: owners send the rows their peers
///    need (point-to-point, split-phase transport exchange, only between
///    ranks that share items).
///  - ghost_accumulate(extended) -> owned: every ghost row is sent back to
///    its owner and added to the owner's row (the scatter-add of message
///    passing, completed across ranks).
/// The two are adjoint: <exchange(x), y>_ext == <x, accumulate(y)>_owned
/// (sums of local dots over the ranks), and each is the other's backward, so
/// double backward works.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace shardtensor {

namespace detail {
struct GhostPlanData;
}

/// Options of ghost_accumulate().
struct GhostOptions {
  /// Dtype the contributions are summed in (and travel in), e.g. at::kDouble
  /// for float32 data where sums are large; the result has the input's dtype.
  /// Unset: the input's dtype.
  GhostOptions& accumulate_dtype(c10::optional<at::ScalarType> d) {
    accumulate_dtype_ = d;
    return *this;
  }
  c10::optional<at::ScalarType> accumulate_dtype() const { return accumulate_dtype_; }

 private:
  c10::optional<at::ScalarType> accumulate_dtype_;
};

/// A reusable index-halo plan (Note [ghost plans]). Cheap to copy (shared,
/// immutable metadata).
class GhostPlan {
 public:
  GhostPlan() = default;

  /// **Collective** over every rank of `mesh` (the argument check) and over
  /// the sub-communicator of `mesh_dim` (the plan itself). `sizes[c]` is the
  /// number of rows owned by coordinate c of `mesh_dim` (identical on every
  /// rank); `needed_ids` (1-D, int64, any order, duplicates allowed) are the
  /// global ids this rank needs. Ids it owns are ignored; the rest become its
  /// ghosts.
  ///
  /// Throws c10::Error on every rank, before the plan's communication, if the
  /// mesh or mesh_dim is invalid, sizes has the wrong length or a negative
  /// entry, or any rank's `needed_ids` is not 1-D int64 or holds an id outside
  /// [0, sum(sizes)).
  static GhostPlan build(const DeviceMesh& mesh, int64_t mesh_dim, std::vector<int64_t> sizes,
                         const at::Tensor& needed_ids);

  bool defined() const { return data_ != nullptr; }
  /// Local accessors (throw if the plan is undefined).
  const DeviceMesh& mesh() const;
  int64_t mesh_dim() const;
  const std::vector<int64_t>& sizes() const;  ///< rows owned per coordinate
  int64_t num_global() const;                 ///< sum(sizes)
  int64_t owned_offset() const;               ///< global id of this rank's first owned row
  int64_t num_owned() const;
  int64_t num_ghost() const;
  int64_t num_extended() const { return num_owned() + num_ghost(); }
  /// Global ids of the ghost rows, sorted ascending (int64, [num_ghost()]).
  const at::Tensor& ghost_ids() const;
  /// Rows this rank sends in one exchange (owned rows, counted once per peer).
  int64_t num_send_rows() const;
  /// Peers (coordinates along mesh_dim) this rank receives ghosts from.
  std::vector<int64_t> recv_peers() const;

  /// Local. Rows of the extended layout `[owned | ghost]` holding the items
  /// `global_ids` (int64, any shape; the result has the same shape). Throws
  /// c10::Error if an id is neither owned by this rank nor one of its ghosts.
  at::Tensor local_index(const at::Tensor& global_ids) const;

  const detail::GhostPlanData& data() const;

 private:
  std::shared_ptr<const detail::GhostPlanData> data_;
};

/// **Collective** over `plan.mesh_dim()`. `owned` holds this rank's
/// plan.num_owned() rows (dim 0; any trailing shape, same on every rank);
/// returns the extended rows `[owned | ghost]` (num_extended() rows).
/// Differentiable: the backward is ghost_accumulate() (ghost gradients are
/// sent to their owners and summed there). Throws c10::Error if `owned` has
/// the wrong number of rows (on that rank: keep shapes consistent).
at::Tensor ghost_exchange(const at::Tensor& owned, const GhostPlan& plan);

/// **Collective** over `plan.mesh_dim()`. `extended` holds num_extended()
/// rows; returns the owned rows plus, for every owned item, the ghost rows
/// that other ranks hold for it (summed in options.accumulate_dtype()).
/// Differentiable: the backward is ghost_exchange(). Throws like
/// ghost_exchange().
at::Tensor ghost_accumulate(const at::Tensor& extended, const GhostPlan& plan,
                            const GhostOptions& options = {});

/// **Collective** over `plan.mesh_dim()`. Not differentiable (detached): like
/// ghost_accumulate() with a Max, Min or Product combine of the owned row and
/// every ghost copy of it (for scatter_reduce amax/amin/prod across ranks).
/// Sum is allowed too.
at::Tensor ghost_accumulate_nograd(const at::Tensor& extended, const GhostPlan& plan, ReduceOp op);

}  // namespace shardtensor
