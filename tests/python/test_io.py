"""shardtensor.io from Python: parallel HDF5 reads equal the sliced dataset (h5py
reads the same file independently), writes read back in h5py, halos equal
halo_exchange, each rank reads only its piece, errors raise on every rank, and a
checkpoint of a model + optimizer + sharded tensor resumes bit for bit."""

import copy
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, rnd
from shardtensor import Replicate, Shard


@pytest.fixture
def tmpdir_shared(mesh):
    """One directory every rank sees (rank 0 makes it, the name is broadcast)."""
    comm = MPI.COMM_WORLD
    d = tempfile.mkdtemp(prefix="st_pyio_") if comm.rank == 0 else None
    d = comm.bcast(d, root=0)
    yield d
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def write_ref(path, name, full):
    """The reference file, written by h5py on rank 0 only (independent of shardtensor)."""
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        with h5py.File(path, "a") as f:
            if name in f:
                del f[name]
            f.create_dataset(name, data=full.numpy())
    comm.Barrier()


def piece(full, sx):
    """The slice of `full` that sx's local piece must equal, from sx's own offsets."""
    off = st._C.local_offsets(sx)
    shape = st._C.local_shape(sx)
    idx = tuple(slice(o, o + n) for o, n in zip(off, shape))
    return full[idx]


def layouts(mesh, shape):
    pl = placements(mesh, 1, data_dim=2)
    yield pl, None
    yield pl, empty_first_sizes(mesh, shape, pl)
    yield (Replicate(),) * mesh.ndim, None


def test_read_equals_the_sliced_dataset(mesh, tmpdir_shared):
    f = os.path.join(tmpdir_shared, "a.h5")
    full = rnd((3, 7, 5), 1)
    write_ref(f, "fields/u", full)
    for pl, sizes in layouts(mesh, full.shape):
        st.io.reset_io_stats()
        sx = st.io.read_hdf5(f, "fields/u", mesh, pl, sharding_shapes=sizes)
        assert isinstance(sx, st.ShardTensor) and tuple(sx.shape) == (3, 7, 5)
        assert sx.placements == tuple(pl)
        assert torch.equal(sx.to_local(), piece(full, sx)), (pl, sizes)
        # Each rank read exactly its piece (4 bytes per float32 element).
        assert st.io.io_stats()["bytes_read"] == sx.to_local().numel() * 4
        assert_close(sx.full_tensor(), full, 0, 0, f"full_tensor of {pl}")


def test_select_and_dtype(mesh, tmpdir_shared):
    f = os.path.join(tmpdir_shared, "b.h5")
    full = rnd((4, 9, 6), 2, torch.float64)
    write_ref(f, "u", full)
    pl = placements(mesh, 1, data_dim=2)
    sx = st.io.read_hdf5(f, "u", mesh, pl, select=[(2, 1), slice(1, 8), slice(None)],
                         dtype=torch.float32)
    assert sx.dtype == torch.float32 and tuple(sx.shape) == (1, 7, 6)
    assert torch.equal(sx.to_local(), piece(full[2:3, 1:8, :].float(), sx))
    info = st.io.read_hdf5_info(f, "u", mesh)
    assert info.shape == (4, 9, 6) and info.dtype == torch.float64
    with pytest.raises(RuntimeError, match="b.h5"):
        st.io.read_hdf5(f, "u", mesh, pl, dtype=torch.int32)  # float -> int is refused


def test_halo_read_equals_halo_exchange(mesh, tmpdir_shared):
    f = os.path.join(tmpdir_shared, "c.h5")
    full = rnd((2, 10, 6), 3)
    write_ref(f, "u", full)
    pl = placements(mesh, 1, data_dim=None)
    for mode, pad in (("zeros", "constant"), ("circular", "circular"),
                      ("replicate", "replicate")):
        r = st.io.read_hdf5_with_halo(f, "u", mesh, pl, [0, 2, 0], halo_mode=mode)
        assert torch.equal(r.tensor.to_local(), piece(full, r.tensor))
        ref = st.halo_exchange(r.tensor, 1, 2, 2, mode=pad)
        assert torch.equal(r.with_halo, ref), mode
        assert r.halo_left[1] == 2 and r.halo_right[1] == 2


