"""Irregular data: point clouds, graphs and meshes sharded by rows (docs/irregular.md).

Neighbour search (C++ ops/neighbors.h), neighbourhood attention
(ops/neighborhood_attention.h), index halos (comm/ghost.h, Note [ghost plans]),
message passing (ops/graph.h) and rebalancing by cost (ops/rebalance.h, Note
[rebalance by cost]). Same names and semantics as in C++; the options structs
(GhostOptions, ScatterOptions) are keyword arguments, the out-parameters
(NeighborStats, new_sizes) are returned on request. A message-passing layer::

    ei = edge_index.to_local()                                 # [E_local, 2] global ids
    plan = st.ghost_plan(x, ei.flatten())                      # once per partition
    src, dst = plan.local_index(ei[:, 0]), plan.local_index(ei[:, 1])
    x_ext = st.extend_rows(x, plan)                            # [owned | ghost] rows
    m = mlp(st.rows_like(st.gather_rows(x_ext, src), edge_index))  # any torch module
    agg = st.scatter_rows(m, dst, plan, reduce="mean")         # a ShardTensor like x
"""

import numbers
from typing import List, NamedTuple

import torch

from . import _C
from ._mesh import DeviceMesh
from ._tensor import _wrap, _wrap_result

__all__ = [
    "knn", "radius_search", "neighborhood_attention", "GhostPlan", "ghost_plan",
    "ghost_exchange", "ghost_accumulate", "ghost_accumulate_nograd", "extend_rows",
    "gather_rows", "scatter_rows", "node_tensor", "rows_like", "balanced_sizes_by_cost",
    "rebalance", "rebalance_graph", "RebalancedGraph",
]


