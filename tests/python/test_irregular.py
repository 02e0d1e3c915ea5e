"""Irregular data from Python (python/shardtensor/_irregular.py; docs/irregular.md):
neighbour search, neighbourhood attention, index halos (GhostPlan), message passing
and rebalancing by cost, against plain torch on the gathered data (outputs and, for
the differentiable calls, input and parameter gradients), with rows sharded along
the last or the first mesh dim, uneven and empty pieces, and bad inputs that must
raise on every rank (some of them bad on one rank only). C++ counterparts:
tests/test_knn.cpp, tests/test_ghost.cpp, tests/test_natten.cpp."""

import copy
import math

import pytest
import torch

import shardtensor as st
from conftest import assert_close, empty_first_sizes, rnd
from shardtensor import Replicate, Shard, ShardTensor

# torch's index_reduce (the references for amax/amin/prod/mean) warns that it is beta.
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")

# ---- helpers ----------------------------------------------------------------------

_WORLD = []


def world_sum(value):
    """Sum of a number over every rank (collective over the world)."""
    if not _WORLD:
        _WORLD.append(st.DeviceMesh((-1,)))
    t = ShardTensor.from_local(torch.tensor([float(value)], dtype=torch.float64), _WORLD[0],
                               (Shard(0),))
    return t.full_tensor().sum().item()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def row_layout(mesh, along):
    """Rows (dim 0) sharded along the last or the first mesh dim, Replicate elsewhere."""
    md = mesh.ndim - 1 if along == "last" else 0
    return tuple(Shard(0) if i == md else Replicate() for i in range(mesh.ndim)), md


