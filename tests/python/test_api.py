"""The Python API surface: types, placements, factories, autograd flags, errors, stats."""

import json
import os
import subprocess
import sys

import pytest
import torch

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, rnd
from shardtensor import DeviceMesh, Partial, Replicate, Shard, ShardTensor


def test_placements_print_and_compare():
    assert repr(Shard(2)) == "Shard(dim=2)"
    assert repr(Replicate()) == "Replicate()" and repr(Partial()) == "Partial()"
    assert Shard(1) == Shard(1) and Shard(1) != Shard(2) and Replicate() == Replicate()
    assert len({Shard(0), Shard(0), Replicate()}) == 2
    assert Shard(3).is_shard() and Shard(3).is_shard(3) and not Shard(3).is_shard(2)


def test_scatter_tensor_types_and_layout(mesh):
    x = rnd((4, 3, 13, 6), 1)
    pl = placements(mesh, 2)
    sx = st.scatter_tensor(x if mesh.get_rank() == 0 else None, 0, mesh, pl, requires_grad=True)
    assert isinstance(sx, ShardTensor) and isinstance(sx, torch.Tensor)
    assert sx.shape == x.shape and sx.dtype == x.dtype and sx.device == x.device
    assert sx.placements == pl and isinstance(sx.placements, tuple)
    assert sx._spec.placements == pl
    assert sx.device_mesh is mesh
    assert sx.requires_grad and sx.is_leaf and sx.grad is None
    assert_close(sx.full_tensor(), x, 0, 0, "full_tensor")
    local = sx.to_local()
    assert not isinstance(local, ShardTensor)
    assert "ShardTensor(global=" in repr(sx) and "Shard(2)" in repr(sx)
    sizes = sx._spec.sharding_shapes()
    assert sum(s[2] for s in sizes[mesh.ndim - 1]) == 13
    # PhysicsNeMo's tutorial passes a tensor that itself requires grad, and _local_tensor
    xg = x.clone().requires_grad_(True)
    sg = st.scatter_tensor(xg, 0, mesh, pl, requires_grad=True)
    assert sg.is_leaf and sg._local_tensor.shape == sg.to_local().shape
    sg.mean().backward()
    assert isinstance(sg.grad, ShardTensor) and sg.grad._spec.placements == pl
    assert_close(sg.grad.full_tensor(), torch.full_like(x, 1.0 / x.numel()), 1e-9, 1e-6, "grad")


def test_plain_results_are_not_shard_tensors(mesh):
    x = rnd((4, 3, 9, 5), 2)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2), requires_grad=True)
    y = sx * 2 + 1
    assert isinstance(y, ShardTensor) and not y.is_leaf and y.grad_fn is not None
    loss = y.mean()
    assert not isinstance(loss, ShardTensor) and type(loss) is torch.Tensor
    assert_close(loss.detach(), (x * 2 + 1).mean(), 1e-6, 1e-6, "mean")
    loss.backward()
    assert isinstance(sx.grad, ShardTensor) and sx.grad.placements == sx.placements
    assert_close(sx.grad.full_tensor(), torch.full_like(x, 2.0 / x.numel()), 1e-7, 1e-6, "grad")
    sx.grad = None
    assert sx.grad is None


def test_requires_grad_and_detach(mesh):
    x = rnd((4, 2, 8, 3), 3)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2))
    assert not sx.requires_grad
    assert sx.requires_grad_() is sx and sx.requires_grad
    d = sx.detach()
    assert isinstance(d, ShardTensor) and not d.requires_grad
    assert d.placements == sx.placements
    sx.requires_grad_(False)
    assert not sx.requires_grad


def test_no_grad_and_inference_mode(mesh):
    x = rnd((4, 2, 10, 4), 4)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    st.distribute_module(conv, mesh)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2), requires_grad=True)
    ref = conv(x)
    with torch.no_grad():
        y = conv(sx)
        assert isinstance(y, ShardTensor) and not y.requires_grad
        assert_close(y.full_tensor(), ref.detach(), 1e-5, 1e-5, "no_grad")
    with torch.inference_mode():
        y = conv(sx)
        assert isinstance(y, ShardTensor)
        assert_close(y.full_tensor(), ref.detach(), 1e-5, 1e-5, "inference_mode")


