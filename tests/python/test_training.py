"""torch.optim training after distribute_module equals single-process training;
state_dict saved from rank 0 loads back single-process."""

import copy
import os
import tempfile

import pytest
import torch

import shardtensor as st
from conftest import assert_close, placements, rnd


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, 6, 3, padding=1)
        self.n1 = torch.nn.GroupNorm(2, 6)
        self.c2 = torch.nn.Conv2d(6, 6, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.c3 = torch.nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.n1(self.c1(x)))
        h = torch.relu(self.c2(h))
        h = self.up(h)
        return x[:, :1] + self.c3(h)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_training_matches_single_process(mesh, opt):
    torch.manual_seed(5)
    net = Net().double()
    st.distribute_module(net, mesh)
    ref = copy.deepcopy(net)
    o, ro = OPTIMIZERS[opt](net.parameters()), OPTIMIZERS[opt](ref.parameters())
    pl = placements(mesh, 2)
    for step in range(3):
        x = rnd((2, 2, 12, 6), 100 + step, torch.float64)
        y = rnd((2, 1, 12, 6), 200 + step, torch.float64)
        rl = torch.nn.functional.mse_loss(ref(x), y)
        ro.zero_grad()
        rl.backward()
        ro.step()
        sx = st.distribute_tensor(x, mesh, pl)
        sy = st.distribute_tensor(y, mesh, pl)
        loss = torch.nn.functional.mse_loss(net(sx), sy)
        o.zero_grad()
        loss.backward()
        o.step()
        assert_close(loss.detach(), rl.detach(), 1e-12, 1e-9, f"loss at step {step}")
    for (name, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        assert_close(p.detach(), r.detach(), 1e-10, 1e-7, name)


def test_state_dict_saved_on_rank0_loads_single_process(mesh):
    torch.manual_seed(6)
    net = Net()
    st.distribute_module(net, mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x = rnd((2, 2, 12, 6), 300)
    sx = st.distribute_tensor(x, mesh, placements(mesh, 2))
    net(sx).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        out = net(sx).full_tensor()
    if mesh.get_rank() == 0:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "net.pt")
            torch.save(net.state_dict(), path)
            fresh = Net()
            fresh.load_state_dict(torch.load(path))
        with torch.no_grad():
            assert_close(fresh(x), out, 1e-5, 1e-5, "reloaded model")


def test_gradient_penalty_with_create_graph_matches_torch(mesh):
    """st.grad(..., create_graph=True) through a conv and a softmax over a sharded dim:
    the gradients and the second derivatives of a penalty equal torch's on one process.
    In float64: the second-order weight gradient sums products over every sharded
    position, and in float32 the single-process reference itself is only good to
    ~1e-5 (its rounding depends on the BLAS libtorch calls); in float64 both must
    agree to 1e-10."""
    x = rnd((2, 3, 10, 6), 40, torch.float64)
    w = rnd((4, 3, 3, 3), 41, torch.float64) * 0.5

    def f(t, wt):
        return torch.softmax(torch.nn.functional.conv2d(t, wt, padding=1), dim=2)

    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    gx, gw = torch.autograd.grad((f(xr, wr) ** 2).sum(), (xr, wr), create_graph=True)
    ((gx * gx).sum() + (gw * gw).sum()).backward()

    sx = st.distribute_tensor(x, mesh, placements(mesh, 2), requires_grad=True)
    ws = w.clone().requires_grad_(True)
    sgx, sgw = st.grad((f(sx, ws) ** 2).sum(), (sx, ws), create_graph=True)
    assert isinstance(sgx, st.ShardTensor) and sgx.placements == sx.placements
    assert not isinstance(sgw, st.ShardTensor)
    ((sgx * sgx).sum() + (sgw * sgw).sum()).backward()
    assert_close(sgx.full_tensor().detach(), gx.detach(), 1e-10, 1e-10, "d/dx")
    assert_close(sgw.detach(), gw.detach(), 1e-10, 1e-10, "d/dw")
    assert_close(sx.grad.full_tensor(), xr.grad, 1e-10, 1e-10, "second order, x")
    assert_close(ws.grad, wr.grad, 1e-10, 1e-10, "second order, w")
    with pytest.raises(ValueError, match="2 grad_outputs for 1 outputs"):
        st.grad(sx.sum(), sx, grad_outputs=[torch.ones(()), torch.ones(())])