def sizes_1d(P, n, kind):
    """Rows per coordinate: balanced, uneven (share ~ c + 1) or the first one empty."""
    if kind == "balanced" or P == 1:
        return [n // P + (c < n % P) for c in range(P)]
    if kind == "uneven":
        tot, left, out = P * (P + 1) // 2, n, []
        for c in range(P):
            v = left if c == P - 1 else n * (c + 1) // tot
            out.append(v)
            left -= v
        return out
    assert kind == "empty"
    return [0] + [n // (P - 1) + (c < n % (P - 1)) for c in range(P - 1)]


def shard_sizes(mesh, md, sizes):
    return [list(sizes) if i == md else [] for i in range(mesh.ndim)]


def offsets(sizes):
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def rows_of(t, md):
    """The row sizes per coordinate of mesh dim md of a row-sharded ShardTensor."""
    return [s[0] for s in t._spec.sharding_shapes()[md]]


def skip_duplicate_layout(mesh, along):
    if along == "first" and mesh.ndim == 1:
        pytest.skip("on a 1-D mesh the first mesh dim is the last")


# ---- neighbour search -------------------------------------------------------------


def brute(q, p, k, r=math.inf):
    """All pairwise squared distances (dim by dim, float64), ordered by (distance,
    id), the first k within r; -1 / inf padding (tests/test_knn.cpp's brute force)."""
    qd, pd = q.double(), p.double()
    d2 = torch.zeros(q.shape[0], p.shape[0], dtype=torch.float64)
    for j in range(q.shape[1]):
        d2 += (qd[:, j].unsqueeze(1) - pd[:, j].unsqueeze(0)).square()
    sd, order = torch.sort(d2, dim=1, stable=True)
    idx = torch.full((q.shape[0], k), -1, dtype=torch.long)
    dist = torch.full((q.shape[0], k), math.inf, dtype=torch.float64)
    kk = min(k, p.shape[0])
    ok = sd[:, :kk] <= r * r
    idx[:, :kk] = torch.where(ok, order[:, :kk], torch.full_like(order[:, :kk], -1))
    dist[:, :kk] = torch.where(ok, sd[:, :kk].sqrt(), torch.full_like(sd[:, :kk], math.inf))
    return idx, dist.to(p.dtype)


def cloud(n, d, seed, lattice):
    if lattice:  # integer points: many exact ties, broken by the smaller global id
        return torch.randint(4, (n, d), generator=gen(seed)).float()
    return torch.rand(n, d, generator=gen(seed))


SEARCH_CASES = [  # (name, query sizes, point sizes, lattice)
    ("uneven", "uneven", "uneven", False),
    ("empty_queries_ties", "empty", "uneven", True),
    ("empty_points_ties", "uneven", "empty", True),
]


@pytest.mark.parametrize("along", ["last", "first"])
@pytest.mark.parametrize("radius", [False, True], ids=["knn", "radius"])
@pytest.mark.parametrize("name,qkind,pkind,lattice", SEARCH_CASES, ids=[c[0] for c in SEARCH_CASES])
def test_neighbor_search_equals_brute_force(mesh, along, radius, name, qkind, pkind, lattice):
    skip_duplicate_layout(mesh, along)
    pl, md = row_layout(mesh, along)
    P = mesh.size(md)
    nq, n_p, k = 23, 41, 5
    q, p = cloud(nq, 3, 1, lattice), cloud(n_p, 3, 2, lattice)
    r = 1.0 if lattice else 0.35  # lattice: distance exactly r is kept (inclusive)
    sq = st.distribute_tensor(q, mesh, pl, sharding_shapes=shard_sizes(mesh, md, sizes_1d(P, nq, qkind)))
    sp = st.distribute_tensor(p, mesh, pl, sharding_shapes=shard_sizes(mesh, md, sizes_1d(P, n_p, pkind)))
    if radius:
        idx, dist = st.radius_search(sq, sp, r, k)
        ref_idx, ref_dist = brute(q, p, k, r)
    else:
        idx, dist = st.knn(sq, sp, k)
        ref_idx, ref_dist = brute(q, p, k)
    for t in (idx, dist):
        assert isinstance(t, ShardTensor) and t.placements == pl
        assert rows_of(t, md) == rows_of(sq, md)
    assert idx.dtype == torch.long and dist.dtype == p.dtype
    # Exact, as in C++: the same float64 arithmetic, ties by global id.
    assert torch.equal(idx.full_tensor(), ref_idx), name
    assert_close(dist.full_tensor(), ref_dist, 0, 0, "distances")
    if radius:
        assert (ref_idx == -1).any() and (ref_idx >= 0).any()  # the radius really filters


def test_knn_plain_and_padding(mesh):
    # Plain tensors: a single-process search (local).
    q, p = cloud(9, 3, 5, True), cloud(17, 3, 6, True)
    idx, dist = st.knn(q, p, 4)
    assert not isinstance(idx, ShardTensor)
    ref_idx, ref_dist = brute(q, p, 4)
    assert torch.equal(idx, ref_idx) and torch.equal(dist, ref_dist)
    # More neighbours than points: -1 / inf padding, also when sharded.
    pl, md = row_layout(mesh, "last")
    q, p = cloud(6, 2, 3, False), cloud(4, 2, 4, False)
    idx, dist = st.knn(st.distribute_tensor(q, mesh, pl), st.distribute_tensor(p, mesh, pl), 6)
    ref_idx, ref_dist = brute(q, p, 6)
    assert torch.equal(idx.full_tensor(), ref_idx)
    assert torch.equal(dist.full_tensor(), ref_dist)
    assert (ref_idx[:, 4:] == -1).all()


def test_knn_stats_count_every_foreign_piece(mesh):
    """return_stats: every non-empty foreign point piece is either fetched or skipped
    by the bounding-box pre-filter; on a cloud sorted along x only neighbouring slabs
    are fetched."""
    pl, md = row_layout(mesh, "last")
    P, me = mesh.size(md), mesh.get_coordinate()[md]
    n = 1200
    p = cloud(n, 3, 7, False)
    p = p[p[:, 0].sort().indices]
    sizes = sizes_1d(P, n, "empty")
    sp = st.distribute_tensor(p, mesh, pl, sharding_shapes=shard_sizes(mesh, md, sizes))
    idx, dist, stats = st.knn(sp, sp, 8, return_stats=True)
    assert set(stats) == {"pieces_fetched", "pieces_skipped", "bytes_fetched", "bytes_skipped"}
    foreign = [c for c in range(P) if c != me and sizes[c] > 0]
    assert stats["pieces_fetched"] + stats["pieces_skipped"] == len(foreign)
    assert stats["bytes_fetched"] + stats["bytes_skipped"] == sum(sizes[c] for c in foreign) * 3 * 4
    assert torch.equal(idx.full_tensor(), brute(p, p, 8)[0])
    replicas = mesh.size() // P
    fetched = world_sum(stats["pieces_fetched"]) / replicas
    skipped = world_sum(stats["pieces_skipped"]) / replicas
    nonempty = sum(1 for s in sizes if s > 0)
    # Slabs: each rank fetches at most its two neighbouring slabs; the rest is skipped.
    assert fetched <= 2 * (nonempty - 1)
    assert skipped == nonempty * (P - 1) - fetched
    if P >= 3:
        assert skipped > 0
    # radius_search reports the same way
    *_, rstats = st.radius_search(sp, sp, 0.1, 4, return_stats=True)
    assert rstats["pieces_fetched"] + rstats["pieces_skipped"] == len(foreign)


def test_neighbor_search_bad_input_raises_everywhere(mesh):
    pl, _ = row_layout(mesh, "last")
    sq = st.distribute_tensor(cloud(5, 3, 9, False), mesh, pl)
    sp = st.distribute_tensor(cloud(5, 2, 9, False), mesh, pl)
    with pytest.raises(RuntimeError, match="knn: k must be >= 1"):
        st.knn(sq, sq, 0)
    with pytest.raises(RuntimeError, match=r"knn: .*\[5, 3\] and \[5, 2\]"):
        st.knn(sq, sp, 2)
    with pytest.raises(RuntimeError, match="radius_search: r must be >= 0"):
        st.radius_search(sq, sq, -1.0, 2)
    with pytest.raises(RuntimeError, match="radius_search: max_neighbors must be >= 1"):
        st.radius_search(sq, sq, 1.0, 0)
    with pytest.raises(RuntimeError, match="knn: queries and points must both be ShardTensors"):
        st.knn(sq, cloud(5, 3, 9, False), 2)
    assert_close(sq.full_tensor(), cloud(5, 3, 9, False), 0, 0, "usable after the errors")


# ---- neighbourhood attention ------------------------------------------------------


def window_mask(n, K, d, causal):
    """[n, n] bool: key j in query i's window along one dim, from the definition
    (Note [neighbourhood window]): the centred window of K keys of i's residue class,
    shifted the least to fit in the grid; causal: the K class members ending at i."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if causal:
            for j in range(i + 1):
                if (i - j) % d == 0 and (i - j) // d < K:
                    m[i, j] = True
            continue
        best, best_dist = -1, None
        s = i % d
        while s + (K - 1) * d < n:
            dist = abs(s + (K // 2) * d - i)
            if best_dist is None or dist < best_dist:
                best, best_dist = s, dist
            s += d
        for t in range(K):
            m[i, best + t * d] = True
    return m


def natten_reference(q, k, v, K, d, causal, scale=None):
    """Full attention over the flattened grid with the product of the per-dim masks."""
    mask, N = torch.ones(1, 1, dtype=torch.bool), 1
    for sd in range(q.dim() - 3):
        n = q.shape[2 + sd]
        mask = (mask[:, None, :, None] & window_mask(n, K, d, causal)[None, :, None, :]).reshape(N * n, N * n)
        N *= n
    B, H = q.shape[:2]
    qf, kf, vf = (t.reshape(B, H, N, t.shape[-1]) for t in (q, k, v))
    s = qf @ kf.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~mask, -math.inf)
    return (torch.softmax(s, -1) @ vf).reshape(v.shape)


def test_natten_reference_window_by_hand():
    m = window_mask(7, 3, 1, False)
    assert m[0].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert m[3].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert m[6].tolist() == [0, 0, 0, 0, 1, 1, 1]
    md = window_mask(7, 3, 2, False)  # classes {0, 2, 4, 6} and {1, 3, 5}
    assert md[1].tolist() == [0, 1, 0, 1, 0, 1, 0]
    assert md[6].tolist() == [0, 0, 1, 0, 1, 0, 1]
    mc = window_mask(7, 3, 2, True)
    assert mc[5].tolist() == [0, 1, 0, 1, 0, 1, 0]
    assert mc[1].tolist() == [0, 1, 0, 0, 0, 0, 0]


# (name, spatial, K, dilation, causal, sharded dims on a 1-D mesh / on 2x2 (None: plain),
#  empty first piece, dtype, scale)
NATTEN_CASES = [
    ("plain_2d_causal", (9, 11), 5, 1, True, None, False, torch.float64, None),
    ("plain_3d", (7, 6, 8), 3, 2, False, None, False, torch.float64, None),
    ("1d", (17,), 5, 1, False, ((2,), (0, 2)), False, torch.float64, None),
    ("1d_empty_causal_dilated", (19,), 3, 2, True, ((2,), (0, 2)), True, torch.float64, None),
    ("1d_float32_scale", (17,), 3, 2, False, ((2,), (2, 0)), False, torch.float32, 0.3),
    ("2d", (9, 11), 3, 1, False, ((3,), (2, 3)), False, torch.float64, None),
    ("2d_empty_dilated", (9, 11), 3, 2, False, ((2,), (2, 3)), True, torch.float64, None),
    ("2d_batch_and_space_causal", (10, 9), 3, 2, True, ((3,), (3, 0)), True, torch.float64, None),
    ("3d", (7, 6, 8), 3, 1, False, ((4,), (2, 4)), False, torch.float64, None),
]


@pytest.mark.parametrize("name,spatial,K,d,causal,dims,empty,dtype,scale", NATTEN_CASES,
                         ids=[c[0] for c in NATTEN_CASES])
def test_neighborhood_attention(mesh, name, spatial, K, d, causal, dims, empty, dtype, scale):
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-5, 1e-6)
    shape = (2, 2) + spatial + (4,)
    q, k, v = (rnd(shape, s, torch.float64).to(dtype) for s in (1, 2, 3))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = natten_reference(*refs, K, d, causal, scale)
    w = rnd(ref.shape, 4, torch.float64).to(dtype)
    (ref * w).sum().backward()
    if dims is None:
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = st.neighborhood_attention(*ins, K, d, causal, scale)
        assert not isinstance(out, ShardTensor)
        assert_close(out.detach(), ref.detach(), atol, rtol, "output")
        (out * w).sum().backward()
        for n, a, b in zip("qkv", ins, refs):
            assert_close(a.grad, b.grad, atol, rtol, "grad " + n)
        return
    pl = tuple(Shard(x) for x in dims[0 if mesh.ndim == 1 else 1])
    sizes = empty_first_sizes(mesh, shape, pl) if empty else None
    ins = [st.distribute_tensor(t, mesh, pl, requires_grad=True, sharding_shapes=sizes) for t in (q, k, v)]
    out = st.neighborhood_attention(*ins, kernel_size=K, dilation=d, is_causal=causal, scale=scale)
    assert isinstance(out, ShardTensor) and out.placements == pl
    of = out.full_tensor()
    assert_close(of, ref.detach(), atol, rtol, "output")
    (of * w).sum().backward()
    for n, a, b in zip("qkv", ins, refs):
        assert isinstance(a.grad, ShardTensor) and a.grad.placements == pl
        assert_close(a.grad.full_tensor(), b.grad, atol, rtol, "grad " + n)


def test_neighborhood_attention_bad_input_raises_everywhere(mesh):
    q = rnd((2, 2, 9, 11, 4), 61)
    pl = (Shard(2),) if mesh.ndim == 1 else (Shard(2), Shard(3))
    sq = st.distribute_tensor(q, mesh, pl)
    with pytest.raises(RuntimeError, match="neighborhood_attention.*kernel_size"):
        st.neighborhood_attention(sq, sq, sq, 4)
    with pytest.raises(RuntimeError, match="neighborhood_attention.*exceeds the extent 9"):
        st.neighborhood_attention(sq, sq, sq, 5, 2)
    with pytest.raises(RuntimeError, match="neighborhood_attention.*all plain tensors or all ShardTensors"):
        st.neighborhood_attention(sq, q, q, 3)
    sh = st.distribute_tensor(q, mesh, (Shard(1),) * mesh.ndim if mesh.ndim == 1 else (Shard(1), Shard(2)))
    with pytest.raises(RuntimeError, match="neighborhood_attention.*head and feature dims"):
        st.neighborhood_attention(sh, sh, sh, 3)
    with pytest.raises(RuntimeError, match="neighborhood_attention.*1 to 3 spatial dims"):
        q6 = rnd((1, 1, 2, 2, 2, 2, 4), 62)
        st.neighborhood_attention(q6, q6, q6, 1)


# ---- index halos ------------------------------------------------------------------


class Ghosts:
    """A plan over the row mesh dim with random needs per coordinate (every rank can
    regenerate every coordinate's needs, so the reference sees the whole graph)."""

    def __init__(self, mesh, along, kind, N=37, F=3, seed=100, by_name=False):
        self.pl, self.md = row_layout(mesh, along)
        self.P, self.me = mesh.size(self.md), mesh.get_coordinate()[self.md]
        self.N, self.F = N, F
        self.sizes = sizes_1d(self.P, N, kind)
        self.off = offsets(self.sizes)
        self.needs = [torch.randint(N, (15,), generator=gen(seed + c)) for c in range(self.P)]
        self.ghosts = []
        for c in range(self.P):
            u = torch.unique(self.needs[c], sorted=True)
            self.ghosts.append(u[(u < self.off[c]) | (u >= self.off[c + 1])])
        dim = mesh.mesh_dim_names[self.md] if by_name else self.md
        self.plan = st.GhostPlan.build(mesh, dim, self.sizes, self.needs[self.me])

    def n(self, c):
        return self.sizes[c]

    def n_ext(self, c):
        return self.sizes[c] + self.ghosts[c].numel()

    def owned(self, full, c=None):
        c = self.me if c is None else c
        return full[self.off[c]:self.off[c + 1]]


@pytest.mark.parametrize("along", ["last", "first"])
@pytest.mark.parametrize("kind", ["empty", "uneven"])
def test_ghost_plan_and_exchange(mesh, along, kind):
    skip_duplicate_layout(mesh, along)
    g = Ghosts(mesh, along, kind, by_name=True)
    plan, me = g.plan, g.me
    assert isinstance(plan, st.GhostPlan) and "GhostPlan(" in repr(plan)
    assert plan.mesh == mesh and plan.mesh_dim == g.md and plan.sizes == g.sizes
    assert plan.num_global == g.N and plan.owned_offset == g.off[me] and plan.num_owned == g.n(me)
    assert torch.equal(plan.ghost_ids, g.ghosts[me])
    assert plan.num_ghost == g.ghosts[me].numel() and plan.num_extended == g.n_ext(me)
    owners = sorted({c for i in g.ghosts[me].tolist() for c in range(g.P) if g.off[c] <= i < g.off[c + 1]})
    assert plan.recv_peers == owners
    mine = torch.arange(g.off[me], g.off[me + 1])
    assert plan.num_send_rows == sum(int(torch.isin(g.ghosts[c], mine).sum()) for c in range(g.P) if c != me)

    full = rnd((g.N, g.F), 7, torch.float64)
    owned = g.owned(full).clone().requires_grad_()
    ext = st.ghost_exchange(owned, plan)
    assert not isinstance(ext, ShardTensor)
    assert torch.equal(ext.detach(), torch.cat([g.owned(full), full[g.ghosts[me]]]))
    rows = plan.local_index(g.needs[me])
    assert torch.equal(ext.detach()[rows], full[g.needs[me]])
    assert torch.equal(plan.local_index(g.needs[me].view(3, 5)), rows.view(3, 5))

    # Gradient vs plain torch: every coordinate's extended rows weighted by its own y.
    ys = [rnd((g.n_ext(c), g.F), 200 + c, torch.float64) for c in range(g.P)]
    xr = full.clone().requires_grad_()
    sum((torch.cat([g.owned(xr, c), xr[g.ghosts[c]]]) * ys[c]).sum() for c in range(g.P)).backward()
    (ext * ys[me]).sum().backward()
    assert_close(owned.grad, g.owned(xr.grad), 1e-12, 1e-12, "ghost_exchange grad")


@pytest.mark.parametrize("along", ["last", "first"])
@pytest.mark.parametrize("kind", ["empty", "uneven"])
def test_ghost_accumulate(mesh, along, kind):
    skip_duplicate_layout(mesh, along)
    g = Ghosts(mesh, along, kind, seed=110)
    me = g.me
    es = [rnd((g.n_ext(c), g.F), 300 + c, torch.float64) for c in range(g.P)]
    erefs = [e.clone().requires_grad_() for e in es]
    acc = torch.cat([e[:g.n(c)] for c, e in enumerate(erefs)])
    for c, e in enumerate(erefs):
        acc = acc.index_add(0, g.ghosts[c], e[g.n(c):])
    w = rnd((g.N, g.F), 301, torch.float64)
    (acc * w).sum().backward()

    e = es[me].clone().requires_grad_()
    out = st.ghost_accumulate(e, g.plan)
    assert_close(out.detach(), g.owned(acc.detach()), 1e-12, 1e-12, "ghost_accumulate")
    (out * g.owned(w)).sum().backward()
    assert_close(e.grad, erefs[me].grad, 1e-12, 1e-12, "ghost_accumulate grad")

    # accumulate_dtype: float32 rows summed (and sent) in float64, returned as float32.
    big = (es[me] * 1e3 + 1e7).float()
    got = st.ghost_accumulate(big, g.plan, accumulate_dtype=torch.float64)
    assert got.dtype == torch.float32
    assert torch.equal(got, st.ghost_accumulate(big.double(), g.plan).float())


def test_ghost_accumulate_float64_sums(mesh):
    """Every coordinate holds item 0 (owned: 1e8, ghost copies: 4 each): summed in
    float32, each + 4 rounds back to 1e8 (ties to even); summed in float64 and
    rounded once, the result is 1e8 + 4 (P - 1) rounded to float32 (differs from
    1e8 from P = 3 on)."""
    pl, md = row_layout(mesh, "last")
    P, me = mesh.size(md), mesh.get_coordinate()[md]
    plan = st.GhostPlan.build(mesh, md, [2] * P, torch.tensor([0]))
    ext = torch.zeros(plan.num_extended, 1)
    ext[0 if me == 0 else 2] = 1e8 if me == 0 else 4.0
    got = st.ghost_accumulate(ext, plan, accumulate_dtype=torch.float64)
    assert got.dtype == torch.float32
    expect = torch.zeros(2, 1)
    if me == 0:
        expect[0] = torch.tensor(1e8 + 4.0 * (P - 1), dtype=torch.float64).float()
    assert torch.equal(got, expect), (got, expect)


@pytest.mark.parametrize("reduce", ["sum", "amax", "amin", "prod"])
def test_ghost_accumulate_nograd(mesh, reduce):
    g = Ghosts(mesh, "last", "empty", seed=120)
    es = [rnd((g.n_ext(c), 2), 400 + c, torch.float64) for c in range(g.P)]
    ref = torch.cat([e[:g.n(c)] for c, e in enumerate(es)])
    for c, e in enumerate(es):
        if reduce == "sum":
            ref = ref.index_add(0, g.ghosts[c], e[g.n(c):])
        else:
            ref = ref.index_reduce(0, g.ghosts[c], e[g.n(c):], reduce, include_self=True)
    e = es[g.me].clone().requires_grad_()
    out = st.ghost_accumulate_nograd(e, g.plan, reduce)
    assert not out.requires_grad
    assert_close(out, g.owned(ref), 1e-12, 1e-12, reduce)


@pytest.mark.parametrize("along", ["last", "first"])
def test_ghost_adjoint_and_double_backward(mesh, along):
    """<exchange(x), y> == <x, accumulate(y)> over the ranks; each is the other's
    backward, differentiable again."""
    skip_duplicate_layout(mesh, along)
    g = Ghosts(mesh, along, "uneven", seed=130)
    plan, me = g.plan, g.me
    x = rnd((plan.num_owned, 2), 11 + me, torch.float64)
    y = rnd((plan.num_extended, 2), 21 + me, torch.float64)
    lhs = world_sum((st.ghost_exchange(x, plan) * y).sum())
    rhs = world_sum((x * st.ghost_accumulate(y, plan)).sum())
    assert abs(lhs - rhs) <= 1e-10 * (1 + abs(lhs)), (lhs, rhs)
    xs = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(st.ghost_exchange(xs, plan), xs, y, create_graph=True)
    assert torch.equal(gx, st.ghost_accumulate(y, plan))
    ys = y.clone().requires_grad_()
    (gy,) = torch.autograd.grad(st.ghost_accumulate(ys, plan), ys, x, create_graph=True)
    assert torch.equal(gy, st.ghost_exchange(x, plan))
    # d/dy <accumulate(y), x2> = exchange(x2), itself differentiable in x2.
    x2 = x.clone().requires_grad_()
    (gy2,) = torch.autograd.grad((st.ghost_accumulate(ys, plan) * x2).sum(), ys, create_graph=True)
    z = rnd((plan.num_extended, 2), 31 + me, torch.float64)
    (gxx,) = torch.autograd.grad((gy2 * z).sum(), x2)
    assert_close(gxx, st.ghost_accumulate(z, plan), 1e-12, 1e-12, "double backward")


def test_ghost_bad_input_raises_everywhere(mesh):
    pl, md = row_layout(mesh, "last")
    P = mesh.size(md)
    sizes = [3] * P
    bad = mesh.get_rank() == mesh.size() - 1  # one rank only: the ranks must agree
    ids = torch.tensor([0, 3 * P] if bad else [0])
    with pytest.raises(RuntimeError, match=r"GhostPlan::build: needed_ids holds ids in \[0, \d+\]"):
        st.GhostPlan.build(mesh, md, sizes, ids)
    with pytest.raises(RuntimeError, match="GhostPlan::build: .*needed_ids must be a 1-D int64"):
        st.GhostPlan.build(mesh, md, sizes, torch.tensor([0.0]) if bad else torch.tensor([0]))
    with pytest.raises(RuntimeError, match="GhostPlan::build: sizes has"):
        st.GhostPlan.build(mesh, md, [1] * (P + 1), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="GhostPlan::build: mesh_dim 5 is out of range"):
        st.GhostPlan.build(mesh, 5, sizes, torch.tensor([0]))
    plan = st.GhostPlan.build(mesh, md, sizes, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="ghost_exchange: expected 3 rows on this rank"):
        st.ghost_exchange(torch.zeros(4, 2), plan)
    with pytest.raises(RuntimeError, match="ghost_accumulate: expected"):
        st.ghost_accumulate(torch.zeros(plan.num_extended + 1, 2), plan)
    with pytest.raises(ValueError, match="ghost_accumulate_nograd: reduce must be"):
        st.ghost_accumulate_nograd(torch.zeros(plan.num_extended, 2), plan, "mean")
    with pytest.raises(TypeError, match="ghost_exchange: .*ShardTensor.*extend_rows"):
        st.ghost_exchange(st.distribute_tensor(torch.zeros(3 * P, 2), mesh, pl), plan)
    with pytest.raises(TypeError, match="ghost_exchange: expected a shardtensor.GhostPlan"):
        st.ghost_exchange(torch.zeros(3, 2), "plan")
    with pytest.raises(TypeError, match="not constructed directly"):
        st.GhostPlan()
    with pytest.raises(RuntimeError, match="GhostPlan::local_index: some ids are"):
        plan.local_index(torch.tensor([-1]))
    # still usable afterwards
    assert torch.equal(st.ghost_exchange(torch.ones(3, 2), plan)[:3], torch.ones(3, 2))


# ---- message passing --------------------------------------------------------------


class EdgeNet(torch.nn.Module):
    def __init__(self, F, Fe, H):
        super().__init__()
        self.edge = torch.nn.Sequential(torch.nn.Linear(2 * F + Fe, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, H))
        self.node = torch.nn.Linear(F + H, 4, bias=False)


def mp_reference(net, x, ei, e, reduce):
    src, dst = ei[:, 0], ei[:, 1]
    h = net.edge(torch.cat([x[src], x[dst], e], 1))
    base = torch.zeros(x.shape[0], h.shape[1], dtype=h.dtype)
    agg = base.index_add(0, dst, h) if reduce == "sum" else base.index_reduce(0, dst, h, reduce,
                                                                             include_self=False)
    return net.node(torch.cat([x, agg], 1))


def mp_sharded(net, sx, sei, se, reduce):
    """The message-passing layer of docs/irregular.md, written with the Python names."""
    ei = sei.to_local()
    plan = st.ghost_plan(sx, ei.flatten())
    src, dst = plan.local_index(ei[:, 0]), plan.local_index(ei[:, 1])
    x_ext = st.extend_rows(sx, plan)
    m = torch.cat([st.gather_rows(x_ext, src), st.gather_rows(x_ext, dst), se.to_local()], 1)
    rows = st.rows_like(m, se)
    assert isinstance(rows, ShardTensor) and rows.placements == se.placements
    h = net.edge(rows)
    agg = st.scatter_rows(h, dst, plan, reduce=reduce)
    assert isinstance(agg, ShardTensor) and agg.placements == sx.placements
    assert rows_of(agg, plan.mesh_dim) == plan.sizes
    return net.node(torch.cat([sx, agg], 1))


@pytest.mark.parametrize("along", ["last", "first"])
@pytest.mark.parametrize("empty", ["nodes", "edges"])
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax"])
def test_message_passing_equals_single_process(mesh, along, empty, reduce):
    skip_duplicate_layout(mesh, along)
    pl, md = row_layout(mesh, along)
    P = mesh.size(md)
    N, E, F, Fe, H = 29, 71, 3, 2, 5
    x, e = rnd((N, F), 1), rnd((E, Fe), 3)
    ei = torch.randint(N, (E, 2), generator=gen(2))
    torch.manual_seed(0)
    net = EdgeNet(F, Fe, H)
    st.distribute_module(net, mesh)
    ref_net = copy.deepcopy(net)
    xr, er = x.clone().requires_grad_(), e.clone().requires_grad_()
    ref = mp_reference(ref_net, xr, ei, er, reduce)
    w = rnd(ref.shape, 5)
    (ref * w).sum().backward()

    node_sizes = shard_sizes(mesh, md, sizes_1d(P, N, "empty" if empty == "nodes" else "uneven"))
    edge_sizes = shard_sizes(mesh, md, sizes_1d(P, E, "empty" if empty == "edges" else "balanced"))
    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=node_sizes)
    sei = st.distribute_tensor(ei, mesh, pl, sharding_shapes=edge_sizes)
    se = st.distribute_tensor(e, mesh, pl, requires_grad=True, sharding_shapes=edge_sizes)
    out = mp_sharded(net, sx, sei, se, reduce)
    assert isinstance(out, ShardTensor)
    of = out.full_tensor()
    assert_close(of, ref.detach(), 1e-5, 1e-5, "output")
    (of * w).sum().backward()
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-5, 1e-5, "node grad")
    assert_close(se.grad.full_tensor(), er.grad, 1e-5, 1e-5, "edge grad")
    for (name, p), (_, pr) in zip(net.named_parameters(), ref_net.named_parameters()):
        assert_close(p.grad, pr.grad, 1e-4, 1e-4, "grad of " + name)


def test_scatter_rows_local_messages_float64_accumulation(mesh):
    """Plain local messages; sums formed in float64 and returned as float32 equal the
    float64 single-process index_add rounded once."""
    pl, md = row_layout(mesh, "last")
    N, E = 13, 200
    x = rnd((N, 1), 12)
    ei = torch.randint(N, (E, 2), generator=gen(13))
    e = rnd((E, 3), 14) * 1e6
    ref = torch.zeros(N, 3, dtype=torch.float64).index_add(0, ei[:, 1], e.double())
    node_sizes = shard_sizes(mesh, md, sizes_1d(mesh.size(md), N, "empty"))
    sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=node_sizes)
    sei = st.distribute_tensor(ei, mesh, pl)
    se = st.distribute_tensor(e, mesh, pl)
    eil = sei.to_local()
    plan = st.ghost_plan(sx, eil.flatten())
    out = st.scatter_rows(se.to_local(), plan.local_index(eil[:, 1]), plan, accumulate_dtype=torch.float64)
    assert isinstance(out, ShardTensor) and out.dtype == torch.float32
    assert torch.equal(out.full_tensor(), ref.float())
    # All messages into node 0: 1e8 first, then 4s. In float32 each + 4 rounds back
    # to 1e8 (ties to even); in float64 the sum is exact and rounded once.
    e0 = torch.full((E, 3), 4.0)
    e0[0] = 1e8
    se0 = st.distribute_tensor(e0, mesh, pl)
    zero = torch.zeros(sei.to_local().shape[0], dtype=torch.long)
    out0 = st.scatter_rows(se0, plan.local_index(zero), plan, accumulate_dtype=torch.float64)
    ref0 = torch.zeros(N, 3, dtype=torch.float64).index_add(0, torch.zeros(E, dtype=torch.long), e0.double())
    assert ref0[0, 0].item() == 1e8 + 4 * (E - 1) and ref0.float()[0, 0].item() != 1e8
    assert torch.equal(out0.full_tensor(), ref0.float())
    # node_tensor: this rank's owned rows as a ShardTensor of the nodes' layout
    nt = st.node_tensor(sx.to_local() * 2, plan)
    assert isinstance(nt, ShardTensor) and nt.placements == pl
    assert torch.equal(nt.full_tensor(), x * 2)


