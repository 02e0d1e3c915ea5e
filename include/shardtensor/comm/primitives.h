#pragma once
/// \file Differentiable communication primitives on **local** tensors.
///
/// Every function here is **collective** over the named mesh dims of `mesh`
/// (every rank of the participating sub-communicators must call it with the
/// same arguments, in the same order) and is a torch::autograd::Function whose
/// backward is the adjoint communication. Gradient conventions are in
/// Note [replicated gradients] (docs/architecture.md): the gradient of a
/// replicated value is the full gradient, identical on every rank. Under
/// create_graph (double backward) every backward is itself recorded as the
/// adjoint primitive, so gradients of any order are exact (Note
/// [differentiable adjoints], docs/architecture.md); all_reduce_nograd is the
/// only primitive without a gradient.
///
/// Partition vectors (`sizes`) give the extent held by each coordinate along
/// the mesh dim and must be identical on every rank. Errors are c10::Error,
/// thrown before any communication when arguments are inconsistent.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace shardtensor {

enum class ReduceOp { Sum, Max, Min, Product };

/// How a halo that crosses the global boundary of the domain is filled.
enum class PadMode {
  Constant,   ///< fill with `value` (zeros by default)
  Reflect,    ///< mirror without repeating the edge (torch "reflect")
  Replicate,  ///< repeat the edge element
  Circular,   ///< wrap to the far end of the global domain
};

/// Local. The enumerator's name ("Constant", "Reflect", "Replicate",
/// "Circular"), for messages.
const char* pad_mode_name(PadMode mode);

namespace comm {

/// Collective over `mesh_dims`. Forward: element-wise sum over the ranks of
/// those dims (Partial -> Replicate). Backward: identity.
at::Tensor all_reduce(const at::Tensor& t, const DeviceMesh& mesh,
                      const std::vector<int64_t>& mesh_dims);

/// Collective over `mesh_dims`. Not differentiable (the result is detached):
/// for Max/Min/Product reductions and metadata.
at::Tensor all_reduce_nograd(const at::Tensor& t, const DeviceMesh& mesh,
                             const std::vector<int64_t>& mesh_dims, ReduceOp op);

/// Collective over `mesh_dims`. Forward: identity. Backward: all-reduce sum.
/// Marks a replicated tensor used inside sharded (per-rank different) compute.
at::Tensor use_replicated(const at::Tensor& t, const DeviceMesh& mesh,
                          const std::vector<int64_t>& mesh_dims);

/// Collective over `mesh_dim`. Concatenates along `dim` the piece of every
/// coordinate (all-gatherv; sizes[c] = extent at coordinate c). Backward: slice.
at::Tensor all_gather(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t dim, const std::vector<int64_t>& sizes);

/// Local forward (Replicate -> Shard): this coordinate's slice along `dim`.
/// Collective backward: all-gather of the gradient.
at::Tensor shard_slice(const at::Tensor& full, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<int64_t>& sizes);

/// Collective over `mesh_dim` (Partial -> Shard): sum over the mesh dim, each
/// coordinate keeping its slice along `dim`. Backward: all-gather.
at::Tensor reduce_scatter(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim,
                          int64_t dim, const std::vector<int64_t>& sizes);

/// Local (Replicate -> Partial): coordinate 0 keeps the value, others hold zeros.
/// Backward: identity.
at::Tensor replicate_to_partial(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim);

/// Collective over `mesh_dim` (Shard(src_dim) -> Shard(dst_dim), all-to-allv).
/// `local` holds src_sizes[me] along src_dim and the full extent along dst_dim;
/// the result holds dst_sizes[me] along dst_dim and the full extent along src_dim.
/// Backward: the inverse all-to-all. src_dim == dst_dim is a repartition
/// (rebalancing to new sizes).
at::Tensor all_to_all(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t src_dim, const std::vector<int64_t>& src_sizes, int64_t dst_dim,
                      const std::vector<int64_t>& dst_sizes);

/// A run of global indices [start, start + length) along one tensor dim.
struct Segment {
  int64_t start = 0;
  int64_t length = 0;
};

/// Collective over `mesh_dim`. General repartition along `dim`: coordinate c
/// holds, concatenated in this order, the global index runs `segments[c]`;
/// afterwards coordinate c holds the contiguous block of `dst_sizes[c]`
/// elements at offsets_of(dst_sizes)[c]. The runs of all coordinates must tile
/// [0, sum(dst_sizes)) exactly. Backward: the inverse repartition.
at::Tensor repartition(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<std::vector<Segment>>& segments,
                       const std::vector<int64_t>& dst_sizes);

/// An N-d box of a tensor: per tensor dim, the global index run
/// [start, start + length) (box[d] for tensor dim d).
using Box = std::vector<Segment>;

/// Collective over `mesh_dims` (the sub-communicator of those mesh dims; the
/// first call for a new set of several mesh dims creates it, which is
/// collective over the whole mesh). Moves N-d boxes between the ranks that
/// share this rank's coordinates on the other mesh dims (Note [box exchange]).
/// Coordinates of the involved mesh dims are numbered row-major over
/// `mesh_dims` sorted ascending (mesh dim sizes multiplied out: c = sum_i
/// coord[dims[i]] * stride_i); `src_boxes[c]` is the box coordinate c holds,
/// `dst_boxes[c]` the box it gets. `local` holds this coordinate's source box
/// (its extents are the box's lengths); the result holds its destination box.
/// Every rank sends the intersection of its source box with each peer's
/// destination box, so it sends at most its local piece. Within each list the
/// boxes must be pairwise disjoint and both lists must cover the same
/// indices (every source box is covered by destination boxes and the other
/// way round). With one mesh dim and boxes that shard src_dim / dst_dim it is
/// all_to_all(). Backward: the inverse exchange (dst -> src), itself
/// differentiable (Note [differentiable adjoints]). Plans are cached (Note
/// [box exchange plan cache]). Throws c10::Error on every rank, before any
/// communication, when the mesh or mesh_dims are invalid or empty, a list
/// does not have one box per coordinate, a box does not have one run per
/// tensor dim of `local`, a run is negative, boxes overlap or the lists do
/// not cover the same indices; and (carried to the other ranks, Note
/// [collective discipline]) when `local`'s shape is not its source box's.
at::Tensor box_exchange(const at::Tensor& local, const DeviceMesh& mesh,
                        const std::vector<int64_t>& mesh_dims, const std::vector<Box>& src_boxes,
                        const std::vector<Box>& dst_boxes);

/// Collective over `mesh_dim`: the general halo exchange. `sizes` is the
/// partition of tensor dim `dim` (global extent n = sum(sizes)); `ranges[c]`
/// is the half-open global index range [lo, hi) that coordinate c wants, which
/// may extend past [0, n) (filled per `mode`), be narrower than what c owns
/// (trim), or reach across several neighbours (multi-hop). Returns this rank's
/// range as a new tensor. Backward: halo accumulate (the adjoint: every
/// gradient element is sent back to its owner and summed there).
/// Circular wraps modulo n; Reflect requires n >= 2 and a reach of at most n - 1.
at::Tensor gather_range(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                        int64_t dim, const std::vector<int64_t>& sizes,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges,
                        PadMode mode = PadMode::Constant, double value = 0.0);

/// Collective over `mesh_dim`: gather_range() with ranges[c] = [off_c - left, off_c + size_c +
/// right): every coordinate gets `left` elements before and `right` after its piece.
at::Tensor halo_exchange(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                         int64_t dim, const std::vector<int64_t>& sizes, int64_t left,
                         int64_t right, PadMode mode = PadMode::Constant, double value = 0.0);

/// A halo exchange in flight (halo_exchange_start). Move-only; destroying one
/// that was not finished cancels its receives and waits for its sends.
class HaloExchangeInFlight {
 public:
  HaloExchangeInFlight();
  ~HaloExchangeInFlight();
  HaloExchangeInFlight(HaloExchangeInFlight&&) noexcept;
  HaloExchangeInFlight& operator=(HaloExchangeInFlight&&) noexcept;
  /// Local, non-blocking: drives MPI progress; true once the halos arrived.
  bool test();
  /// Local: waits for the halos and returns the extended piece, exactly what
  /// halo_exchange() returns, connected to autograd (backward: the halo
  /// accumulate, collective over the mesh dim). Call once.
  at::Tensor finish();
  struct Impl;

