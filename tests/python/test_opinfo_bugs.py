"""Regression tests for the wrong results and one-rank exceptions the OpInfo sweep
listed in tests/python/opinfo_expected.py KNOWN_BUGS (issue 25, part C), each against
single-process PyTorch; each failed before its fix. Run at 1-4 ranks and on the 2x2
mesh by the python.* CTests."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, rnd
from shardtensor import Replicate, Shard


def ints(shape, seed, lo=-50, hi=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("empty", [False, True])
def test_max_pool_integer_halos(mesh, nd, empty):
    # Before: the halo was filled with -inf, which int64 cannot hold: "value cannot be
    # converted to type int64_t without overflow" on some ranks only.
    shape = (1, 2, 3, 6) if nd == 2 else (1, 2, 3, 6, 5)
    pool = F.max_pool2d if nd == 2 else F.max_pool3d
    for lo, hi in ((-50, 50), (-(2 ** 62), -(2 ** 62) + 5)):
        x = ints(shape, 1, lo, hi)
        pl = placements(mesh, 3)
        sizes = empty_first_sizes(mesh, shape, pl) if empty else None
        sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes)
        for kw in (dict(kernel_size=2), dict(kernel_size=3, stride=1, padding=1),
                   dict(kernel_size=2, stride=2, ceil_mode=True)):
            for ri in (False, True):
                got = pool(sx, return_indices=ri, **kw)
                want = pool(x, return_indices=ri, **kw)
                for a, b in zip(got if ri else (got,), want if ri else (want,)):
                    assert a.full_tensor().dtype == b.dtype
                    assert torch.equal(a.full_tensor(), b), (kw, ri)


@pytest.mark.parametrize("dim", [2, 3, 4])
@pytest.mark.parametrize("empty", [False, True])
def test_avg_pool_integer(mesh, dim, empty):
    # Before: the window sums were divided in place by true division: "result type Float
    # can't be cast to the desired output type Long" on the ranks with output rows only.
    # libtorch divides integer sums in C++ arithmetic (truncation toward zero).
    for shape, kw in [((2, 3, 3, 4, 4), dict(kernel_size=(2, 2, 2))),
                      ((1, 2, 5, 5, 5), dict(kernel_size=(2, 3, 4), stride=(1, 2, 2), padding=(0, 1, 2))),
                      ((1, 2, 5, 5, 5), dict(kernel_size=(2, 3, 4), stride=(1, 2, 2), padding=(0, 1, 2),
                                             ceil_mode=True, count_include_pad=False)),
                      ((1, 2, 4, 4, 4), dict(kernel_size=2, stride=1, padding=1, divisor_override=-3))]:
        x = ints(shape, 2)
        pl = placements(mesh, dim)
        sizes = empty_first_sizes(mesh, shape, pl) if empty else None
        sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes)
        got = F.avg_pool3d(sx, **kw).full_tensor()
        want = F.avg_pool3d(x, **kw)
        assert got.dtype == want.dtype
        assert torch.equal(got, want), (shape, kw)
        got2 = F.avg_pool2d(sx[0], **{k: (v[1:] if isinstance(v, tuple) else v) for k, v in kw.items()})
        want2 = F.avg_pool2d(x[0], **{k: (v[1:] if isinstance(v, tuple) else v) for k, v in kw.items()})
        assert torch.equal(got2.full_tensor(), want2), (shape, kw, "2d")


@pytest.mark.parametrize("empty", [False, True])
def test_sgn_backward_zero_tensor_gradient(mesh, empty):
    # Before: sgn's gradient of a real input is libtorch's storage-less ZeroTensor;
    # full_tensor() of the gradient handed its null data pointer to MPI_Iallgatherv
    # (SIGSEGV on every rank).
    x = rnd((20, 20), 3, torch.float64)
    pl = placements(mesh, 0, data_dim=1)
    sizes = empty_first_sizes(mesh, x.shape, pl) if empty else None
    xr = x.clone().requires_grad_(True)
    w = rnd((20, 20), 4, torch.float64)
    (torch.sgn(xr) * w).sum().backward()
    # Through the elementwise rule (the gradient stays a piece) ...
    sx = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=sizes)
    (torch.sgn(sx).full_tensor() * w).sum().backward()
    assert_close(sx.grad.full_tensor(), xr.grad, 0, 0, "input grad")
    assert_close(sx.grad.redistribute((Replicate(),) * mesh.ndim).to_local(), xr.grad, 0, 0,
                 "redistributed grad")
    # ... and after a gather (the gather's adjoint receives the ZeroTensor).
    sx2 = st.distribute_tensor(x, mesh, pl, requires_grad=True, sharding_shapes=sizes)
    (torch.sgn(sx2.full_tensor()) * w).sum().backward()
    assert_close(sx2.grad.full_tensor(), xr.grad, 0, 0, "input grad after a gather")
    g, = st.grad([(torch.sgn(sx2) * st.distribute_tensor(w, mesh, pl, sharding_shapes=sizes)).sum()], [sx2])
    assert_close(g.full_tensor(), xr.grad, 0, 0, "shardtensor.grad")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_complex_convolution_refused_on_every_rank(mesh, transposed, nd):
    # Before: at::convolution has no complex CPU kernel; the ranks holding data raised
    # "slow_conv2d_cpu not implemented for 'ComplexDouble'" while a rank with an empty
    # batch piece entered the halo exchange (a hang). Now every rank refuses, before
    # any communication.
    conv = {(1, False): F.conv1d, (2, False): F.conv2d, (3, False): F.conv3d,
            (1, True): F.conv_transpose1d, (2, True): F.conv_transpose2d,
            (3, True): F.conv_transpose3d}[nd, transposed]
    x = torch.randn((1, 3) + (4,) * nd, dtype=torch.complex128, generator=torch.Generator().manual_seed(5))
    w = torch.randn((3, 3) + (3,) * nd, dtype=torch.complex128, generator=torch.Generator().manual_seed(6))
    conv(x, w)  # plain torch supports it (a decomposition into real convolutions)
    for dim in (0, 2):
        pl = placements(mesh, dim, data_dim=None)
        for sizes in (None, empty_first_sizes(mesh, x.shape, pl)):
            sx = st.distribute_tensor(x, mesh, pl, sharding_shapes=sizes)
            with pytest.raises(RuntimeError, match="complex convolution is not supported"):
                conv(sx, w)
    # The real case still works afterwards (no carried error).
    sx = st.distribute_tensor(x.real.contiguous(), mesh, placements(mesh, 2, data_dim=None))
    assert_close(conv(sx, w.real.contiguous()).full_tensor(), conv(x.real, w.real), 1e-9, 1e-9)
