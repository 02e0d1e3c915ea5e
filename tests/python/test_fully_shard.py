"""shardtensor.fully_shard (FSDP/ZeRO over the "data" mesh dim, domain parallelism over
"domain"): three torch.optim steps equal single-process steps on the whole batch, at every
data x domain layout of the ranks, with 1/D of the parameters and optimizer state per rank."""

import copy
import math

import pytest
import torch

import shardtensor as st
from conftest import rnd


class Block(torch.nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, cout)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b1 = Block(2, 4)
        self.b2 = Block(4, 4)
        self.tiny = torch.nn.Conv2d(4, 1, 1, bias=False)  # a unit of 4 elements
        self.head = torch.nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.head(self.tiny(self.b2(self.b1(x))))


def _step_both(net, o, sx, sy, ref, ro, x, y, where):
    """One MSE training step of the sharded model and of the single-process reference; the
    losses must agree to 1e-10 relative. Returns the sharded loss."""
    ro.zero_grad()
    rl = torch.nn.functional.mse_loss(ref(x), y)
    rl.backward()
    ro.step()
    o.zero_grad()
    loss = torch.nn.functional.mse_loss(net(sx), sy)
    loss.backward()
    assert abs(loss.item() - rl.item()) <= 1e-10 * abs(rl.item()), where
    o.step()
    return loss