 private:
  friend HaloExchangeInFlight halo_exchange_start(const at::Tensor&, const DeviceMesh&, int64_t,
                                                  int64_t, const std::vector<int64_t>&, int64_t,
                                                  int64_t, PadMode, double);
  friend HaloExchangeInFlight gather_range_start(const at::Tensor&, const DeviceMesh&, int64_t,
                                                 int64_t, const std::vector<int64_t>&,
                                                 const std::vector<std::pair<int64_t, int64_t>>&,
                                                 PadMode, double);
  std::unique_ptr<Impl> impl_;
};

/// Collective over `mesh_dim`, split phase (Note [split-phase halo]): validates
/// like halo_exchange() (throwing on every rank before any message), posts the
/// exchange and returns at once; the caller computes on its interior, then
/// calls finish(). Like PETSc's DMGlobalToLocalBegin/End.
HaloExchangeInFlight halo_exchange_start(const at::Tensor& local, const DeviceMesh& mesh,
                                         int64_t mesh_dim, int64_t dim,
                                         const std::vector<int64_t>& sizes, int64_t left,
                                         int64_t right, PadMode mode = PadMode::Constant,
                                         double value = 0.0);

/// Collective over `mesh_dim`, split phase: gather_range() posted and returned
/// at once (finish() returns exactly what gather_range() would, with the same
/// gradient). With ranges that hold only the rows next to each piece (a left
/// or right halo on its own) it moves and allocates no copy of the piece: the
/// halo-strip exchanges of the split-phase pooling (Note [split-phase pool]).
/// Validates like gather_range() (throwing on every rank before any message).
HaloExchangeInFlight gather_range_start(const at::Tensor& local, const DeviceMesh& mesh,
                                        int64_t mesh_dim, int64_t dim,
                                        const std::vector<int64_t>& sizes,
                                        const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                        PadMode mode = PadMode::Constant, double value = 0.0);

}  // namespace comm
}  // namespace shardtensor