def test_message_passing_bad_input_raises_everywhere(mesh):
    pl, md = row_layout(mesh, "last")
    N, E = 11, 20
    sx = st.distribute_tensor(rnd((N, 2), 1), mesh, pl)
    ei = torch.randint(N, (E, 2), generator=gen(2))
    sei = st.distribute_tensor(ei, mesh, pl)
    eil = sei.to_local()
    plan = st.ghost_plan(sx, eil.flatten())
    dst = plan.local_index(eil[:, 1])
    m = torch.ones(eil.shape[0], 2)
    short = dst[:-1] if mesh.get_rank() == 0 and dst.numel() > 0 else dst  # one rank only
    bad = short.numel() != dst.numel()
    if world_sum(bad) > 0:
        with pytest.raises(RuntimeError, match="scatter_rows: expected local messages"):
            st.scatter_rows(m, short, plan)
    with pytest.raises(ValueError, match="scatter_rows: reduce must be sum, mean or amax"):
        st.scatter_rows(m, dst, plan, reduce="median")
    with pytest.raises(RuntimeError, match="gather_rows: expected a 1-D int64 index"):
        st.gather_rows(torch.ones(3, 2), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="ghost_plan: .*Shard\\(0\\)"):
        st.ghost_plan(rnd((N, 2), 1), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="rows_like: `like` must be a ShardTensor"):
        st.rows_like(m, rnd((E, 2), 1))
    with pytest.raises(RuntimeError, match="extend_rows: the ShardTensor .* is not laid out like the plan"):
        other = st.distribute_tensor(rnd((N + 1, 2), 1), mesh, pl)
        st.extend_rows(other, plan)
    out = st.scatter_rows(m, dst, plan)  # still usable
    assert out.full_tensor().sum().item() == E * 2