def _tensor_list(tensors, what, name):
    """A list of tensors (a lone tensor counts as one: iterating a ShardTensor would slice it)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out = list(tensors)
    for t in out:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shardtensor.{what}: {name} must hold tensors, got {type(t).__name__}")
    return out


def _plan(plan, what):
    if not isinstance(plan, GhostPlan):
        raise TypeError(f"shardtensor.{what}: expected a shardtensor.GhostPlan, got "
                        f"{type(plan).__name__}")
    return plan._c


def _local_rows(t, what, instead):
    from ._tensor import ShardTensor

    if isinstance(t, ShardTensor):
        raise TypeError(f"shardtensor.{what}: expected this rank's rows as a plain tensor, got a "
                        f"ShardTensor (use {instead}, or pass .to_local())")
    return t


# ---- neighbour search -----------------------------------------------------------


def knn(queries, points, k, *, return_stats=False):
    """The ``k`` nearest points of every query: returns ``(index, distance)``, both
    ``[num_queries, k]``: global point ids (int64) and Euclidean distances (the
    points' dtype), ordered by distance, ties broken by the smaller global id;
    id -1 and distance +inf where fewer than k points exist.

    ``queries`` [Nq, d] and ``points`` [Np, d] are both ShardTensors sharded
    Shard(0) along the same one mesh dim (others Replicate; a Partial mesh dim
    is summed first), any sizes including empty pieces; the results are
    ShardTensors laid out like ``queries``. Both plain: a single-process search
    (local). Not differentiable. With ``return_stats=True`` a third element, a
    dict of this rank's ``pieces_fetched``, ``pieces_skipped``,
    ``bytes_fetched``, ``bytes_skipped`` (the bounding-box pre-filter's savings).

    Collective over every rank of the mesh (argument check) and the mesh dim
    that shards the rows (the ring). Raises RuntimeError on every rank, before
    any communication, if k < 1, the tensors are not 2-D with the same d, or are
    not sharded as described. C++: shardtensor::knn.
    """
    idx, dist, stats = _C.knn(queries, points, int(k))
    out = (_wrap(idx), _wrap(dist))
    return out + (stats,) if return_stats else out


def radius_search(queries, points, r, max_neighbors, *, return_stats=False):
    """Like :func:`knn` with k = ``max_neighbors``, keeping only points within
    distance ``r`` (inclusive): the up to max_neighbors nearest points within r
    of every query (id -1, distance +inf in the unused slots).

    Collective over every rank of the mesh and the mesh dim that shards the rows
    (local for plain tensors). Raises RuntimeError on every rank, before any
    communication, as knn does, and if r < 0 or max_neighbors < 1.
    C++: shardtensor::radius_search.
    """
    idx, dist, stats = _C.radius_search(queries, points, float(r), int(max_neighbors))
    out = (_wrap(idx), _wrap(dist))
    return out + (stats,) if return_stats else out


# ---- neighbourhood attention ----------------------------------------------------


def neighborhood_attention(query, key, value, kernel_size, dilation=1, is_causal=False,
                           scale=None):
    """``softmax(q k^T * scale) v`` over each query's neighbourhood on 1-, 2- and 3-D
    token grids, as NATTEN's na1d/na2d/na3d (Note [neighbourhood window]: per
    spatial dim K = ``kernel_size`` keys of the query's residue class mod
    ``dilation``, centred and shifted inward at the borders; causal: the K keys
    ending at the query). ``query``/``key`` are [B, heads, *spatial, D], ``value``
    [B, heads, *spatial, Dv]; the result is [B, heads, *spatial, Dv].
    ``scale`` defaults to 1/sqrt(D). Differentiable.

    Plain tensors: Local. ShardTensors (all three, same mesh, placements and
    shard sizes; Shard of a spatial dim, Shard(0) or Replicate per mesh dim,
    uneven and empty pieces fine): Collective over the mesh dims that shard
    spatial dims (key/value halos between neighbouring coordinates, multi-hop
    across small or empty pieces); the result is a ShardTensor laid out like
    ``query``. Raises RuntimeError on every rank,
    before any communication, naming the op, shapes and placements, for a mix of
    plain and sharded inputs, 0 or more than 3 spatial dims, mismatched shapes or
    dtypes, an even or non-positive kernel_size, a non-positive dilation,
    kernel_size * dilation larger than a spatial extent, a bad scale, or a
    sharded head or feature dim. C++: shardtensor::neighborhood_attention.
    """
    return _wrap(_C.neighborhood_attention(query, key, value, int(kernel_size), int(dilation),
                                           bool(is_causal),
                                           None if scale is None else float(scale)))


# ---- index halos ----------------------------------------------------------------


class GhostPlan:
    """A reusable index-halo plan (Note [ghost plans]): items sharded by rows along
    one mesh dim, coordinate c owning global ids ``[offset_c, offset_c + sizes[c])``;
    for every peer, which owned rows it needs and how many ghost rows come from
    it. A rank's *extended* rows are ``[owned | ghost]``, ghosts sorted by global
    id. Immutable metadata, built once (:meth:`build` or :func:`ghost_plan`) and
    reused by every :func:`ghost_exchange` / :func:`ghost_accumulate`.
    Accessors are Local; :meth:`build` is Collective over the mesh.
    C++: shardtensor::GhostPlan.
    """

    __slots__ = ("_c",)

    def __init__(self, *args, **kwargs):
        raise TypeError("GhostPlan is not constructed directly: use GhostPlan.build(mesh, "
                        "mesh_dim, sizes, needed_ids) or shardtensor.ghost_plan(nodes, needed_ids)")

    @classmethod
    def _from_c(cls, cplan):
        plan = object.__new__(cls)
        plan._c = cplan
        return plan

    @classmethod
    def build(cls, mesh, mesh_dim, sizes, needed_ids):
        """``sizes[c]``: the rows owned by coordinate c of ``mesh_dim`` (an index or
        a name; identical on every rank); ``needed_ids`` (1-D int64, any order,
        duplicates allowed): the global ids this rank needs. Ids it owns are
        ignored; the rest become its ghosts.

        Collective over every rank of ``mesh`` (the argument check) and over the
        sub-communicator of ``mesh_dim`` (the plan itself). Raises RuntimeError on
        every rank, before the plan's communication, if the mesh or mesh_dim is
        invalid, sizes has the wrong length or a negative entry, or any rank's
        ``needed_ids`` is not 1-D int64 or holds an id outside [0, sum(sizes)).
        C++: GhostPlan::build.
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"GhostPlan.build: expected a shardtensor.DeviceMesh, got "
                            f"{type(mesh).__name__}")
        if isinstance(mesh_dim, str):
            mesh_dim = mesh._dim(mesh_dim)
        if not isinstance(needed_ids, torch.Tensor):
            needed_ids = torch.as_tensor(needed_ids, dtype=torch.long)
        return cls._from_c(_C.GhostPlan.build(mesh._c, int(mesh_dim), [int(s) for s in sizes],
                                              needed_ids))

    @property
    def mesh(self):
        """The DeviceMesh of the plan. Local."""
        return DeviceMesh._from_c(self._c.mesh)

    @property
    def mesh_dim(self):
        """The mesh dim that shards the rows. Local."""
        return self._c.mesh_dim

    @property
    def sizes(self):
        """Rows owned per coordinate of mesh_dim (a list). Local."""
        return list(self._c.sizes)

    @property
    def num_global(self):
        """sum(sizes). Local."""
        return self._c.num_global

    @property
    def owned_offset(self):
        """Global id of this rank's first owned row. Local."""
        return self._c.owned_offset

    @property
    def num_owned(self):
        """Rows this rank owns. Local."""
        return self._c.num_owned

    @property
    def num_ghost(self):
        """Ghost rows this rank receives. Local."""
        return self._c.num_ghost

    @property
    def num_extended(self):
        """num_owned + num_ghost. Local."""
        return self._c.num_extended

    @property
    def ghost_ids(self):
        """Global ids of the ghost rows, sorted ascending (int64 [num_ghost]; a copy). Local."""
        return self._c.ghost_ids

    @property
    def num_send_rows(self):
        """Rows this rank sends in one exchange (owned rows, counted once per peer). Local."""
        return self._c.num_send_rows

    @property
    def recv_peers(self):
        """Coordinates along mesh_dim this rank receives ghosts from (a list). Local."""
        return list(self._c.recv_peers)

    def local_index(self, global_ids):
        """Rows of the extended layout ``[owned | ghost]`` holding the items
        ``global_ids`` (int64, any shape; the result has the same shape). Local.
        Raises RuntimeError (on this rank) if an id is neither owned by this rank
        nor one of its ghosts. C++: GhostPlan::local_index."""
        return self._c.local_index(global_ids)

    def __repr__(self):
        try:
            return (f"GhostPlan(mesh_dim={self.mesh_dim}, sizes={self.sizes}, "
                    f"num_owned={self.num_owned}, num_ghost={self.num_ghost})")
        except Exception as e:  # pragma: no cover - defensive: repr never fails
            return f"GhostPlan(<unprintable: {e}>)"