def test_from_local_uneven_inferred_and_explicit(mesh):
    # Local extents of dim 1 differ per rank (rank r holds r + 1 rows, or none on rank 0).
    r = mesh.get_rank()
    pl = (Shard(1),) + (Replicate(),) * (mesh.ndim - 1) if mesh.ndim == 1 else None
    if mesh.ndim != 1:
        pytest.skip("1-D mesh layout")
    n = r  # rank 0: empty
    local = torch.arange(n * 3, dtype=torch.float32).reshape(3, n) + 100 * r
    sx = ShardTensor.from_local(local, mesh, pl)
    total = sum(range(mesh.size()))
    assert sx.shape == (3, total)
    full = sx.full_tensor()
    expected = torch.cat([torch.arange(k * 3, dtype=torch.float32).reshape(3, k) + 100 * k
                          for k in range(mesh.size())], 1)
    assert_close(full, expected, 0, 0, "from_local gathered")
    sizes = [[k for k in range(mesh.size())]]
    sy = ShardTensor.from_local(local, mesh, pl, sharding_shapes=sizes)
    assert_close(sy.full_tensor(), expected, 0, 0, "from_local explicit")
    sz = ShardTensor.from_local(local, mesh, pl, sharding_shapes=sx._spec.sharding_shapes())
    assert sz.shape == sx.shape


def test_redistribute_roundtrip(mesh):
    x = rnd((4, 5, 11, 7), 5)
    pl = placements(mesh, 2)
    sx = st.distribute_tensor(x, mesh, pl)
    rep = sx.redistribute((Replicate(),) * mesh.ndim)
    assert rep.placements == (Replicate(),) * mesh.ndim
    assert_close(rep.to_local(), x, 0, 0, "replicate")
    other = sx.redistribute(mesh, placements(mesh, 3))
    assert other.placements == placements(mesh, 3)
    assert_close(other.full_tensor(), x, 0, 0, "shard(3)")


def test_empty_shard_conv(mesh):
    x = rnd((2, 2, 7, 5), 6)
    pl = placements(mesh, 2)
    sizes = empty_first_sizes(mesh, x.shape, pl)
    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    st.distribute_module(conv, mesh)  # rank 0's weights everywhere
    ref = conv(x)
    sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes, requires_grad=True)
    y = conv(sx)
    assert_close(y.full_tensor(), ref.detach(), 1e-5, 1e-5, "conv on an empty shard")


def test_errors_raise_on_every_rank(mesh):
    x = rnd((4, 3, 8, 8), 8)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2))
    conv = torch.nn.Conv2d(5, 2, 3)  # wrong channel count
    with pytest.raises(RuntimeError):
        conv(sx)
    with pytest.raises((RuntimeError, ValueError)) as e:
        st.distribute_tensor(x, mesh, (Shard(7),) * mesh.ndim)
    assert "Shard" in str(e.value) or "dim" in str(e.value)
    if mesh.size() > 1:
        with pytest.raises((RuntimeError, ValueError)):
            # ranks disagree on a non-sharded extent
            ShardTensor.from_local(torch.zeros(2 + (mesh.get_rank() == 0), 3), mesh,
                                   (Shard(1),) + (Replicate(),) * (mesh.ndim - 1))
    with pytest.raises((RuntimeError, ValueError)):
        DeviceMesh((mesh.size() + 1,))
    # still usable afterwards
    assert_close(sx.full_tensor(), x, 0, 0, "after errors")


def test_stats(mesh):
    x = rnd((4, 3, 8, 8), 9)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2))
    st.reset_comm_stats()
    sx.full_tensor()
    s = st.comm_stats()
    if mesh.size() > 1:
        assert s["bytes_received"] > 0 and s["messages"] > 0
    st.reset_peak_memory_stats()
    m = st.memory_stats()
    assert m["peak_bytes"] >= 0 and m["current_bytes"] >= 0


