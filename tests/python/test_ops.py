"""torch.nn modules and functional ops on ShardTensors vs single-process PyTorch
(outputs, input gradients, parameter gradients), uneven and empty shards."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from conftest import assert_close, empty_first_sizes, placements, reference_check, rnd
from shardtensor import Shard, ShardTensor

# (name, module factory or None, fn(x[, module]), input shape, sharded tensor dim)
MODULE_CASES = [
    ("conv3x3", lambda: torch.nn.Conv2d(3, 4, 3, padding=1), None, (2, 3, 13, 6), 2),
    ("conv_stride2", lambda: torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), None, (2, 3, 14, 6), 2),
    ("conv_dilated", lambda: torch.nn.Conv2d(3, 2, 3, dilation=2, padding=2), None, (2, 3, 12, 5), 2),
    ("conv1d", lambda: torch.nn.Conv1d(3, 4, 5, padding=2), None, (2, 3, 17), 2),
    ("conv_transpose", lambda: torch.nn.ConvTranspose2d(3, 2, 2, stride=2), None, (2, 3, 9, 4), 2),
    # Note [channel-sharded transposed convolution]: the channel dim sharded (3 over 4: an empty piece).
    ("conv_transpose_channels", lambda: torch.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1,
                                                                 output_padding=1), None, (2, 3, 9, 4), 1),
    ("maxpool", lambda: torch.nn.MaxPool2d(2), None, (2, 3, 12, 6), 2),
    ("avgpool", lambda: torch.nn.AvgPool2d(3, stride=1, padding=1), None, (2, 3, 11, 6), 2),
    ("groupnorm", lambda: torch.nn.GroupNorm(2, 4), None, (2, 4, 11, 5), 2),
    ("batchnorm", lambda: torch.nn.BatchNorm2d(3), None, (2, 3, 10, 5), 2),
    ("layernorm", lambda: torch.nn.LayerNorm(6), None, (2, 3, 11, 6), 2),
    ("linear", lambda: torch.nn.Linear(6, 5), None, (2, 3, 11, 6), 2),
    ("sequential", lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
                                               torch.nn.GELU(), torch.nn.Conv2d(4, 2, 3, padding=1)),
     None, (2, 3, 13, 6), 2),
]

FN_CASES = [
    ("interpolate_bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
     (2, 3, 9, 5), 2),
    ("interpolate_nearest", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (2, 3, 9, 5), 2),
    ("pad_reflect", lambda x: F.pad(x, (1, 1, 2, 2), mode="reflect"), (2, 3, 12, 5), 2),
    ("pad_replicate", lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"), (2, 3, 12, 5), 2),
    ("pad_circular", lambda x: F.pad(x, (1, 1, 1, 1), mode="circular"), (2, 3, 12, 5), 2),
    ("softmax_sharded_dim", lambda x: torch.softmax(x, dim=2), (2, 3, 11, 5), 2),
    ("softmax_other_dim", lambda x: F.softmax(x, dim=1), (2, 3, 11, 5), 2),
    ("log_softmax", lambda x: F.log_softmax(x, dim=2), (2, 3, 11, 5), 2),
    ("sum_dim", lambda x: x.sum(dim=2), (2, 3, 11, 5), 2),
    ("mean_dim_keep", lambda x: x.mean(dim=(2, 3), keepdim=True), (2, 3, 11, 5), 2),
    ("amax", lambda x: x.amax(dim=1), (2, 3, 11, 5), 2),
    ("full_sum", lambda x: x.sum(), (2, 3, 11, 5), 2),
    ("pointwise", lambda x: torch.tanh(x) * 3 + x.exp() / 2 - F.relu(x), (2, 3, 11, 5), 2),
    ("cat_channels", lambda x: torch.cat([x, x * 2], dim=1), (2, 3, 11, 5), 2),
    ("cat_sharded_dim", lambda x: torch.cat([x, x + 1], dim=2), (2, 3, 11, 5), 2),
    ("permute_contiguous", lambda x: x.permute(0, 2, 3, 1).contiguous() * 1.5, (2, 3, 11, 5), 2),
    ("flatten_tail", lambda x: x.flatten(2, 3) * 1.0, (2, 3, 11, 5), 2),
    ("transpose_unsharded", lambda x: x.transpose(1, 3) + 0, (2, 3, 11, 5), 2),
]


def _run_module_case(mesh, factory, shape, dim, sizes_fn=None, seed=0):
    torch.manual_seed(seed)
    module = factory()
    x = rnd(shape, seed + 1)
    pl = placements(mesh, dim)
    sizes = sizes_fn(mesh, x.shape, pl) if sizes_fn else None
    y = reference_check(lambda t, m: m(t), x, mesh, pl, module=module, sizes=sizes, atol=1e-5)
    assert isinstance(y, ShardTensor)


@pytest.mark.parametrize("name,factory,_fn,shape,dim", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module(mesh, name, factory, _fn, shape, dim):
    _run_module_case(mesh, factory, shape, dim)


@pytest.mark.parametrize("name", ["conv3x3", "conv_stride2", "groupnorm", "maxpool",
                                  "conv_transpose_channels"])
def test_module_empty_shard(mesh, name):
    case = next(c for c in MODULE_CASES if c[0] == name)
    _run_module_case(mesh, case[1], case[3], case[4], sizes_fn=empty_first_sizes)


@pytest.mark.parametrize("name,fn,shape,dim", FN_CASES, ids=[c[0] for c in FN_CASES])
def test_functional(mesh, name, fn, shape, dim):
    x = rnd(shape, 11)
    reference_check(fn, x, mesh, placements(mesh, dim), atol=2e-5)


@pytest.mark.parametrize("loss", ["mse", "l1", "smooth_l1", "cross_entropy"])
def test_losses(mesh, loss):
    x = rnd((2, 4, 11, 5), 12)
    if loss == "cross_entropy":
        target = torch.randint(0, 4, (2, 11, 5), generator=torch.Generator().manual_seed(3))
        starget = st.distribute_tensor(target, mesh, placements(mesh, 1))
        fn_ref = lambda t: F.cross_entropy(t, target)
        fn_sh = lambda t: F.cross_entropy(t, starget)
    else:
        target = rnd((2, 4, 11, 5), 13)
        starget = st.distribute_tensor(target, mesh, placements(mesh, 2))
        f = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss}[loss]
        fn_ref = lambda t: f(t, target)
        fn_sh = lambda t: f(t, starget)
    xr = x.clone().requires_grad_()
    lr = fn_ref(xr)
    lr.backward()
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2), requires_grad=True)
    l = fn_sh(sx)
    assert not isinstance(l, ShardTensor)
    assert_close(l.detach(), lr.detach(), 1e-6, 1e-5, loss)
    l.backward()
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-7, 1e-5, loss + " grad")


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention(mesh, causal):
    q, k, v = (rnd((2, 2, 13, 8), s) for s in (21, 22, 23))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    s = refs[0] @ refs[1].transpose(-2, -1) / 8 ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(13, 13, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ refs[2]
    w = rnd(ref.shape, 24)
    (ref * w).sum().backward()
    pl = placements(mesh, 2)
    sq, sk, sv = (st.distribute_tensor(t, mesh, pl, requires_grad=True) for t in (q, k, v))
    out = st.scaled_dot_product_attention(sq, sk, sv, is_causal=causal)
    assert isinstance(out, ShardTensor) and out.placements == pl
    of = out.full_tensor()
    assert_close(of, ref.detach(), 1e-5, 1e-5, "attention")
    (of * w).sum().backward()
    for name, a, b in zip("qkv", (sq, sk, sv), refs):
        assert_close(a.grad.full_tensor(), b.grad, 1e-5, 1e-5, "grad " + name)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_sdpa_on_shard_tensors(mesh, causal):
    """torch 2.x's F.scaled_dot_product_attention on ShardTensors takes the ring rule
    (scale= and grouped-query heads with enable_gqa=True), equal to torch's own on full tensors."""
    F = torch.nn.functional
    q, k, v = rnd((2, 4, 13, 8), 31), rnd((2, 2, 13, 8), 32), rnd((2, 2, 13, 8), 33)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*refs, is_causal=causal, scale=0.3, enable_gqa=True)
    w = rnd(ref.shape, 34)
    (ref * w).sum().backward()
    pl = placements(mesh, 2)
    sq, sk, sv = (st.distribute_tensor(t, mesh, pl, requires_grad=True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(sq, sk, sv, is_causal=causal, scale=0.3, enable_gqa=True)
    assert isinstance(out, ShardTensor) and out.placements == pl
    of = out.full_tensor()
    assert_close(of, ref.detach(), 1e-5, 1e-5, "sdpa")
    (of * w).sum().backward()
    for name, a, b in zip("qkv", (sq, sk, sv), refs):
        assert_close(a.grad.full_tensor(), b.grad, 1e-5, 1e-5, "grad " + name)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        F.scaled_dot_product_attention(sq, sk, sv)


def test_hand_written_attention_is_a_ring(mesh):
    """softmax(q @ k^T) @ v written with plain torch ops on sequence-sharded
    tensors: both matmuls are rings (Note [ring matmul]), nothing is gathered
    (strict mode allows it), and output and gradients equal torch's."""
    q, k, v = (rnd((2, 13, 8), s) for s in (31, 32, 33))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.softmax(refs[0] @ refs[1].transpose(-2, -1), -1) @ refs[2]
    w = rnd(ref.shape, 34)
    (ref * w).sum().backward()
    pl = placements(mesh, 1)
    sq, sk, sv = (st.distribute_tensor(t, mesh, pl, requires_grad=True) for t in (q, k, v))
    st.set_strict(True)
    try:
        st.reset_comm_stats()
        out = torch.softmax(sq @ sk.transpose(-2, -1), -1) @ sv
        assert st.comm_stats()["gathered_bytes"] == 0
        assert isinstance(out, ShardTensor) and out.placements == pl
        of = out.full_tensor()
        assert_close(of, ref.detach(), 1e-5, 1e-5, "attention")
        (of * w).sum().backward()
    finally:
        st.set_strict(False)
    for name, a, b in zip("qkv", (sq, sk, sv), refs):
        assert_close(a.grad.full_tensor(), b.grad, 1e-5, 1e-5, "grad " + name)


def test_backward_non_scalar(mesh):
    x = rnd((2, 3, 11, 5), 31)
    conv = torch.nn.Conv2d(3, 2, 3, padding=1)
    st.distribute_module(conv, mesh)
    xr = x.clone().requires_grad_()
    g = rnd((2, 2, 11, 5), 32)
    conv(xr).backward(g)
    ref_w = conv.weight.grad.clone()
    conv.zero_grad()
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2), requires_grad=True)
    st.backward(conv(sx), g)
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-5, 1e-5, "st.backward input grad")
    assert_close(conv.weight.grad, ref_w, 1e-4, 1e-4, "st.backward weight grad")
    sx.grad = None
    conv.zero_grad()
    out = conv(sx)
    out.backward(st.distribute_tensor(g, mesh, out.placements))  # Tensor.backward on a ShardTensor
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-5, 1e-5, "ShardTensor.backward input grad")


