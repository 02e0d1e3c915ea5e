"""Shared fixtures and reference-check helpers for the Python tests (mirror tests/testing.h)."""

import os

import pytest
import torch

import shardtensor as st
from shardtensor import Replicate, Shard

_MESH = None


def test_mesh():
    """The session's mesh: 2x2 ("data", "domain") under SHARDTENSOR_TEST_MESH=2x2, else 1-D."""
    global _MESH
    if _MESH is None:
        if os.environ.get("SHARDTENSOR_TEST_MESH") == "2x2":
            _MESH = st.DeviceMesh((2, 2), ("data", "domain"))
        else:
            _MESH = st.DeviceMesh((-1,), ("domain",))
    return _MESH


test_mesh.__test__ = False  # not a test


@pytest.fixture
def mesh():
    return test_mesh()


def placements(mesh, dim, data_dim=0):
    """Shard `dim` over the last mesh dim; on a 2-D mesh also `data_dim` over the first."""
    if mesh.ndim == 1:
        return (Shard(dim),)
    return (Shard(data_dim) if data_dim is not None else Replicate(), Shard(dim))


def empty_first_sizes(mesh, shape, pl):
    """Explicit sizes: coordinate 0 of the last mesh dim gets nothing of its Shard dim
    (the rest balanced); other Shard mesh dims balanced."""
    sizes = []
    for i, p in enumerate(pl):
        k = mesh.size(i)
        if not isinstance(p, Shard):
            sizes.append([])
            continue
        n = shape[p.dim]
        if i == mesh.ndim - 1 and k > 1:
            sizes.append([0] + [n // (k - 1) + (j < n % (k - 1)) for j in range(k - 1)])
        else:
            sizes.append([n // k + (j < n % k) for j in range(k)])
    return sizes


def rnd(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert not isinstance(actual, st.ShardTensor)
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what}: max |diff| {diff:.3g}"


def reference_check(fn, x, mesh, pl, module=None, sizes=None, atol=1e-5, rtol=1e-5, seed=7):
    """fn(sharded x) vs fn(x) on one process: output, input gradient and (with
    `module`, which fn must use) parameter gradients. The loss is a fixed
    random weighting of the output, so every output element's gradient is checked."""
    import copy

    if module is not None:
        st.distribute_module(module, mesh)  # rank 0's weights everywhere, gradients summed
    ref_module = copy.deepcopy(module) if module is not None else None
    xr = x.clone().requires_grad_(True)
    yr = fn(xr, ref_module) if module is not None else fn(xr)
    w = rnd(yr.shape, seed)
    (yr * w).sum().backward()

    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=sizes)
    assert isinstance(sx, st.ShardTensor)
    y = fn(sx, module) if module is not None else fn(sx)
    yf = y.full_tensor() if isinstance(y, st.ShardTensor) else y
    assert_close(yf, yr.detach(), atol, rtol, "output")
    (yf * w).sum().backward()
    g = sx.grad
    if xr.grad is None:
        assert g is None, "input grad: libtorch's is None, ours is not"
    else:
        assert isinstance(g, st.ShardTensor) and g.placements == sx.placements
        assert_close(g.full_tensor(), xr.grad, atol, rtol, "input grad")
    if module is not None:
        # Parameter gradients at the same tolerance as the output and the input
        # gradient; where libtorch's is None ours must be None too (not zeros).
        for (name, p), (_, pr) in zip(module.named_parameters(), ref_module.named_parameters()):
            if pr.grad is None:
                assert p.grad is None, f"grad of {name}: libtorch's is None, ours is not"
                continue
            assert p.grad is not None, f"grad of {name}: None, libtorch's is not"
            assert_close(p.grad, pr.grad, atol, rtol, f"grad of {name}")
    return y


# Parallel HDF5 (MPI-IO) and mpi4py communicators need the MPI transport; under
# torchrun the job runs on the c10d transport (Note [c10d handles]), where
# tests/python/torchrun_io_check.py checks HDF5's refusal instead.
_MPI_ONLY_FILES = {"test_io.py"}
_MPI_ONLY_TESTS = {"test_mpi4py_communicator"}


def pytest_collection_modifyitems(config, items):
    from shardtensor import _C

    st.DistributedManager.initialize()  # collective, as every rank collects the same tests
    transport = _C.transport()
    if transport == "mpi":
        return
    skip = pytest.mark.skip(reason=f"needs the MPI transport; this job runs on {transport}")
    for item in items:
        if item.fspath.basename in _MPI_ONLY_FILES or item.originalname in _MPI_ONLY_TESTS:
            item.add_marker(skip)