def test_distributed_manager_and_mesh_helpers(mesh):
    dm = st.DistributedManager()
    assert dm.world_size == st.world_size() and 0 <= dm.rank < dm.world_size
    assert dm.device == torch.device("cpu")
    m = st.init_device_mesh((-1,), ("x",))
    assert m.size() == dm.world_size and m.mesh_dim_names == ("x",)
    m2 = st.init_device_mesh("cpu", (-1,), mesh_dim_names=("y",))
    assert m2.ndim == 1 and m2 != m


def test_mesh_device_type_and_factory_devices(mesh):
    # PhysicsNeMo's and PyTorch's spelling: DeviceMesh(device_type, shape, names).
    m = DeviceMesh("cpu", (-1,), ("d",))
    assert m.device_type == "cpu" and m.device == torch.device("cpu")
    assert m.mesh_dim_names == ("d",) and m.size() == st.world_size()
    assert DeviceMesh(mesh_shape=(-1,)).device_type == "cpu"
    assert "DeviceMesh('cpu'" in repr(m)
    # PyTorch passes the ranks as a tensor; its shape is the mesh's.
    assert DeviceMesh("cpu", torch.arange(st.world_size())).shape == (st.world_size(),)
    with pytest.raises(ValueError, match="row-major"):
        DeviceMesh("cpu", torch.arange(st.world_size()).flip(0) + 1)
    with pytest.raises(TypeError, match="twice"):
        DeviceMesh("cpu", (-1,), mesh_shape=(-1,))
    assert st.DistributedManager().local_rank == st._C.local_rank()
    if not torch.cuda.is_available():
        # Raised on every rank (each sees no GPU), before any communication.
        with pytest.raises(RuntimeError, match="cuda mesh needs a CUDA device"):
            DeviceMesh("cuda", (-1,))
        with pytest.raises(RuntimeError, match="cuda mesh needs a CUDA device"):
            st.init_device_mesh("cuda", (-1,))
    with pytest.raises(RuntimeError, match="not supported"):
        DeviceMesh("meta", (-1,))
    # Factories take a device; on a CPU mesh the piece lands on the CPU.
    x = rnd((2 * st.world_size() + 1, 3), 5)
    sx = st.distribute_tensor(x, m, (Shard(0),), device="cpu")
    assert sx.device == torch.device("cpu") and sx.to_local().device == torch.device("cpu")
    assert_close(sx.full_tensor(), x, 0, 0, "distribute_tensor(device=cpu)")
    sy = st.scatter_tensor(x if m.get_rank() == 0 else None, 0, m, (Shard(0),),
                           device=torch.device("cpu"))
    assert_close(sy.full_tensor(), x, 0, 0, "scatter_tensor(device=cpu)")
    assert st.comm_stats()["staged_bytes"] >= 0


def test_memory_stats_counts_device_memory(mesh):
    s = st.memory_stats()
    assert set(s) == {"current_bytes", "peak_bytes", "device", "device_current_bytes",
                      "device_peak_bytes"}
    assert 0 <= s["current_bytes"] <= s["peak_bytes"]
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert (s["device"], s["device_current_bytes"], s["device_peak_bytes"]) == ("", 0, 0)
        return
    x = torch.empty(1 << 20, device="cuda")
    s = st.memory_stats()
    assert s["device"] == f"cuda:{torch.cuda.current_device()}"
    assert s["device_current_bytes"] == torch.cuda.memory_allocated() >= x.nbytes
    assert s["device_peak_bytes"] == torch.cuda.max_memory_allocated()
    del x
    st.reset_peak_memory_stats()
    assert st.memory_stats()["device_peak_bytes"] == torch.cuda.max_memory_allocated()


