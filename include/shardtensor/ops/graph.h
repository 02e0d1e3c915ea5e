#pragma once
/// \file Message passing on row-sharded graphs, through GhostPlans
/// (Note [ghost plans], shardtensor/comm/ghost.h).
///
/// Nodes are a ShardTensor sharded Shard(0) along one mesh dim (any other
/// mesh dims Replicate), with uneven sizes allowed (zeros included). Edges
/// are sharded by rows too (any sizes, along the same mesh dim); each rank's
/// edge rows carry the *global* ids of their endpoints. A message-passing
/// layer as users write it:
///
/// ```cpp
/// auto ei = ShardTensor(edge_index).local();                 // [E_local, 2] global ids
/// auto plan = st::ghost_plan(x, ei.flatten());               // once per partition
/// auto src = plan.local_index(ei.select(1, 0)), dst = plan.local_index(ei.select(1, 1));
/// auto x_ext = st::extend_rows(x, plan);                     // [owned | ghost] rows
/// auto m = st::gather_rows(x_ext, src);                      // per-edge features
/// m = mlp(st::edge_tensor(m, edge_index));                   // any libtorch module
/// auto agg = st::scatter_rows(m, dst, plan, st::ScatterOptions().reduce(st::ScatterReduce::Mean));
/// ```
/// Forward and backward equal single-process
/// `x.index_select(0, src)` / `zeros({N, F}).index_reduce(0, dst, m, reduce, include_self=false)`
/// on the whole graph.

#include <ATen/core/Tensor.h>
#include <shardtensor/comm/ghost.h>

#include <cstdint>

namespace shardtensor {

/// **Collective** over every rank of the nodes' mesh. A GhostPlan for the
/// node ShardTensor `nodes` (Shard(0) on exactly one mesh dim, Replicate on
/// the others; its shard sizes are the plan's sizes) and this rank's needed
/// global node ids. Throws c10::Error on every rank if `nodes` is not such a
/// ShardTensor, or as GhostPlan::build().
GhostPlan ghost_plan(const at::Tensor& nodes, const at::Tensor& needed_ids);

/// **Collective** over plan.mesh_dim(). This rank's extended node rows
/// `[owned | ghost]` (a plain local tensor) of `x`: a ShardTensor laid out
/// like the plan's nodes, or this rank's local owned rows. Differentiable
/// (ghost_exchange()). A Partial mesh dim of `x` is summed first (collective
/// over it; Note [pending partial sums]). Throws c10::Error if the rows do not
/// match the plan.
at::Tensor extend_rows(const at::Tensor& x, const GhostPlan& plan);

/// **Local**. Rows `local_index` (from plan.local_index()) of `x_ext`
/// (index_select along dim 0; differentiable). `local_index` may be any
/// int64 1-D tensor.
at::Tensor gather_rows(const at::Tensor& x_ext, const at::Tensor& local_index);

/// How scatter_rows() combines the messages arriving at one node.
enum class ScatterReduce { Sum, Mean, Amax };

struct ScatterOptions {
  ScatterOptions& reduce(ScatterReduce r) {
    reduce_ = r;
    return *this;
  }
  ScatterReduce reduce() const { return reduce_; }
  /// Dtype the sums are formed in, locally and across ranks (e.g. at::kDouble
  /// for float32 messages); the result has the messages' dtype.
  ScatterOptions& accumulate_dtype(c10::optional<at::ScalarType> d) {
    accumulate_dtype_ = d;
    return *this;
  }
  c10::optional<at::ScalarType> accumulate_dtype() const { return accumulate_dtype_; }

 private:
  ScatterReduce reduce_ = ScatterReduce::Sum;
  c10::optional<at::ScalarType> accumulate_dtype_;
};

/// **Collective** over every rank of the plan's mesh (shard-tensor wrapping)
/// and plan.mesh_dim() (the ghost accumulate). Combines the message rows
/// `messages` (a ShardTensor sharded by rows, a Partial mesh dim summed first,
/// or a local tensor; row i goes to
/// extended row local_index[i]) into the nodes: the single-process
/// `zeros({N, *F}).index_reduce(0, index, messages, reduce, include_self=false)`
/// (Sum: index_add; a node with no message gets 0). Returns a ShardTensor of
/// the nodes' layout. Differentiable (Sum and Mean also twice); Amax sends
/// the gradient to the maximal messages, split evenly among ties, as libtorch.
/// Throws c10::Error if local_index does not have one entry per message row.
at::Tensor scatter_rows(const at::Tensor& messages, const at::Tensor& local_index,
                        const GhostPlan& plan, const ScatterOptions& options = {});

/// **Collective** over every rank of the plan's mesh (one all-reduce of an
/// error flag). Wraps this rank's owned node rows `local` (plan.num_owned()
/// rows) as a ShardTensor of the nodes' layout.
at::Tensor node_tensor(const at::Tensor& local, const GhostPlan& plan);

/// **Collective** over every rank of `like`'s mesh. Wraps the local rows
/// `local` (one per local row of the row-sharded ShardTensor `like`, e.g. the
/// edge index) as a ShardTensor with `like`'s row layout, so that libtorch
/// modules run on per-edge data through the dispatcher.
at::Tensor rows_like(const at::Tensor& local, const at::Tensor& like);

}  // namespace shardtensor
