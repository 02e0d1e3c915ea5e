// Message passing on row-sharded graphs (shardtensor/ops/graph.h): the
// ShardTensor face of GhostPlan, and scatter reductions completed across
// ranks through the plan.
#include <shardtensor/ops/graph.h>
#include <shardtensor/ops/neighbors.h>
#include <shardtensor/ops/rebalance.h>

#include <ATen/ATen.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "comm/agree.h"
#include "comm/neighbors.h"
#include "ops/common.h"

namespace shardtensor {

namespace {

/// The one mesh dim sharding dim 0 of `t`; throws (alike on every rank: the
/// spec is identical everywhere) unless the others are Replicate.
int64_t row_mesh_dim(const ShardTensor& t, const char* what) {
  const auto& pl = t.placements();
  int64_t found = -1;
  for (size_t i = 0; i < pl.size(); ++i) {
    if (const auto* s = std::get_if<Shard>(&pl[i])) {
      TORCH_CHECK(s->dim == 0 && found < 0, "shardtensor::", what,
                  ": expected rows sharded Shard(0) along exactly one mesh dim (others "
                  "Replicate), got placements of a tensor of global shape ",
                  t.sizes());
      found = static_cast<int64_t>(i);
    } else {
      TORCH_CHECK(std::holds_alternative<Replicate>(pl[i]), "shardtensor::", what, ": mesh dim ", i,
                  " must be Shard(0) or Replicate (Partial is not supported)");
    }
  }
  TORCH_CHECK(found >= 0, "shardtensor::", what, ": the tensor of global shape ", t.sizes(),
              " is not sharded by rows along any mesh dim");
  return found;
}

Placements node_placements(const GhostPlan& plan) {
  Placements pl(plan.mesh().ndim(), Replicate{});
  pl[plan.mesh_dim()] = Shard{0};
  return pl;
}

}  // namespace

GhostPlan ghost_plan(const at::Tensor& nodes, const at::Tensor& needed_ids) {
  TORCH_CHECK(ShardTensor::is_shard_tensor(nodes),
              "shardtensor::ghost_plan: `nodes` must be a ShardTensor sharded Shard(0)");
  ShardTensor x(nodes);
  const int64_t md = row_mesh_dim(x, "ghost_plan");
  return GhostPlan::build(x.mesh(), md, x.spec().shard_sizes(md), needed_ids);
}

at::Tensor extend_rows(const at::Tensor& x_in, const GhostPlan& plan) {
  // Note [pending partial sums]: a Partial mesh dim is summed first.
  const at::Tensor x = ops::summed_partial(x_in);
  if (ShardTensor::is_shard_tensor(x)) {
    ShardTensor s(x);
    const int64_t md = row_mesh_dim(s, "extend_rows");
    TORCH_CHECK(md == plan.mesh_dim() && s.spec().shard_sizes(md) == plan.sizes(),
                "shardtensor::extend_rows: the ShardTensor (global shape ", x.sizes(),
                ") is not laid out like the plan's nodes (sizes ", at::IntArrayRef(plan.sizes()),
                " along mesh dim ", plan.mesh_dim(), ")");
    return ghost_exchange(s.local(), plan);
  }
  return ghost_exchange(x, plan);
}

at::Tensor gather_rows(const at::Tensor& x_ext, const at::Tensor& local_index) {
  TORCH_CHECK(local_index.dim() == 1 && local_index.scalar_type() == at::kLong,
              "shardtensor::gather_rows: expected a 1-D int64 index, got shape ",
              local_index.sizes());
  return x_ext.index_select(0, local_index);
}

at::Tensor node_tensor(const at::Tensor& local, const GhostPlan& plan) {
  ShardSizes sizes(plan.mesh().ndim());
  sizes[plan.mesh_dim()] = plan.sizes();
  return ShardTensor::from_local(local, plan.mesh(), node_placements(plan), sizes);
}

at::Tensor rows_like(const at::Tensor& local, const at::Tensor& like) {
  TORCH_CHECK(ShardTensor::is_shard_tensor(like),
              "shardtensor::rows_like: `like` must be a ShardTensor sharded by rows");
  ShardTensor l(like);
  row_mesh_dim(l, "rows_like");
  return ShardTensor::from_local(local, l.mesh(), l.placements(), l.spec().all_shard_sizes());
}

at::Tensor scatter_rows(const at::Tensor& messages, const at::Tensor& local_index,
                        const GhostPlan& plan, const ScatterOptions& options) {
  // Note [pending partial sums]: the local piece of a Partial is only a summand.
  const at::Tensor summed = ops::summed_partial(messages);
  at::Tensor m = ShardTensor::is_shard_tensor(summed) ? ShardTensor(summed).local() : summed;
  bool ok = m.defined() && m.dim() >= 1 && local_index.defined() && local_index.dim() == 1 &&
            local_index.scalar_type() == at::kLong && local_index.numel() == m.size(0);
  std::string msg;
  if (!ok) {
    std::ostringstream os;
    os << "expected local messages [E, ...] and a 1-D int64 local_index of E entries, got "
          "messages of shape "
       << (m.defined() ? m.sizes() : at::IntArrayRef{}) << " and local_index of shape "
       << (local_index.defined() ? local_index.sizes() : at::IntArrayRef{});
    msg = os.str();
  }
  comm::check_all(plan.mesh(), ok, "shardtensor::scatter_rows", msg);

  const auto dtype = m.scalar_type();
  const auto acc = options.accumulate_dtype().value_or(dtype);
  std::vector<int64_t> ext_shape(m.sizes().begin(), m.sizes().end());
  ext_shape[0] = plan.num_extended();
  // Counts per node, broadcastable against the node rows.
  auto counts = [&](const at::Tensor& per_row) {
    std::vector<int64_t> cshape(ext_shape.begin(), ext_shape.end());
    cshape[0] = plan.num_extended();
    at::Tensor ext = at::zeros(cshape, m.options().dtype(acc)).index_add_(0, local_index, per_row);
    return ghost_accumulate_nograd(ext, plan, ReduceOp::Sum);
  };

  at::Tensor out;
  switch (options.reduce()) {
    case ScatterReduce::Sum:
    case ScatterReduce::Mean: {
      at::Tensor ext =
          at::zeros(ext_shape, m.options().dtype(acc)).index_add(0, local_index, m.to(acc));
      out = ghost_accumulate(ext, plan);
      if (options.reduce() == ScatterReduce::Mean) {
        at::Tensor c;
        {
          at::NoGradGuard g;
          c = counts(at::ones(m.sizes(), m.options().dtype(acc))).clamp_min(1);
        }
        out = out / c;
      }
      out = out.to(dtype);
      break;
    }
    case ScatterReduce::Amax: {
      at::Tensor top, tie;
      {
        at::NoGradGuard g;
        at::Tensor md = m.detach();
        at::Tensor part = at::full(ext_shape, -std::numeric_limits<double>::infinity(), m.options())
                              .index_reduce_(0, local_index, md, "amax", /*include_self=*/true);
        top = ghost_accumulate_nograd(part, plan, ReduceOp::Max);  // global max per owned row
        at::Tensor top_ext = ghost_exchange(top, plan);
        tie = md.eq(top_ext.index_select(0, local_index));
        top = at::where(top.isneginf(), at::zeros_like(top), top);
      }
      at::Tensor cnt = counts(tie.to(acc));
      at::Tensor ext = at::zeros(ext_shape, m.options().dtype(acc))
                           .index_add(0, local_index, (m * tie.to(m.scalar_type())).to(acc));
      at::Tensor val = ghost_accumulate(ext, plan) / cnt.clamp_min(1);
      val = val.to(dtype);
      // Forward: exactly the maximum; backward: the gradient split evenly among ties.
      out = top + (val - val.detach());
      break;
    }
  }
  return node_tensor(out, plan);
}

// ---- neighbour search ------------------------------------------------------------

namespace {

std::pair<at::Tensor, at::Tensor> neighbor_search(const char* what, const at::Tensor& queries,
                                                  const at::Tensor& points, int64_t k,
                                                  double radius, NeighborStats* stats) {
  TORCH_CHECK(queries.defined() && points.defined() && queries.dim() == 2 && points.dim() == 2 &&
                  queries.size(1) == points.size(1),
              "shardtensor::", what, ": expected queries [Nq, d] and points [Np, d], got ",
              queries.sizes(), " and ", points.sizes());
  TORCH_CHECK(queries.is_floating_point() && points.is_floating_point(), "shardtensor::", what,
              ": expected floating-point coordinates");
  const bool sq = ShardTensor::is_shard_tensor(queries), sp = ShardTensor::is_shard_tensor(points);
  TORCH_CHECK(sq == sp, "shardtensor::", what,
              ": queries and points must both be ShardTensors or both plain tensors");
  comm::NeighborResult res;
  if (!sq) {
    res = comm::ring_neighbors(queries, points, DeviceMesh(), 0, {points.size(0)}, k, radius);
  } else {
    // Note [pending partial sums]: coordinates are summed first.
    ShardTensor q(ops::summed_partial(queries)), p(ops::summed_partial(points));
    const int64_t mq = row_mesh_dim(q, what), mp = row_mesh_dim(p, what);
    TORCH_CHECK(q.mesh() == p.mesh() && mq == mp, "shardtensor::", what,
                ": queries and points must be sharded by rows along the same mesh dim of the "
                "same mesh (got mesh dims ",
                mq, " and ", mp, ")");
    res = comm::ring_neighbors(q.local(), p.local(), q.mesh(), mq, p.spec().shard_sizes(mp), k,
                               radius);
    res.index =
        ShardTensor::from_local(res.index, q.mesh(), q.placements(), q.spec().all_shard_sizes());
    res.dist =
        ShardTensor::from_local(res.dist, q.mesh(), q.placements(), q.spec().all_shard_sizes());
  }
  if (stats) {
    stats->pieces_fetched = res.stats.pieces_fetched;
    stats->pieces_skipped = res.stats.pieces_skipped;
    stats->bytes_fetched = res.stats.bytes_fetched;
    stats->bytes_skipped = res.stats.bytes_skipped;
  }
  return {res.index, res.dist};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> knn(const at::Tensor& queries, const at::Tensor& points,
                                      int64_t k, NeighborStats* stats) {
  TORCH_CHECK(k >= 1, "shardtensor::knn: k must be >= 1, got ", k);
  return neighbor_search("knn", queries, points, k, std::numeric_limits<double>::infinity(), stats);
}

std::pair<at::Tensor, at::Tensor> radius_search(const at::Tensor& queries, const at::Tensor& points,
                                                double r, int64_t max_neighbors,
                                                NeighborStats* stats) {
  TORCH_CHECK(max_neighbors >= 1, "shardtensor::radius_search: max_neighbors must be >= 1, got ",
              max_neighbors);
  TORCH_CHECK(r >= 0, "shardtensor::radius_search: r must be >= 0, got ", r);
  return neighbor_search("radius_search", queries, points, max_neighbors, r, stats);
}

// ---- rebalancing by cost (Note [rebalance by cost]) ------------------------------

std::vector<int64_t> balanced_sizes_by_cost(const at::Tensor& weights) {
  TORCH_CHECK(ShardTensor::is_shard_tensor(weights) && weights.dim() == 1,
              "shardtensor::balanced_sizes_by_cost: expected a 1-D ShardTensor of per-row costs, "
              "got shape ",
              weights.sizes());
  ShardTensor w(weights);
  const int64_t md = row_mesh_dim(w, "balanced_sizes_by_cost");
  const auto& mesh = w.mesh();
  const int64_t P = mesh.size(md), me = mesh.coordinate()[md];
  at::Tensor lw = w.local().detach().to(at::kDouble);
  const bool ok =
      lw.numel() == 0 || (lw.ge(0).all().item<bool>() && lw.isfinite().all().item<bool>());
  comm::check_all(mesh, ok, "shardtensor::balanced_sizes_by_cost",
                  "a weight is negative or not finite");
  // Totals per coordinate of the mesh dim (summed over that mesh dim only).
  at::Tensor totals = at::zeros({P}, at::kDouble);
  totals[me] = lw.sum();
  totals = comm::all_reduce_nograd(totals, mesh, {md}, ReduceOp::Sum);
  const double W = totals.sum().item<double>();
  const double before = totals.narrow(0, 0, me).sum().item<double>();
  at::Tensor mid = lw.cumsum(0) - lw * 0.5 + before;
  std::vector<int64_t> sizes(P, 0);
  const int64_t n = w.size(0);
  if (!(W > 0)) {
    for (int64_t c = 0; c < P; ++c) sizes[c] = n / P + (c < n % P ? 1 : 0);
    return sizes;
  }
  at::Tensor cuts_at = at::arange(1, P, at::kDouble) * (W / static_cast<double>(P));
  at::Tensor below =
      mid.numel() > 0 ? at::searchsorted(mid.contiguous(), cuts_at) : at::zeros({P - 1}, at::kLong);
  at::Tensor cuts = comm::all_reduce_nograd(below.to(at::kLong), mesh, {md}, ReduceOp::Sum);
  std::vector<int64_t> c(P + 1, 0);
  c[P] = n;
  for (int64_t i = 1; i < P; ++i) c[i] = cuts[i - 1].item<int64_t>();
  for (int64_t i = 0; i < P; ++i) sizes[i] = c[i + 1] - c[i];
  return sizes;
}

std::vector<at::Tensor> rebalance(const std::vector<at::Tensor>& tensors, const at::Tensor& weights,
                                  std::vector<int64_t>* new_sizes) {
  std::vector<int64_t> sizes = balanced_sizes_by_cost(weights);
  ShardTensor w(weights);
  const int64_t md = row_mesh_dim(w, "rebalance");
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) {
    TORCH_CHECK(ShardTensor::is_shard_tensor(t),
                "shardtensor::rebalance: every tensor must be a "
                "ShardTensor sharded by rows like the weights");
    ShardTensor s(t);
    const int64_t tmd = row_mesh_dim(s, "rebalance");
    TORCH_CHECK(
        tmd == md && s.spec().shard_sizes(tmd) == w.spec().shard_sizes(md) && s.mesh() == w.mesh(),
        "shardtensor::rebalance: a tensor of global shape ", t.sizes(),
        " is not sharded by rows like the weights (mesh dim ", md, ", sizes ",
        at::IntArrayRef(w.spec().shard_sizes(md)), ")");
    ShardSizes all = s.spec().all_shard_sizes();
    all[md] = sizes;
    out.push_back(s.redistribute(s.placements(), all));
  }
  if (new_sizes) *new_sizes = sizes;
  return out;
}

std::vector<at::Tensor> rebalance(const std::vector<at::Tensor>& tensors, double measured_seconds,
                                  std::vector<int64_t>* new_sizes) {
  TORCH_CHECK(!tensors.empty() && ShardTensor::is_shard_tensor(tensors[0]),
              "shardtensor::rebalance(measured_seconds): expected at least one ShardTensor "
              "sharded by rows");
  ShardTensor first(tensors[0]);
  const int64_t md = row_mesh_dim(first, "rebalance");
  const auto& mesh = first.mesh();
  comm::check_all(
      mesh, std::isfinite(measured_seconds) && measured_seconds >= 0,
      "shardtensor::rebalance(measured_seconds)",
      "measured_seconds must be finite and >= 0, got " + std::to_string(measured_seconds));
  // Replicas along the other mesh dims hold the same rows but timed their own
  // run: take the slowest, so that every replica gets the same weights.
  std::vector<int64_t> others;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    if (d != md) others.push_back(d);
  }
  at::Tensor secs = at::full({1}, measured_seconds, at::kDouble);
  if (!others.empty()) secs = comm::all_reduce_nograd(secs, mesh, others, ReduceOp::Max);
  const int64_t rows = first.local().size(0);
  at::Tensor w_local = at::full(
      {rows}, rows > 0 ? secs.item<double>() / static_cast<double>(rows) : 0.0, at::kDouble);
  at::Tensor weights =
      ShardTensor::from_local(w_local, mesh, first.placements(), first.spec().all_shard_sizes());
  return rebalance(tensors, weights, new_sizes);
}

RebalancedGraph rebalance_graph(const std::vector<at::Tensor>& node_tensors,
                                const at::Tensor& edge_index,
                                const std::vector<at::Tensor>& edge_tensors,
                                const at::Tensor& weights, int64_t dst_column) {
  const char* what = "shardtensor::rebalance_graph";
  TORCH_CHECK(ShardTensor::is_shard_tensor(edge_index) && edge_index.dim() == 2 &&
                  edge_index.scalar_type() == at::kLong,
              what, ": edge_index must be an int64 ShardTensor [E, k] sharded by rows, got shape ",
              edge_index.sizes(), " and dtype ", edge_index.scalar_type());
  ShardTensor ei(edge_index);
  const int64_t emd = row_mesh_dim(ei, "rebalance_graph");
  TORCH_CHECK(dst_column >= 0 && dst_column < edge_index.size(1), what, ": dst_column ", dst_column,
              " is out of range for edge_index of shape ", edge_index.sizes());
  RebalancedGraph out;
  out.nodes = rebalance(node_tensors, weights, &out.node_sizes);
  ShardTensor w(weights);
  const int64_t md = row_mesh_dim(w, "rebalance_graph");
  TORCH_CHECK(emd == md && ei.mesh() == w.mesh(), what,
              ": edge_index must be sharded by rows along the same mesh dim as the nodes (", md,
              "), got mesh dim ", emd);
  const auto& mesh = w.mesh();
  const int64_t P = mesh.size(md), me = mesh.coordinate()[md];
  const int64_t n = w.size(0);
  // The owner of every local edge's destination under the new partition.
  at::Tensor ends = at::tensor(std::vector<int64_t>(out.node_sizes.begin(), out.node_sizes.end()))
                        .cumsum(0);  // exclusive upper bounds of coordinates
  at::Tensor dst = ei.local().select(1, dst_column).contiguous();
  const bool ids_ok =
      dst.numel() == 0 || (dst.ge(0).all().item<bool>() && dst.lt(n).all().item<bool>());
  comm::check_all(mesh, ids_ok, what,
                  "a destination id in edge_index is outside [0, " + std::to_string(n) + ")");
  at::Tensor owner = at::searchsorted(ends, dst, /*out_int32=*/false, /*right=*/true);
  at::Tensor perm = owner.numel() > 0 ? std::get<1>(owner.sort(/*stable=*/true, 0, false))
                                      : at::zeros({0}, at::kLong);
  at::Tensor counts = at::zeros({P, P}, at::kLong);
  if (owner.numel() > 0) counts[me] = at::bincount(owner, {}, P);
  counts = comm::all_reduce_nograd(counts, mesh, {md}, ReduceOp::Sum);  // [from, to]
  at::Tensor before = counts.cumsum(0) - counts;                        // rows from lower ranks
  at::Tensor dst_total = counts.sum(0);
  std::vector<int64_t> dst_sizes(P);
  for (int64_t c = 0; c < P; ++c) dst_sizes[c] = dst_total[c].item<int64_t>();
  std::vector<int64_t> dst_off(P, 0);
  for (int64_t c = 1; c < P; ++c) dst_off[c] = dst_off[c - 1] + dst_sizes[c - 1];
  std::vector<std::vector<comm::Segment>> segments(P);
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t c = 0; c < P; ++c) {
      const int64_t len = counts[r][c].item<int64_t>();
      if (len > 0) segments[r].push_back({dst_off[c] + before[r][c].item<int64_t>(), len});
    }
  }
  out.edge_sizes = dst_sizes;
  auto move_edges = [&](const at::Tensor& t) {
    TORCH_CHECK(ShardTensor::is_shard_tensor(t), what,
                ": every edge tensor must be a ShardTensor sharded by rows like edge_index");
    ShardTensor s(t);
    const int64_t tmd = row_mesh_dim(s, "rebalance_graph");
    TORCH_CHECK(tmd == md && s.spec().shard_sizes(tmd) == ei.spec().shard_sizes(md), what,
                ": an edge tensor of global shape ", t.sizes(),
                " is not sharded by rows like edge_index (sizes ",
                at::IntArrayRef(ei.spec().shard_sizes(md)), ")");
    at::Tensor sorted = s.local().index_select(0, perm);
    at::Tensor moved = comm::repartition(sorted, mesh, md, 0, segments, dst_sizes);
    ShardSizes all = s.spec().all_shard_sizes();
    all[md] = dst_sizes;
    return ShardTensor::from_local(moved, mesh, s.placements(), all);
  };
  out.edge_index = move_edges(edge_index);
  for (const auto& t : edge_tensors) out.edges.push_back(move_edges(t));
  out.plan =
      GhostPlan::build(mesh, md, out.node_sizes, ShardTensor(out.edge_index).local().flatten());
  return out;
}

}  // namespace shardtensor