_MPI_CUDA_REASONS = (
    "Open MPI was built without CUDA support (MPIX_CUDA_AWARE_SUPPORT is 0 in mpi-ext.h)",
    "Open MPI: built with CUDA support and MPIX_Query_cuda_support() is 1",
    "Open MPI was built with CUDA support, but MPIX_Query_cuda_support() is 0 at run time",
    "this build has no MPI (SHARDTENSOR_WITH_MPI=OFF)",
    "this MPI library declares no CUDA query (no MPIX_CUDA_AWARE_SUPPORT in mpi-ext.h); "
    "SHARDTENSOR_MPI_CUDA_AWARE=1 says that it takes device memory",
)


def _mpi_cuda_support_in_child(value):
    """mpi_cuda_support() in a fresh single process with SHARDTENSOR_MPI_CUDA_AWARE=value
    (None: unset); the launcher's variables are left out, so nothing joins this job."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SHARDTENSOR_MPI_CUDA_AWARE"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if value is not None:
        env["SHARDTENSOR_MPI_CUDA_AWARE"] = value
    code = ("import json, shardtensor as st\n"
            "try:\n    print(json.dumps(st.mpi_cuda_support()))\n"
            "except RuntimeError as e:\n    print(json.dumps({'error': str(e).splitlines()[0]}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_mpi_cuda_support_is_decided_and_explained(mesh):
    # Note [CUDA-aware MPI]: what this process's MPI was found to be, and why.
    s = st.mpi_cuda_support()
    if os.environ.get("SHARDTENSOR_MPI_CUDA_AWARE") is None:
        assert s["reason"] in _MPI_CUDA_REASONS, s
        assert s["aware"] == s["reason"].endswith("is 1"), s
    if mesh.get_rank() != 0:
        return  # the children are local processes; one rank runs them
    unset = _mpi_cuda_support_in_child(None)
    assert unset["reason"] in _MPI_CUDA_REASONS, unset
    if "MPIX_Query_cuda_support" not in unset["reason"]:
        assert unset["aware"] is False, unset  # nothing says it is aware
    no_mpi = unset["reason"].startswith("this build has no MPI")
    assert _mpi_cuda_support_in_child("0") == {
        "aware": False, "reason": "SHARDTENSOR_MPI_CUDA_AWARE=0"
        + (" (no effect: this build has no MPI)" if no_mpi else "")}
    assert _mpi_cuda_support_in_child("1") == {
        "aware": not no_mpi, "reason": "SHARDTENSOR_MPI_CUDA_AWARE=1"
        + (" (no effect: this build has no MPI)" if no_mpi else "")}
    bad = _mpi_cuda_support_in_child("yes")
    assert "SHARDTENSOR_MPI_CUDA_AWARE must be 0 or 1, got 'yes'" in bad.get("error", ""), bad


def test_mpi4py_communicator(mesh):
    mpi4py = pytest.importorskip("mpi4py.MPI")
    m = DeviceMesh((-1,), ("w",), comm=mpi4py.COMM_WORLD)
    x = rnd((6, 3), 10)
    sx = st.distribute_tensor(x, m, (Shard(0),))
    assert_close(sx.full_tensor(), x, 0, 0, "mesh over an mpi4py communicator")


def test_timeout_and_strict_setters(mesh):
    old = st.timeout()
    st.set_timeout(123.5)
    assert st.timeout() == 123.5
    with pytest.raises((RuntimeError, ValueError)):
        st.set_timeout(-1)
    st.set_timeout(old)
    x = rnd((3, 10), 21)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 1, data_dim=None))
    # torch.sort along a sharded dim has no rule: the fallback gathers; strict refuses.
    assert not st.strict()
    st.reset_comm_stats()
    values = torch.sort(sx, dim=1).values
    if mesh.size(mesh.ndim - 1) > 1:
        assert st.comm_stats()["gathered_bytes"] > 0  # the fallback's gather is counted
    if isinstance(values, st.ShardTensor):
        values = values.full_tensor()
    assert_close(values, torch.sort(x, dim=1).values, 0, 0, "fallback sort")
    st.set_strict(True)
    try:
        if mesh.size(mesh.ndim - 1) > 1:
            with pytest.raises(RuntimeError, match="sort"):
                torch.sort(sx, dim=1)
    finally:
        st.set_strict(False)
    assert not st.strict()