def ghost_plan(nodes, needed_ids):
    """A :class:`GhostPlan` for the node ShardTensor ``nodes`` (Shard(0) on exactly
    one mesh dim, Replicate on the others; its shard sizes are the plan's sizes)
    and this rank's needed global node ids (1-D int64).

    Collective over every rank of the nodes' mesh. Raises RuntimeError on every
    rank if ``nodes`` is not such a ShardTensor, or as GhostPlan.build.
    C++: shardtensor::ghost_plan.
    """
    if not isinstance(needed_ids, torch.Tensor):
        needed_ids = torch.as_tensor(needed_ids, dtype=torch.long)
    return GhostPlan._from_c(_C.ghost_plan(nodes, needed_ids))


def ghost_exchange(owned, plan):
    """This rank's extended rows ``[owned | ghost]`` (plan.num_extended rows) from its
    ``owned`` rows (plan.num_owned rows along dim 0, a plain tensor; any trailing
    shape, the same on every rank): owners send the rows their peers need.
    Differentiable: the backward is :func:`ghost_accumulate` (ghost gradients are
    summed on their owners), and double backward works.

    Collective over ``plan.mesh_dim``. Raises RuntimeError if ``owned`` has the
    wrong number of rows (on that rank: keep shapes consistent), TypeError for a
    ShardTensor (use :func:`extend_rows`). C++: shardtensor::ghost_exchange.
    """
    return _C.ghost_exchange(_local_rows(owned, "ghost_exchange", "extend_rows"),
                             _plan(plan, "ghost_exchange"))


def ghost_accumulate(extended, plan, *, accumulate_dtype=None):
    """The adjoint of :func:`ghost_exchange`: from ``extended`` (plan.num_extended
    rows), this rank's owned rows plus, for every owned item, the ghost rows other
    ranks hold for it (the scatter-add of message passing, completed across
    ranks). ``accumulate_dtype`` (e.g. torch.float64 for float32 data with large
    sums): the dtype the contributions are summed and travel in; the result has
    the input's dtype. Differentiable: the backward is ghost_exchange.

    Collective over ``plan.mesh_dim``. Raises like ghost_exchange.
    C++: shardtensor::ghost_accumulate (GhostOptions::accumulate_dtype).
    """
    return _C.ghost_accumulate(_local_rows(extended, "ghost_accumulate", "scatter_rows"),
                               _plan(plan, "ghost_accumulate"), accumulate_dtype)