# ---- rebalancing by cost ----------------------------------------------------------


def balanced_reference(w, P):
    """Note [rebalance by cost] on the whole weight vector: the cut before coordinate
    c is #{i : m_i < c W / P}, m_i = sum_{j<i} w_j + w_i / 2."""
    w = w.double()
    n, W = w.numel(), w.sum().item()
    if not W > 0:
        return [n // P + (c < n % P) for c in range(P)]
    mid = w.cumsum(0) - w * 0.5
    cuts = [0] + [int((mid < c * (W / P)).sum()) for c in range(1, P)] + [n]
    return [cuts[c + 1] - cuts[c] for c in range(P)]


def test_balanced_reference_by_hand():
    # weights 1, 1, 1, 5 (W = 8): midpoints 0.5, 1.5, 2.5, 5.5; cut at 4 -> 3 | 1
    assert balanced_reference(torch.tensor([1.0, 1, 1, 5]), 2) == [3, 1]
    assert balanced_reference(torch.zeros(5), 2) == [3, 2]


@pytest.mark.parametrize("along", ["last", "first"])
@pytest.mark.parametrize("kind", ["empty", "uneven"])
def test_balanced_sizes_by_cost(mesh, along, kind):
    skip_duplicate_layout(mesh, along)
    pl, md = row_layout(mesh, along)
    P = mesh.size(md)
    n = 50
    sizes = shard_sizes(mesh, md, sizes_1d(P, n, kind))
    # Integer costs (exact in float64), a heavy block near the start, zeros too.
    w = torch.randint(0, 4, (n,), generator=gen(5)).double()
    w[3:12] += 20
    got = st.balanced_sizes_by_cost(st.distribute_tensor(w, mesh, pl, sharding_shapes=sizes))
    assert got == balanced_reference(w, P) and sum(got) == n
    ones = st.balanced_sizes_by_cost(st.distribute_tensor(torch.ones(n), mesh, pl, sharding_shapes=sizes))
    assert all(abs(s - n / P) <= 1 for s in ones)
    zeros = st.balanced_sizes_by_cost(st.distribute_tensor(torch.zeros(n), mesh, pl, sharding_shapes=sizes))
    assert zeros == [n // P + (c < n % P) for c in range(P)]


@pytest.mark.parametrize("along", ["last", "first"])
def test_rebalance_by_weights(mesh, along):
    skip_duplicate_layout(mesh, along)
    pl, md = row_layout(mesh, along)
    P = mesh.size(md)
    n = 40
    sizes = shard_sizes(mesh, md, sizes_1d(P, n, "empty"))
    x, y = rnd((n, 3), 1, torch.float64), rnd((n,), 2)
    w = torch.randint(1, 5, (n,), generator=gen(3)).double()
    w[-8:] *= 10
    expect = balanced_reference(w, P)
    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=sizes)
    sy = st.distribute_tensor(y, mesh, pl, sharding_shapes=sizes)
    sw = st.distribute_tensor(w, mesh, pl, sharding_shapes=sizes)
    (ox, oy), new_sizes = st.rebalance([sx, sy], sw, return_sizes=True)
    assert new_sizes == expect
    for t, full in ((ox, x), (oy, y)):
        assert isinstance(t, ShardTensor) and t.placements == pl and rows_of(t, md) == expect
        assert torch.equal(t.full_tensor(), full)
    g = rnd((n, 3), 4, torch.float64)
    (ox.full_tensor() * g).sum().backward()  # differentiable: back to the old layout
    assert rows_of(sx.grad, md) == sizes[md]
    assert_close(sx.grad.full_tensor(), g, 0, 0, "rebalance grad")
    lone = st.rebalance(sy, sw)  # a lone tensor in, a lone tensor out
    assert isinstance(lone, ShardTensor) and rows_of(lone, md) == expect


def test_rebalance_measured_seconds(mesh):
    """Each rank's seconds spread over its rows; replicas along other mesh dims take
    the slowest; the sizes balance the resulting per-row cost."""
    pl, md = row_layout(mesh, "last")
    P, me = mesh.size(md), mesh.get_coordinate()[md]
    n = 45
    sizes = sizes_1d(P, n, "uneven")
    x = rnd((n, 2), 6)
    sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=shard_sizes(mesh, md, sizes))
    replica = [c for i, c in enumerate(mesh.get_coordinate()) if i != md]
    slow = all(c == 0 for c in replica)
    secs = (me + 1) * sizes[me] * (1.0 if slow else 0.5)  # per-row cost me + 1 on the slowest
    w = torch.cat([torch.full((sizes[c],), float(c + 1)) for c in range(P)])
    expect = balanced_reference(w, P)
    out, got = st.rebalance([sx], measured_seconds=secs, return_sizes=True)
    assert got == expect
    assert torch.equal(out[0].full_tensor(), x)
    out2 = st.rebalance([sx], secs)  # a number in the weights' place: measured seconds
    assert rows_of(out2[0], md) == expect
    with pytest.raises(RuntimeError, match="rebalance\\(measured_seconds\\).*measured_seconds must be"):
        st.rebalance([sx], measured_seconds=-1.0 if mesh.get_rank() == 0 else 1.0)
    with pytest.raises(TypeError, match="rebalance: give"):
        st.rebalance([sx])