def test_write_reads_back_in_h5py(mesh, tmpdir_shared):
    f = os.path.join(tmpdir_shared, "d.h5")
    full = rnd((6, 5, 4), 4)
    pl = placements(mesh, 0, data_dim=1)
    sx = st.distribute_tensor(full, mesh, pl, sharding_shapes=empty_first_sizes(mesh, full.shape,
                                                                                pl))
    st.io.write_hdf5(f, "out/u", sx * 2, units="K", chunks=[2, 2, 2])
    st.io.write_hdf5(f, "plain", full[0], mesh=mesh)
    comm = MPI.COMM_WORLD
    ok = True
    if comm.rank == 0:
        with h5py.File(f, "r") as h:
            ok = np.array_equal(h["out/u"][...], (full * 2).numpy())
            ok = ok and np.array_equal(h["plain"][...], full[0].numpy())
            units = h["out/u"].attrs["units"]
            ok = ok and (units.decode() if isinstance(units, bytes) else str(units)) == "K"
    assert comm.bcast(ok, root=0)
    info = st.io.read_hdf5_info(f, "out/u", mesh)
    assert info.units == "K" and info.shape == (6, 5, 4)
    with pytest.raises(RuntimeError, match="overwrite"):
        st.io.write_hdf5(f, "plain", full[0], mesh=mesh, overwrite=False)


def test_errors_raise_on_every_rank(mesh, tmpdir_shared):
    f = os.path.join(tmpdir_shared, "e.h5")
    write_ref(f, "u", rnd((4, 4), 5))
    pl = placements(mesh, 0, data_dim=1)
    with pytest.raises(RuntimeError, match="missing.h5"):
        st.io.read_hdf5(os.path.join(tmpdir_shared, "missing.h5"), "u", mesh, pl)
    with pytest.raises(RuntimeError, match="nope"):
        st.io.read_hdf5(f, "nope", mesh, pl)
    with pytest.raises(ValueError, match="transfer"):
        st.io.read_hdf5(f, "u", mesh, pl, transfer="sideways")
    with pytest.raises(ValueError, match="halo_mode"):
        st.io.read_hdf5_with_halo(f, "u", mesh, pl, [1, 1], halo_mode="mirror")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.n1 = torch.nn.GroupNorm(2, 4)
        self.c2 = torch.nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.n1(self.c1(x))))


def _steps(net, field, opt, mesh, pl, first, n):
    losses = []
    for step in range(first, first + n):
        x = st.distribute_tensor(rnd((2, 2, 10, 6), 100 + step, torch.float64), mesh, pl)
        y = st.distribute_tensor(rnd((2, 1, 10, 6), 200 + step, torch.float64), mesh, pl)
        loss = torch.nn.functional.mse_loss(net(x) + field, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fresh(mesh, pl, seed):
    torch.manual_seed(seed)
    net = Net().double()
    st.distribute_module(net, mesh)
    field = st.distribute_tensor(rnd((1, 1, 10, 6), seed, torch.float64) * 0.1, mesh,
                                 placements(mesh, 2, data_dim=None),
                                 requires_grad=True)
    opt = torch.optim.Adam(list(net.parameters()) + [field], lr=1e-2)
    return net, field, opt


def test_checkpoint_resume_is_bit_identical(mesh, tmpdir_shared):
    pl = placements(mesh, 2)
    net, field, opt = _fresh(mesh, pl, 11)
    _steps(net, field, opt, mesh, pl, 0, 2)
    ck = os.path.join(tmpdir_shared, "ck")
    st.io.save_checkpoint(ck, mesh, {"field": field}, model=net, optimizer=opt, step=2)
    assert st.io.checkpoint_exists(ck)
    cont = _steps(net, field, opt, mesh, pl, 2, 2)

    # A fresh model/optimizer with other initial values, and the field laid out
    # the same way: loading must overwrite all of it.
    net2, field2, opt2 = _fresh(mesh, pl, 99)
    got = st.io.load_checkpoint(ck, mesh, {"field": placements(mesh, 2, data_dim=None)},
                                model=net2, optimizer=opt2)
    assert got.step == 2 and got.saved_mesh_shape == tuple(mesh.shape)
    with torch.no_grad():
        field2.to_local().copy_(got.tensors["field"].to_local())
    resumed = _steps(net2, field2, opt2, mesh, pl, 2, 2)
    assert resumed == cont, (resumed, cont)
    for (n, p), (_, q) in zip(net.named_parameters(), net2.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    assert torch.equal(field.to_local().detach(), field2.to_local().detach())

    # The same checkpoint on another layout: whole on every rank, and re-sharded.
    other = st.io.load_checkpoint(ck, mesh, {"field": (Replicate(),) * mesh.ndim})
    assert not isinstance(other.tensors["field"], st.ShardTensor) or \
        other.tensors["field"].placements == (Replicate(),) * mesh.ndim
    whole = other.tensors["field"]
    whole = whole.to_local() if isinstance(whole, st.ShardTensor) else whole
    assert torch.equal(whole, got.tensors["field"].full_tensor().detach())