def ghost_accumulate_nograd(extended, plan, reduce="sum"):
    """Like :func:`ghost_accumulate` with the owned row and every ghost copy of it
    combined by ``reduce``: "sum", "amax", "amin" or "prod" (scatter_reduce across
    ranks). Not differentiable (detached).

    Collective over ``plan.mesh_dim``. Raises ValueError on every rank for an
    unknown ``reduce``, else like ghost_accumulate.
    C++: shardtensor::ghost_accumulate_nograd.
    """
    return _C.ghost_accumulate_nograd(
        _local_rows(extended, "ghost_accumulate_nograd", "scatter_rows"),
        _plan(plan, "ghost_accumulate_nograd"), str(reduce))


# ---- message passing ------------------------------------------------------------


def extend_rows(x, plan):
    """This rank's extended node rows ``[owned | ghost]`` (a plain local tensor) of
    ``x``: a ShardTensor laid out like the plan's nodes, or this rank's local
    owned rows. Differentiable (:func:`ghost_exchange`).

    Collective over ``plan.mesh_dim`` (and over a Partial mesh dim of ``x``,
    which is summed first). Raises RuntimeError if the rows do not match the
    plan. C++: shardtensor::extend_rows.
    """
    return _C.extend_rows(x, _plan(plan, "extend_rows"))


def gather_rows(x_ext, local_index):
    """Rows ``local_index`` (1-D int64, from plan.local_index) of ``x_ext``
    (index_select along dim 0; differentiable). Local. Raises RuntimeError for an
    index that is not 1-D int64. C++: shardtensor::gather_rows."""
    return _wrap_result(_C.gather_rows(x_ext, local_index))


def scatter_rows(messages, local_index, plan, *, reduce="sum", accumulate_dtype=None):
    """Combines the message rows ``messages`` (a ShardTensor sharded by rows, a
    Partial mesh dim summed first, or a local tensor; row i goes to extended row
    ``local_index[i]``) into the nodes: the single-process
    ``zeros(N, *F).index_reduce(0, index, messages, reduce, include_self=False)``
    (``reduce``: "sum" (index_add), "mean" or "amax"; a node with no message gets
    0). ``accumulate_dtype``: the dtype the sums are formed in, locally and across
    ranks; the result has the messages' dtype. Returns a ShardTensor of the
    nodes' layout. Differentiable (sum and mean also twice); amax sends the
    gradient to the maximal messages, split evenly among ties.

    Collective over every rank of the plan's mesh and plan.mesh_dim. Raises
    RuntimeError on every rank if ``local_index`` does not have one entry per
    message row on some rank; ValueError for an unknown ``reduce``.
    C++: shardtensor::scatter_rows (ScatterOptions).
    """
    return _wrap(_C.scatter_rows(messages, local_index, _plan(plan, "scatter_rows"), str(reduce),
                                 accumulate_dtype))


def node_tensor(local, plan):
    """Wraps this rank's owned node rows ``local`` (plan.num_owned rows) as a
    ShardTensor of the nodes' layout (Shard(0) along plan.mesh_dim with the plan's
    sizes, Replicate elsewhere). Collective over every rank of the plan's mesh
    (one all-reduce of an error flag); raises RuntimeError on every rank if a
    piece does not fit. C++: shardtensor::node_tensor."""
    return _wrap(_C.node_tensor(local, _plan(plan, "node_tensor")))


def rows_like(local, like):
    """Wraps the local rows ``local`` (one per local row of the row-sharded
    ShardTensor ``like``, e.g. the edge index) as a ShardTensor with ``like``'s row
    layout, so that torch modules run on per-edge data through the dispatcher.
    Collective over every rank of ``like``'s mesh. Raises RuntimeError on every
    rank if ``like`` is not sharded by rows or a piece does not fit.
    C++: shardtensor::rows_like."""
    return _wrap(_C.rows_like(local, like))


# ---- rebalancing by cost --------------------------------------------------------


def balanced_sizes_by_cost(weights):
    """New sizes (a list, one per coordinate) of the mesh dim that shards the rows
    of ``weights`` (a 1-D ShardTensor of per-row costs, Shard(0) along one mesh
    dim, others Replicate; non-negative, finite), balancing the summed weight per
    coordinate (Note [rebalance by cost]: row i goes to the coordinate whose share
    of the cost line holds its midpoint).

    Collective over every rank of ``weights``' mesh. Raises RuntimeError on every
    rank if ``weights`` is not laid out so, or (any rank) holds a negative or
    non-finite weight. C++: shardtensor::balanced_sizes_by_cost.
    """
    return list(_C.balanced_sizes_by_cost(weights))


