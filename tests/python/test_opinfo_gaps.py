"""Regression tests for the four gaps the OpInfo sweep found (issue 25, part C;
tests/python/opinfo_sweep.py): each failed before its fix. Run at 1-4 ranks and on
the 2x2 mesh by the python.* CTests."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, rnd
from shardtensor import Replicate, Shard, ShardTensor


def replicated(mesh, t):
    return st.distribute_tensor(t, mesh, tuple(Replicate() for _ in range(mesh.ndim)))


def gathered(t):
    return t.full_tensor() if isinstance(t, ShardTensor) else t


@pytest.mark.parametrize("wdim", [0, 1, None])
@pytest.mark.parametrize("index_kind", ["plain", "replicated"])
def test_embedding_zero_dim_index(mesh, wdim, index_kind):
    # Before: ShardSpec::mesh_dim_of raised "tensor dim 0 is out of range for global shape []".
    w = rnd((7, 3), 1, torch.float64)
    idx = torch.tensor(5)
    pl = placements(mesh, wdim, data_dim=None) if wdim is not None else \
        tuple(Replicate() for _ in range(mesh.ndim))
    sw = st.distribute_tensor(w, mesh, pl, requires_grad=True)
    wr = w.clone().requires_grad_(True)
    ref = F.embedding(idx, wr)
    out = F.embedding(idx if index_kind == "plain" else replicated(mesh, idx), sw)
    full = gathered(out)
    assert_close(full, ref.detach(), 0, 0, "output")
    g = rnd(ref.shape, 2, torch.float64)
    (ref * g).sum().backward()
    (full * g).sum().backward()
    assert_close(sw.grad.full_tensor(), wr.grad, 0, 0, "weight grad")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("empty", [False, True])
def test_tensor_split_replicated_indices(mesh, dim, empty):
    # Before: "Cannot access data pointer of Tensor that doesn't have storage".
    x = rnd((7, 5), 3, torch.float64)
    pl = placements(mesh, dim, data_dim=1 - dim)
    sizes = empty_first_sizes(mesh, x.shape, pl) if empty else None
    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=sizes)
    xr = x.clone().requires_grad_(True)
    for ind in (torch.tensor([1, 4]), torch.tensor(3), torch.tensor([0, 2, 2, 9])):
        ref = torch.tensor_split(xr, ind, dim=dim)
        out = torch.tensor_split(sx, replicated(mesh, ind), dim=dim)
        assert len(out) == len(ref)
        for a, b in zip(out, ref):
            assert_close(gathered(a), b.detach(), 0, 0, "piece")
    ind = torch.tensor([2, 3])
    ref = torch.tensor_split(xr, ind, dim=dim)
    out = torch.tensor_split(sx, replicated(mesh, ind), dim=dim)
    ws = [rnd(r.shape, 10 + i, torch.float64) for i, r in enumerate(ref)]
    sum((r * w).sum() for r, w in zip(ref, ws)).backward()
    sum((gathered(o) * w).sum() for o, w in zip(out, ws)).backward()
    assert_close(sx.grad.full_tensor(), xr.grad, 0, 0, "input grad")


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_ctc_loss_replicated_integer_arguments(mesh, dim):
    # Before: "Cannot access data pointer of Tensor that doesn't have storage".
    T, N, C = 7, 3, 5
    lp = rnd((T, N, C), 4, torch.float64).log_softmax(2)
    tg = torch.tensor([[1, 2, 2], [3, 1, 0], [4, 4, 1]])
    il = torch.tensor([7, 6, 5])
    tl = torch.tensor([3, 2, 3])
    lpr = lp.clone().requires_grad_(True)
    ref = F.ctc_loss(lpr, tg, il, tl)
    ref.backward()
    slp = st.distribute_tensor(lp, mesh, placements(mesh, dim, data_dim=None), requires_grad=True)
    R = lambda t: replicated(mesh, t)  # noqa: E731
    out = F.ctc_loss(slp, R(tg), R(il), R(tl))
    full = gathered(out)
    assert_close(full, ref.detach(), 1e-12, 1e-12, "loss")
    full.backward()
    assert_close(slp.grad.full_tensor(), lpr.grad, 1e-12, 1e-12, "input grad")


@pytest.mark.parametrize("dim", [0, 1])
def test_to_sparse_refused_on_every_rank(mesh, dim):
    # Before: NotImplementedError from aten::as_strided on SparseCPU inside the fallback.
    x = rnd((5, 3), 5, torch.float64)
    sx = st.distribute_tensor(x, mesh, placements(mesh, dim, data_dim=1 - dim))
    with pytest.raises(RuntimeError, match=r"layout Sparse.*aten::_to_sparse.*Shard\("):
        sx.to_sparse()
    # A replicated one keeps working (the whole sparse tensor on every rank).
    r = replicated(mesh, x).to_sparse()
    assert torch.equal(gathered(r).to_dense(), x)