def test_rebalance_bad_input_raises_everywhere(mesh):
    pl, md = row_layout(mesh, "last")
    n = 20
    w = torch.ones(n)
    if mesh.get_rank() == mesh.size() - 1:
        w = torch.full((n,), -1.0)  # bad on one rank only (in its own piece)
    sw = st.distribute_tensor(w, mesh, pl)
    with pytest.raises(RuntimeError, match="balanced_sizes_by_cost: a weight is negative or not finite"):
        st.balanced_sizes_by_cost(sw)
    with pytest.raises(RuntimeError, match="balanced_sizes_by_cost: expected a 1-D ShardTensor"):
        st.balanced_sizes_by_cost(torch.ones(n))
    good = st.distribute_tensor(torch.ones(n), mesh, pl)
    other = st.distribute_tensor(torch.ones(n + 1, 2), mesh, pl)
    with pytest.raises(RuntimeError, match="rebalance: a tensor of global shape .* is not sharded by rows"):
        st.rebalance([other], good)
    with pytest.raises(TypeError, match="rebalance: tensors must hold tensors"):
        st.rebalance([1.0], good)
    assert st.balanced_sizes_by_cost(good) == balanced_reference(torch.ones(n), mesh.size(md))


@pytest.mark.parametrize("along", ["last", "first"])
def test_rebalance_graph(mesh, along):
    """Nodes move to cost-balanced sizes, every edge (with its features) to the owner
    of its destination in a stable order, and message passing through the rebuilt
    plan equals single-process, forward and backward (float64)."""
    skip_duplicate_layout(mesh, along)
    pl, md = row_layout(mesh, along)
    P = mesh.size(md)
    n, E = 47, 160
    src = torch.randint(0, n, (E,), generator=gen(31))
    dst = torch.cat([torch.randint(0, n // 10, (E // 2,), generator=gen(32)),
                     torch.randint(0, n, (E - E // 2,), generator=gen(33))])  # skewed in-degree
    ei = torch.stack([src, dst], 1)
    x, ef = rnd((n, 3), 34, torch.float64), rnd((E, 2), 35, torch.float64)
    deg = torch.ones(n, dtype=torch.float64).index_add(0, dst, torch.ones(E, dtype=torch.float64))
    n_sizes = shard_sizes(mesh, md, sizes_1d(P, n, "empty"))
    e_sizes = shard_sizes(mesh, md, sizes_1d(P, E, "uneven"))
    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=n_sizes)
    sw = st.distribute_tensor(deg, mesh, pl, sharding_shapes=n_sizes)
    sei = st.distribute_tensor(ei, mesh, pl, sharding_shapes=e_sizes)
    sef = st.distribute_tensor(ef, mesh, pl, requires_grad=True, sharding_shapes=e_sizes)
    g = st.rebalance_graph([sx], sei, [sef], sw)
    assert isinstance(g, st.RebalancedGraph) and isinstance(g.plan, st.GhostPlan)
    assert g.node_sizes == balanced_reference(deg, P)
    ends = torch.tensor(offsets(g.node_sizes)[1:])
    owner = torch.searchsorted(ends, dst, right=True)
    perm = torch.sort(owner, stable=True).indices
    assert g.edge_sizes == torch.bincount(owner, minlength=P).tolist()
    assert torch.equal(g.edge_index.full_tensor(), ei[perm])
    assert torch.equal(g.edges[0].full_tensor(), ef[perm])
    assert torch.equal(g.nodes[0].full_tensor(), x)
    assert rows_of(g.nodes[0], md) == g.node_sizes and rows_of(g.edge_index, md) == g.edge_sizes
    l_ei = g.edge_index.to_local()
    lo, hi = g.plan.owned_offset, g.plan.owned_offset + g.plan.num_owned
    assert ((l_ei[:, 1] >= lo) & (l_ei[:, 1] < hi)).all()  # edges live with their destination
    u = torch.unique(l_ei.flatten())
    assert torch.equal(g.plan.ghost_ids, u[(u < lo) | (u >= hi)])
    # Message passing on the moved graph: out[v] = sum_{e: dst=v} x[src] * ef[e, 0].
    x_ext = st.extend_rows(g.nodes[0], g.plan)
    m = st.gather_rows(x_ext, g.plan.local_index(l_ei[:, 0])) * g.edges[0].to_local()[:, :1]
    out = st.scatter_rows(m, g.plan.local_index(l_ei[:, 1]), g.plan)
    xr, efr = x.clone().requires_grad_(), ef.clone().requires_grad_()
    ref = torch.zeros(n, 3, dtype=torch.float64).index_add(0, dst, xr[src] * efr[:, :1])
    assert_close(out.full_tensor(), ref.detach(), 1e-12, 1e-12, "message passing")
    cot = rnd((n, 3), 36, torch.float64)
    (ref * cot).sum().backward()
    (out.full_tensor() * cot).sum().backward()
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-12, 1e-12, "node grad")
    assert_close(sef.grad.full_tensor(), efr.grad, 1e-12, 1e-12, "edge grad")


def test_rebalance_graph_bad_input_raises_everywhere(mesh):
    pl, md = row_layout(mesh, "last")
    n, E = 10, 16
    sw = st.distribute_tensor(torch.ones(n), mesh, pl)
    sx = st.distribute_tensor(rnd((n, 2), 1), mesh, pl)
    ei = torch.randint(0, n, (E, 2), generator=gen(2))
    sei = st.distribute_tensor(ei, mesh, pl)
    with pytest.raises(RuntimeError, match="rebalance_graph: dst_column 2 is out of range"):
        st.rebalance_graph([sx], sei, [], sw, dst_column=2)
    with pytest.raises(RuntimeError, match="rebalance_graph: edge_index must be an int64 ShardTensor"):
        st.rebalance_graph([sx], st.distribute_tensor(ei.double(), mesh, pl), [], sw)
    bad = ei.clone()
    bad[-1, 1] = n  # a destination out of range, in the last coordinate's piece only
    with pytest.raises(RuntimeError, match=r"rebalance_graph: a destination id .* outside \[0, 10\)"):
        st.rebalance_graph([sx], st.distribute_tensor(bad, mesh, pl), [], sw)
    g = st.rebalance_graph([sx], sei, [], sw)  # still usable
    assert torch.equal(g.nodes[0].full_tensor(), sx.full_tensor())


def test_irregular_names_are_exported_and_documented():
    names = ["knn", "radius_search", "neighborhood_attention", "GhostPlan", "ghost_plan", "ghost_exchange",
             "ghost_accumulate", "ghost_accumulate_nograd", "extend_rows", "gather_rows", "scatter_rows",
             "node_tensor", "rows_like", "balanced_sizes_by_cost", "rebalance", "rebalance_graph"]
    for name in names:
        assert name in st.__all__, name
        doc = " ".join((getattr(st, name).__doc__ or "").split())
        assert "Collective" in doc or "Local" in doc, name
        if name != "GhostPlan":
            assert "C++: shardtensor::" + name in doc, name
    assert "Collective" in st.GhostPlan.build.__doc__