def layouts():
    p = st.world_size()
    return [(d, p // d) for d in range(1, p + 1) if p % d == 0]


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_fully_shard_matches_single_process(reshard, opt):
    make = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}[opt]
    for d, dom in layouts():
        mesh = st.DeviceMesh((d, dom), ("data", "domain"))
        torch.manual_seed(11)
        net = Net().double()
        ref = copy.deepcopy(net)
        # A unit per block and one for a single 1x1 conv's 4 weights, then the root (the head's
        # 10 elements: padded at D = 3 and 4; tests/test_fully_shard.cpp has a unit smaller than D).
        for m in (net.b1, net.b2, net.tiny):
            st.fully_shard(m, mesh, "data", reshard_after_forward=reshard)
        st.fully_shard(net, mesh, "data", reshard_after_forward=reshard)
        flats = list(net.parameters())
        assert len(flats) == 4
        counts = [sum(p.numel() for p in m.parameters()) for m in (ref.b1, ref.b2, ref.tiny)]
        counts.append(sum(p.numel() for p in ref.head.parameters()))
        assert sorted(f.numel() for f in flats) == sorted(math.ceil(c / d) for c in counts)
        o, ro = make(net.parameters()), make(ref.parameters())
        batch = d + 1
        x = rnd((batch, 2, 12, 6), 300, torch.float64)
        y = rnd((batch, 1, 12, 6), 301, torch.float64)
        pl = (st.Shard(0), st.Shard(2))
        sx = st.distribute_tensor(x, mesh, pl)
        sy = st.distribute_tensor(y, mesh, pl)
        for step in range(3):
            loss = _step_both(net, o, sx, sy, ref, ro, x, y, (d, dom, step))
            assert not isinstance(loss, st.ShardTensor)
        full = st.full_state_dict(net)
        for name, rp in ref.named_parameters():
            assert torch.allclose(full[name], rp, rtol=1e-10, atol=1e-14), (d, dom, name)
        if opt == "adam":
            for mod, rmod in ((net.b1, ref.b1), (net.tiny, ref.tiny)):
                state = o.state[mod._st_flat_param]
                assert state["exp_avg"].numel() == mod._st_flat_param.numel()
                got = st.unflatten_shard(mod, state["exp_avg"])
                for name, rp in rmod.named_parameters():
                    assert torch.allclose(got[name], ro.state[rp]["exp_avg"], rtol=1e-10, atol=1e-16)


def test_clip_and_state_roundtrip():
    for d, dom in layouts():
        mesh = st.DeviceMesh((d, dom), ("data", "domain"))
        torch.manual_seed(12)
        net = Net().double()
        ref = copy.deepcopy(net)
        st.fully_shard(net.b1, mesh, "data")
        st.fully_shard(net, mesh, "data")
        x = rnd((d, 2, 12, 6), 400, torch.float64)
        sx = st.distribute_tensor(x, mesh, (st.Shard(0), st.Shard(2)))
        net(sx).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
        n = st.clip_grad_norm_(net, 1e-3)
        assert abs(n - rn.item()) <= 1e-10 * rn.item()
        got = st.unflatten_shard(net.b1, net.b1._st_flat_param.grad)
        for name, rp in ref.b1.named_parameters():
            assert torch.allclose(got[name], rp.grad, rtol=1e-10, atol=1e-16), name
        # full state out, into a differently initialized model
        torch.manual_seed(99)
        other = Net().double()
        st.fully_shard(other.b1, mesh, "data")
        st.fully_shard(other, mesh, "data")
        st.load_full_state_dict(other, st.full_state_dict(net))
        a, b = net(sx).full_tensor(), other(sx).full_tensor()
        assert torch.equal(a, b)
        with pytest.raises(KeyError, match="no value for"):
            st.load_full_state_dict(other, {})


def _unet_class():
    """The U-Net of the Python main job (examples/python/unet_train.py, the same model as
    examples/models/unet.h)."""
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    examples = os.path.join(here, "..", "..", "examples")
    sys.path.insert(0, examples)
    spec = importlib.util.spec_from_file_location(
        "st_unet_train", os.path.join(examples, "python", "unet_train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.UNet2d


@pytest.mark.parametrize("reshard", [True, False])
def test_unet_main_job_adam_steps_match_single_process(reshard):
    """The issue's check in Python: three Adam steps of the main job's U-Net (GroupNorm, one
    unit per encoder/decoder block and the root) at every data x domain layout (np4: 1x4,
    2x2, 4x1) equal single-process steps on the whole batch: losses, parameters and both Adam
    moments, float64 to 1e-10 relative. Steps 2 and 3 run with early gathers and overlapped
    reductions (Note [fully_shard prefetch])."""
    UNet2d = _unet_class()
    for d, dom in layouts():
        mesh = st.DeviceMesh((d, dom), ("data", "domain"))
        torch.manual_seed(13)
        net = UNet2d(2, 1, base_channels=4, depth=2, norm="group", groups=2).double()
        ref = copy.deepcopy(net)
        blocks = list(net.enc) + list(net.dec)
        for m in blocks:
            st.fully_shard(m, mesh, "data", reshard_after_forward=reshard)
        st.fully_shard(net, mesh, "data", reshard_after_forward=reshard)
        assert len(list(net.parameters())) == len(blocks) + 1
        o = torch.optim.Adam(net.parameters(), lr=1e-2)
        ro = torch.optim.Adam(ref.parameters(), lr=1e-2)
        batch = d + 1  # uneven over the data dim
        x = rnd((batch, 2, 16, 12), 500, torch.float64)
        y = rnd((batch, 1, 16, 12), 501, torch.float64)
        pl = (st.Shard(0), st.Shard(2))
        sx, sy = st.distribute_tensor(x, mesh, pl), st.distribute_tensor(y, mesh, pl)
        for step in range(3):
            _step_both(net, o, sx, sy, ref, ro, x, y, (d, dom, step))
        full = st.full_state_dict(net)
        for name, rp in ref.named_parameters():
            assert torch.allclose(full[name], rp, rtol=1e-10, atol=1e-14), (d, dom, name)
        rmods = list(ref.enc) + list(ref.dec)
        for mod, rmod in zip(blocks, rmods):
            state = o.state[mod._st_flat_param]
            assert state["exp_avg"].numel() == mod._st_flat_param.numel()
            for key, atol in (("exp_avg", 1e-16), ("exp_avg_sq", 1e-20)):
                got = st.unflatten_shard(mod, state[key])
                for name, rp in rmod.named_parameters():
                    assert torch.allclose(got[name], ro.state[rp][key], rtol=1e-10, atol=atol), \
                        (d, dom, key, name)


class CScale(torch.nn.Module):
    def __init__(self, n, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(n, dtype=torch.complex128, generator=g))

    def forward(self, x):
        return x * self.w


class CNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = CScale(5, 1), CScale(5, 2)
        self.c = torch.nn.Parameter(torch.tensor([0.5 - 0.25j], dtype=torch.complex128))

    def forward(self, x):
        return self.b(self.a(x)) + self.c


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_complex_parameters_and_nonfinite_gradients(poison):
    """Complex parameters (a unit of 5 complex128, the root's single element: padded at every
    D > 1) take the same SGD steps as single-process; an inf or NaN in one input sample gives
    exactly the single-process non-finite gradients (reduce-scatter and domain sums keep IEEE
    values)."""
    for d, dom in layouts():
        mesh = st.DeviceMesh((d, dom), ("data", "domain"))
        net = CNet()
        ref = copy.deepcopy(net)
        st.fully_shard(net.a, mesh, "data")
        st.fully_shard(net.b, mesh, "data")
        st.fully_shard(net, mesh, "data")
        o = torch.optim.SGD(net.parameters(), lr=0.1)
        ro = torch.optim.SGD(ref.parameters(), lr=0.1)
        batch = 2 * d + 1
        x = torch.complex(rnd((batch, 7, 5), 600, torch.float64), rnd((batch, 7, 5), 601, torch.float64))
        if poison:
            x[batch - 1, 3, 2] = float(poison)
        sx = st.distribute_tensor(x, mesh, (st.Shard(0), st.Shard(1)))
        for step in range(2):
            ro.zero_grad()
            rl = ref(x).abs().pow(2).mean()
            rl.backward()
            ro.step()
            o.zero_grad()
            loss = net(sx).abs().pow(2).mean()
            loss.backward()
            torch.testing.assert_close(loss.full_tensor() if isinstance(loss, st.ShardTensor) else loss,
                                       rl, rtol=1e-10, atol=0, equal_nan=True)
            o.step()
        full = st.full_state_dict(net)
        for name, rp in ref.named_parameters():
            torch.testing.assert_close(full[name], rp.detach(), rtol=1e-10, atol=1e-14,
                                       equal_nan=True, msg=f"{d}x{dom} {name}")
        if poison:
            assert not torch.isfinite(full["a.w"]).all()