def _pieces(sx):
    """For every mesh coordinate: {tensor dim: (offset, size)} of its piece."""
    import itertools
    shapes = sx._spec.sharding_shapes()
    per_dim = []  # per mesh dim: for each coordinate, (tensor dim, offset, size) or None
    for i, p in enumerate(sx.placements):
        if isinstance(p, Shard):
            sizes = [s[p.dim] for s in shapes[i]]
            per_dim.append([(p.dim, sum(sizes[:j]), n) for j, n in enumerate(sizes)])
        else:
            per_dim.append([None] * sx.device_mesh.size(i))
    out = {}
    for coord in itertools.product(*[range(len(d)) for d in per_dim]):
        entries = [per_dim[i][c] for i, c in enumerate(coord)]
        out[coord] = {e[0]: (e[1], e[2]) for e in entries if e is not None}
    return out


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("empty", [False, True])
def test_halo_exchange_begin_end(mesh, mode, empty):
    """halo_exchange and its split-phase form equal the padded global tensor's window
    around every piece, values and gradients, uneven and with an empty first piece."""
    full = rnd((2, 3, 11, 5), 41, torch.float64)
    left, right, value = 2, 1, 0.5
    pl = placements(mesh, 2)
    sizes = empty_first_sizes(mesh, full.shape, pl) if empty else None

    def pad(t):
        if mode == "constant":
            return F.pad(t, (0, 0, left, right), value=value)
        return F.pad(t, (0, 0, left, right), mode=mode)

    wfull = rnd((2, 3, 11 + left + right, 5), 42, torch.float64)

    def window(t, piece):
        for d, (o, n) in piece.items():
            t = t.narrow(d, o, n + left + right) if d == 2 else t.narrow(d, o, n)
        return t

    xr = full.clone().requires_grad_()
    probe = st.distribute_tensor(full, mesh, pl, sharding_shapes=sizes)
    pieces = _pieces(probe)
    padded = pad(xr)
    sum(((window(padded, p) * window(wfull, p)).sum() for p in pieces.values())).backward()
    mine = pieces[tuple(mesh.get_coordinate())]

    grads = []
    for split in (False, True):
        sx = st.distribute_tensor(full, mesh, pl, sharding_shapes=sizes, requires_grad=True)
        if split:
            pending = st.halo_exchange_begin(sx, 2, left, right, mode=mode, value=value)
            assert isinstance(pending.test(), bool)
            ext = st.halo_exchange_end(pending)
            with pytest.raises(RuntimeError, match="halo_exchange_end"):
                st.halo_exchange_end(pending)
        else:
            ext = st.halo_exchange(sx, 2, left, right, mode=mode, value=value)
        assert not isinstance(ext, ShardTensor)
        assert torch.equal(ext.detach(), window(padded.detach(), mine)), (mode, split)
        (ext * window(wfull, mine)).sum().backward()
        g = sx.grad.to_local()
        ref = xr.grad
        for d, (o, n) in mine.items():
            ref = ref.narrow(d, o, n)
        assert_close(g, ref, 1e-12, 1e-12, f"halo grad {mode} split={split}")
        grads.append(g)
    assert torch.equal(grads[0], grads[1])
