"""Issue 25 (part A): edges of "a ShardTensor is a real tensor", from Python, against
single-process PyTorch: the FNO spectral layer verbatim (a plain out_ft assigned from a
sharded einsum: a visible gather), Partial sums divided by zero or scaled by inf,
cummax/cummin of integer tensors with empty pieces, random ops that are independent of
the placement, and constant padding of a zero-extent dim."""

import warnings

import pytest
import torch

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, reference_check, rnd
from shardtensor import Replicate, Shard


class SpectralConv2d(torch.nn.Module):
    """The spectral layer of the original FNO code (Li et al., fourier_2d.py), verbatim
    but for the weight initialisation (seeded here)."""

    def __init__(self, in_channels, out_channels, modes1, modes2):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1
        self.modes2 = modes2
        self.scale = 1 / (in_channels * out_channels)
        g = torch.Generator().manual_seed(3)
        self.weights1 = torch.nn.Parameter(
            self.scale * torch.rand(in_channels, out_channels, self.modes1, self.modes2, dtype=torch.cfloat,
                                    generator=g))
        self.weights2 = torch.nn.Parameter(
            self.scale * torch.rand(in_channels, out_channels, self.modes1, self.modes2, dtype=torch.cfloat,
                                    generator=g))

    def compl_mul2d(self, input, weights):
        return torch.einsum("bixy,ioxy->boxy", input, weights)

    def forward(self, x):
        batchsize = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(batchsize, self.out_channels, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat,
                             device=x.device)
        out_ft[:, :, :self.modes1, :self.modes2] = \
            self.compl_mul2d(x_ft[:, :, :self.modes1, :self.modes2], self.weights1)
        out_ft[:, :, -self.modes1:, :self.modes2] = \
            self.compl_mul2d(x_ft[:, :, -self.modes1:, :self.modes2], self.weights2)
        x = torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))
        return x


@pytest.mark.parametrize("empty", [False, True])
def test_fno_spectral_layer_verbatim(mesh, empty):
    st.set_strict(False)
    shape = (2, 3, 10, 8)
    x = rnd(shape, 1)
    pl = placements(mesh, 2)
    sizes = empty_first_sizes(mesh, shape, pl) if empty else None
    layer = SpectralConv2d(3, 2, 3, 3)
    st.reset_comm_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = reference_check(lambda t, m: m(t), x, mesh, pl, module=layer, sizes=sizes, atol=1e-4, rtol=1e-4)
    # The plain out_ft holds the full values on every rank: so does its irfft2.
    assert not isinstance(y, st.ShardTensor)
    if mesh.size() > 1:
        # gathered_bytes is per rank: a rank that already holds the whole slice (rank 0
        # at 2 ranks: rfft2's Shard(3) pieces are 3 and 2 columns, the slice keeps :3)
        # gathers nothing; the job as a whole must have gathered.
        mine = torch.tensor([float(st.comm_stats()["gathered_bytes"])])
        world = st.DeviceMesh((-1,))
        total = st.ShardTensor.from_local(mine, world, (Shard(0),)).full_tensor().sum().item()
        assert total > 0


def test_fno_spectral_layer_strict_mode_suggests_new_zeros(mesh):
    layer = SpectralConv2d(3, 2, 3, 3)
    sx = st.distribute_tensor(rnd((2, 3, 10, 8), 2), mesh, placements(mesh, 2))
    st.set_strict(True)
    try:
        with pytest.raises(RuntimeError, match="new_zeros"):
            layer(sx)
    finally:
        st.set_strict(False)