def rebalance(tensors, weights=None, *, measured_seconds=None, return_sizes=False):
    """Redistributes every ShardTensor of ``tensors`` (each sharded by rows like the
    weights: same mesh dim and sizes) to :func:`balanced_sizes_by_cost`; returns
    them in order (a list; a lone tensor gives a lone tensor), differentiable
    (redistribute). With ``return_sizes=True``: ``(tensors, new_sizes)``.

    ``weights``: a 1-D ShardTensor of per-row costs; or, instead,
    ``measured_seconds`` (a number may also be passed as ``weights``): the time
    this rank spent on its rows of ``tensors[0]`` in the step being balanced
    (compute time: wall time minus the growth of comm_stats()["comm_seconds"]),
    spread evenly over its rows as per-row cost (replicas along other mesh dims
    take their slowest time); a few measure-and-rebalance rounds converge.

    Collective over every rank of the mesh. Raises RuntimeError on every rank as
    balanced_sizes_by_cost does, if a tensor is not laid out like the weights,
    or if ``measured_seconds`` is negative or not finite on any rank; TypeError
    unless exactly one of weights and measured_seconds is given.
    C++: shardtensor::rebalance (both overloads).
    """
    single = isinstance(tensors, torch.Tensor)
    ts = _tensor_list(tensors, "rebalance", "tensors")
    if isinstance(weights, numbers.Real) and not isinstance(weights, bool):
        if measured_seconds is not None:
            raise TypeError("shardtensor.rebalance: give weights or measured_seconds, not both")
        weights, measured_seconds = None, weights
    if (weights is None) == (measured_seconds is None):
        raise TypeError("shardtensor.rebalance: give exactly one of weights (a ShardTensor of "
                        "per-row costs) and measured_seconds")
    if weights is not None:
        out, sizes = _C.rebalance(ts, weights)
    else:
        out, sizes = _C.rebalance_measured(ts, float(measured_seconds))
    out = [_wrap(t) for t in out]
    if single:
        out = out[0]
    return (out, list(sizes)) if return_sizes else out


class RebalancedGraph(NamedTuple):
    """A graph moved to a cost-balanced node partition by :func:`rebalance_graph`."""

    nodes: List[torch.Tensor]  #: the node tensors, in order, on the new partition
    edge_index: torch.Tensor  #: edges, each on the rank that owns its destination
    edges: List[torch.Tensor]  #: the edge tensors, moved with their edges
    plan: GhostPlan  #: the GhostPlan of the moved edges' endpoints
    node_sizes: List[int]
    edge_sizes: List[int]


def rebalance_graph(node_tensors, edge_index, edge_tensors, weights, dst_column=1):
    """Rebalances a row-sharded graph (Note [rebalance by cost]): the node tensors go
    to ``balanced_sizes_by_cost(weights)``; every edge (a row of the int64
    ShardTensor ``edge_index`` [E, k] of global node ids, sharded by rows along the
    nodes' mesh dim) moves, in order, to the coordinate that owns its destination
    node ``edge_index[e, dst_column]`` under the new partition, with the rows of
    every ``edge_tensors`` entry (sharded like edge_index); and the GhostPlan for
    the moved edges' endpoints is rebuilt. Returns a :class:`RebalancedGraph`
    ``(nodes, edge_index, edges, plan, node_sizes, edge_sizes)``.
    Differentiable for the node and edge tensors.

    Collective over every rank of the mesh. Raises RuntimeError on every rank if
    a tensor is not laid out so, dst_column is out of range, or a destination id
    is out of range, or as rebalance. C++: shardtensor::rebalance_graph.
    """
    nodes = _tensor_list(node_tensors, "rebalance_graph", "node_tensors")
    edges = _tensor_list(edge_tensors, "rebalance_graph", "edge_tensors")
    n, ei, e, plan, node_sizes, edge_sizes = _C.rebalance_graph(nodes, edge_index, edges, weights,
                                                                int(dst_column))
    return RebalancedGraph([_wrap(t) for t in n], _wrap(ei), [_wrap(t) for t in e],
                           GhostPlan._from_c(plan), list(node_sizes), list(edge_sizes))
