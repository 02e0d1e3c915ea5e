"""A Fourier neural operator learns the main job's diffusion solver, trained
domain-parallel with shardtensor: the Python version of examples/fno_train.cpp
(same model as examples/models/fno.h, same data and MATCH check).

    PYTHONPATH=build/python mpirun -np 4 python3 examples/python/fno_train.py [flags]   (make demo-py-fno)

Data: the diffusion solver of examples/python/unet_train.py (input [u0, log kappa],
target u after k explicit steps), each rank computing only its own rows. Mesh
("data", "domain"): batch over "data" (Shard(0)), rows over "domain" (Shard(2)).

Model: a plain torch.nn FNO written the usual PyTorch way; nothing in it knows
about shardtensor. Lifting (1x1 conv) -> 4 x [spectral convolution + 1x1 conv
skip, GELU] -> projection (1x1 conv, GELU, 1x1 conv). The spectral convolution:
``x_ft = torch.fft.rfft2(x)``, a zero spectrum ``x_ft.new_zeros(...)``, the two
low-frequency mode corners written by slice assignment
(``out_ft[:, :, :m1, :m2] = torch.einsum(...)``), ``torch.fft.irfft2(out_ft, s=(H, W))``.
On a ShardTensor sharded along H these become pencil FFTs (one all-to-all each
way), a local einsum in the spectral layout, and slice assignment into the
sharded spectrum (view semantics: the writes reach out_ft).

At the end one sharded Adam step on a 64x64 grid (float64) is compared with a
single-process PyTorch step (loss and every parameter): prints MATCH or MISMATCH,
and the exit code says so. A PNG shows input, prediction, target and error of
one validation sample, each panel titled and with a colour bar (validate_and_draw in
unet_train.py, examples/plot_panels.py).
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import shardtensor as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_train import (make_batch, max_over_ranks, mesh_shape,  # noqa: E402
                        one_step_check, validate_and_draw)


# ---- model (examples/models/fno.h) ----------------------------------------------------------
class SpectralConv2d(torch.nn.Module):
    """out[b, o, kx, ky] = sum_i x_ft[b, i, kx, ky] * w[i, o, kx, ky] on the lowest
    modes1 x modes2 modes (both signs of kx); the other modes are zero. The weights
    are real [in, out, m1, m2, 2] viewed as complex, so .double() and the
    optimizers treat them as ordinary real parameters."""

    def __init__(self, cin, cout, modes1, modes2):
        super().__init__()
        self.cout, self.m1, self.m2 = cout, modes1, modes2
        scale = 1.0 / (cin * cout)
        self.w1 = torch.nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, 2))
        self.w2 = torch.nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, 2))

    def forward(self, x):
        B, H, W = x.shape[0], x.shape[-2], x.shape[-1]
        m1, m2 = self.m1, self.m2
        if 2 * m1 > H or m2 > W // 2 + 1:
            raise ValueError(f"SpectralConv2d: too many modes for {H}x{W}")
        x_ft = torch.fft.rfft2(x)
        out_ft = x_ft.new_zeros(B, self.cout, H, W // 2 + 1)
        w1, w2 = torch.view_as_complex(self.w1), torch.view_as_complex(self.w2)
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], w1)
        out_ft[:, :, H - m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, H - m1:, :m2], w2)
        return torch.fft.irfft2(out_ft, s=(H, W))


class FNO2d(torch.nn.Module):
    def __init__(self, cin, cout, width=16, modes=12, blocks=4, projection=32):
        super().__init__()
        self.lift = torch.nn.Conv2d(cin, width, 1)
        self.spectral = torch.nn.ModuleList(
            [SpectralConv2d(width, width, modes, modes) for _ in range(blocks)])
        self.skip = torch.nn.ModuleList([torch.nn.Conv2d(width, width, 1) for _ in range(blocks)])
        self.proj1 = torch.nn.Conv2d(width, projection, 1)
        self.proj2 = torch.nn.Conv2d(projection, cout, 1)

    def forward(self, x):
        x = self.lift(x)
        for i, (spectral, skip) in enumerate(zip(self.spectral, self.skip)):
            x = spectral(x) + skip(x)
            if i + 1 < len(self.spectral):
                x = F.gelu(x)
        return self.proj2(F.gelu(self.proj1(x)))


def predict(net, x):
    """The emulator predicts the change: u_k = u0 + FNO([u0, log kappa])."""
    return x[:, 0:1] + net(x)


# ---- the check ------------------------------------------------------------------------------
def verify_small(args, mesh, world, root):
    """One sharded Adam step on 64x64 (float64) vs a single-process PyTorch step."""
    return one_step_check(lambda: FNO2d(2, 1, args.width, min(args.modes, 8)), predict, mesh,
                          world, root, args.lr)


# ---- training -------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--solver-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mesh", default=None, help="DATAxDOMAIN, e.g. 2x2 (default 1x<ranks>)")
    ap.add_argument("--batch", type=int, default=-1)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--modes", type=int, default=12)
    ap.add_argument("--png", default="fno_train_py.png")
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args()

    world, data, domain = mesh_shape(args.mesh)
    batch = max(2, data) if args.batch < 0 else args.batch
    if batch < data:
        raise SystemExit("--batch must be at least DATA")
    if 2 * args.modes > args.size:
        raise SystemExit("--modes must be at most size/2")
    mesh = st.DeviceMesh((data, domain), ("data", "domain"))
    root = mesh.get_rank() == 0
    if root:
        print(f"fno_train.py: {args.size}x{args.size} grid, mesh {data} (data) x {domain} (domain), "
              f"batch {batch}, FNO width {args.width} modes {args.modes}, 4 spectral blocks, "
              f"{args.solver_steps} solver steps, {args.steps} training steps, Adam lr {args.lr:g}",
              flush=True)
    torch.manual_seed(1)
    net = FNO2d(2, 1, args.width, args.modes)
    st.distribute_module(net, mesh)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    # A fixed training set of 4 batches, cycled (the solver is the slow part).
    train = [make_batch(mesh, batch, args.size, args.solver_steps, i * batch) for i in range(4)]
    first = last = 0.0
    for step in range(args.steps):
        inp, tgt = train[step % len(train)]
        t0 = time.perf_counter()
        base = st.memory_stats()["current_bytes"]
        st.reset_peak_memory_stats()
        st.reset_comm_stats()
        opt.zero_grad()
        loss = (predict(net, inp) - tgt).pow(2).mean()
        loss.backward()
        opt.step()
        peak = max_over_ranks((st.memory_stats()["peak_bytes"] - base) / 1e6, world)
        sent = max_over_ranks(st.comm_stats()["bytes_sent"] / 1e6, world)
        dt = time.perf_counter() - t0
        l = loss.item()
        first = l if step == 0 else first
        last = l
        if root and (step % args.log_every == 0 or step + 1 == args.steps):
            print(f"step {step:3d}  loss {l:.6f}  {dt:.2f}s/step  peak tensor memory/rank "
                  f"{peak:.1f} MB  sent/rank {sent:.2f} MB", flush=True)
    if root and args.steps > 0:
        ratio = first / max(1e-30, last)
        if ratio >= 1.0:
            print(f"loss {first:.6f} -> {last:.6f} ({ratio:.1f}x lower)")
        else:
            print(f"loss {first:.6f} -> {last:.6f} ({1 / ratio:.1f}x HIGHER: more steps or a lower --lr)")

    validate_and_draw(net, predict, mesh, data, args, root)
    ok = verify_small(args, mesh, world, root)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