def test_partial_divided_by_zero_and_scaled_by_inf(mesh):
    a, b = rnd((5, 11), 3), rnd((11, 4), 4)
    pa = (Shard(0), Shard(1)) if mesh.ndim == 2 else (Shard(1),)
    pb = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
    sa, sb = st.distribute_tensor(a, mesh, pa), st.distribute_tensor(b, mesh, pb)
    ref = a @ b
    for name, f in [("/ 0", lambda p: p / 0), ("* inf", lambda p: p * float("inf")),
                    ("[1, 2] / 0", lambda p: p[1, 2] / 0), ("* -inf", lambda p: p * -float("inf"))]:
        got = f(sa @ sb)
        got = got.full_tensor() if isinstance(got, st.ShardTensor) else got
        want = f(ref)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        assert torch.equal(torch.isposinf(got), torch.isposinf(want)), name
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), name


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_cummax_cummin_integer_with_empty_piece(mesh, dtype):
    x = (rnd((9, 4), 5) * 40).round().clamp(-128, 127)
    x = (x > 0) if dtype == torch.bool else (x.abs() if dtype == torch.uint8 else x).to(dtype)
    pl = placements(mesh, 0, data_dim=1)
    for sizes in (None, empty_first_sizes(mesh, x.shape, pl)):
        sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes)
        for f in (torch.cummax, torch.cummin):
            v, i = f(sx, 0)
            rv, ri = f(x, 0)
            assert torch.equal(v.full_tensor(), rv), f.__name__
            assert torch.equal(i.full_tensor(), ri), f.__name__


def test_random_ops_ignore_the_placement(mesh):
    x = torch.zeros(9, 7)
    outs = {}
    for pl in [placements(mesh, 0, data_dim=1), (Replicate(),) * mesh.ndim]:
        sx = st.distribute_tensor(x, mesh, pl)
        res = []
        for f in (lambda t: torch.randint_like(t, 10), lambda t: torch.randint_like(t, -3, 7),
                  lambda t: t.clone().random_(), lambda t: t.clone().random_(0, 5),
                  lambda t: t.clone().exponential_(), lambda t: t.clone().geometric_(0.4),
                  lambda t: t.clone().cauchy_(), lambda t: t.clone().log_normal_()):
            torch.manual_seed(11 + st.world_rank())  # rank 0's key is used by all
            y = f(sx)
            res.append(y.full_tensor())
            # Replicas hold identical values: a Replicate result's piece is the whole.
            if all(isinstance(p, Replicate) for p in y.placements):
                assert torch.equal(y.to_local(), y.full_tensor())
        outs[str(pl)] = res
    a, b = outs.values()
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("sharded_dim", [0, 2])
def test_constant_pad_of_zero_extent_dim(mesh, sharded_dim):
    x = torch.zeros(3, 0, 4)
    pl = placements(mesh, sharded_dim, data_dim=None)
    for sizes in (None, empty_first_sizes(mesh, x.shape, pl)):
        sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes)
        for pad in [(0, 0, 2, 1), (1, -2, 2, 1)]:
            y = torch.nn.functional.pad(sx, pad, value=2.5)
            assert_close(y.full_tensor(), torch.nn.functional.pad(x, pad, value=2.5), what=str(pad))


def test_to_local_of_a_stale_copy_view_raises(mesh):
    """x[2] along a sharded dim is a copy (torch's is a view). After a write into x it
    follows x at its next use (Note [stale copy views]); to_local(), which never
    communicates, raises on every rank instead of returning old values."""
    x = rnd((5, 5), 4)
    pl = placements(mesh, 0, data_dim=1)
    sx = st.distribute_tensor(x, mesh, pl)
    y = sx[2]
    # A piece in x's own memory (a true view) never goes stale; a copy does.
    copy = y.to_local().untyped_storage().data_ptr() != sx.to_local().untyped_storage().data_ptr()
    sx.add_(1)
    if copy:
        with pytest.raises(RuntimeError, match=r"Note \[stale copy views\]"):
            y.to_local()
    else:
        y.to_local()
    y.clone()  # any op brings the copy up to date
    assert_close(y.full_tensor(), x[2] + 1, what="x[2] after x.add_(1)")
    mine = st.distribute_tensor(x[2] + 1, mesh, y.placements,
                                sharding_shapes=y._spec.sharding_shapes()).to_local()
    assert torch.equal(y.to_local(), mine)
