#pragma once
/// \file Repartition, all-to-all and box exchange plans (private to comm/):
/// who sends which rows (or N-d boxes) to whom when tensor dims change owners
/// along one mesh dim (or, for boxes, several mesh dims at once). Built
/// once from metadata that is identical on every rank (no communication),
/// run as many times as needed (each run is one all-to-allv over the mesh
/// dim), and inverted for the adjoint. The differentiable primitives
/// comm::repartition and comm::all_to_all (repartition.cpp) are built on them;
/// caching plans by spec and arguments (issue 13) stores these objects.

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/primitives.h>

#include <shardtensor/core/comm.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/primitive_support.h"

namespace shardtensor::comm {

/// Per coordinate, the global index runs it holds, in local order.
using Layout = std::vector<std::vector<Segment>>;

/// A global index run shared by a source and a destination layout.
struct Piece {
  int64_t global = 0;
  int64_t len = 0;
  int64_t src_local = 0;
  int64_t dst_local = 0;
};

/// General run remap along tensor dim `dim` over one mesh dim: rows laid out
/// per `src` become rows laid out per `dst`.
class RepartitionPlan {
 public:
  /// Local (metadata only). `src` and `dst` cover the same global indices.
  RepartitionPlan(internal::Axis axis, int64_t dim, Layout src, Layout dst);
  /// Collective over the plan's mesh dim: `local` holds this coordinate's rows
  /// per src (along dim); returns them per dst. Not differentiable.
  at::Tensor run(const at::Tensor& local) const;
  /// Local. The plan of the inverse remap (the adjoint of run()), from the
  /// plan cache (Note [repartition plan cache] in repartition.cpp).
  std::shared_ptr<const RepartitionPlan> inverse() const;

 private:
  internal::Axis axis_;
  int64_t dim_ = 0;
  Layout src_, dst_;
  std::vector<std::vector<Piece>> sends_, recvs_;  // per peer coordinate
  std::vector<int64_t> send_rows_, recv_rows_, send_displ_, recv_displ_;
  int64_t out_rows_ = 0;
};

/// Shard(src_dim) -> Shard(dst_dim) with src_dim != dst_dim over one mesh dim.
class AllToAllPlan {
 public:
  /// Local (metadata only).
  AllToAllPlan(internal::Axis axis, int64_t src_dim, std::vector<int64_t> src_sizes,
               int64_t dst_dim, std::vector<int64_t> dst_sizes);
  /// Collective over the plan's mesh dim. `local` holds src_sizes[me] along
  /// src_dim and the full extent along dst_dim. Not differentiable.
  at::Tensor run(const at::Tensor& local) const;
  /// Local. The plan of the inverse exchange (the adjoint of run()), from the
  /// plan cache (Note [repartition plan cache] in repartition.cpp).
  std::shared_ptr<const AllToAllPlan> inverse() const;

 private:
  internal::Axis axis_;
  int64_t src_dim_ = 0, dst_dim_ = 0;
  std::vector<int64_t> src_sizes_, dst_sizes_, src_off_, dst_off_;
};

/// The mesh dims of a box exchange as seen from this rank.
struct BoxGroup {
  Comm comm = comm_null();  // the sub-communicator of the involved mesh dims
  int64_t size = 1;         // coordinates of the involved mesh dims together
  int64_t me = 0;           // this rank's row-major coordinate among them (its rank in comm)
};

/// N-d boxes to N-d boxes over the ranks of a BoxGroup (Note [box exchange]):
/// coordinate c holds src[c] and gets dst[c].
class BoxExchangePlan {
 public:
  /// Local (metadata only). `src` and `dst` have one box per coordinate and
  /// cover the same indices (validated by comm::box_exchange, not here).
  BoxExchangePlan(BoxGroup group, std::vector<Box> src, std::vector<Box> dst);
  /// Collective over the group: `local` holds src[me]; returns dst[me]. Not
  /// differentiable.
  at::Tensor run(const at::Tensor& local) const;
  /// Local. The plan of the inverse exchange (the adjoint of run()), from the
  /// plan cache (Note [box exchange plan cache] in repartition.cpp).
  std::shared_ptr<const BoxExchangePlan> inverse() const;

 private:
  BoxGroup group_;
  std::vector<Box> src_, dst_;
  // Per peer coordinate, the global box sent (src[me] & dst[c]) and received
  // (src[c] & dst[me]); sends_[me] is the local copy. Empty boxes: nothing.
  std::vector<Box> sends_, recvs_;
  std::vector<int64_t> send_numel_, recv_numel_, send_displ_, recv_displ_;
};

/// Local. The cached plan of a repartition of rows laid out per `src` to rows
/// laid out per `dst` along tensor dim `dim` (built and cached on a miss;
/// Note [repartition plan cache] in repartition.cpp). The layouts must have
/// been validated.
std::shared_ptr<const RepartitionPlan> cached_repartition_plan(const internal::Axis& axis,
                                                               int64_t dim, const Layout& src,
                                                               const Layout& dst);

/// Local. The cached plan of a Shard(src_dim) -> Shard(dst_dim) exchange
/// (src_dim != dst_dim; built and cached on a miss).
std::shared_ptr<const AllToAllPlan> cached_all_to_all_plan(const internal::Axis& axis,
                                                           int64_t src_dim,
                                                           const std::vector<int64_t>& src_sizes,
                                                           int64_t dst_dim,
                                                           const std::vector<int64_t>& dst_sizes);

/// Local. Numbers of repartition and all-to-all plans cached (bounded, Note
/// [repartition plan cache] in repartition.cpp); for tests.
size_t repartition_plan_cache_size();
size_t all_to_all_plan_cache_size();

/// Local. Number of box exchange plans cached (bounded, Note [box exchange
/// plan cache] in repartition.cpp); for tests.
size_t box_plan_cache_size();

}  // namespace shardtensor::comm
