"""shardtensor's overhead at P = 1 on one device: the main job's U-Net
(examples/python/unet_train.py: UNet2d, base 8, depth 3, GroupNorm) trained on
a 512x512 grid, batch 1, Adam, with plain torch tensors and with ShardTensors
(Shard(2) over a one-rank mesh, distribute_module), on the same device.

    torchrun --standalone --nproc-per-node 1 python3 bench/gpu_overhead.py --device cuda

Each variant runs --warmup steps, then --steps timed steps (torch.cuda.synchronize
around the timed loop on CUDA); the variants alternate --rounds times and the
median step time of each is reported. One line: "gpu overhead: shardtensor X ms
vs torch Y ms per step (+Z %) ...". Used by tools/gpu_check.sh (goal: <= 5 %).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "python"))
import shardtensor as st  # noqa: E402
from shardtensor import Shard  # noqa: E402
from unet_train import UNet2d  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(net, opt, x, y, steps, device):
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    sync(device)
    return (time.perf_counter() - t0) / steps, loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    mesh = st.DeviceMesh((1,), ("domain",))
    torch.manual_seed(0)
    x = torch.randn(1, 2, args.size, args.size, device=device)
    y = torch.randn(1, 1, args.size, args.size, device=device)
    torch.manual_seed(1)
    plain = UNet2d(2, 1, 8, 3, "group").to(device)
    torch.manual_seed(1)
    sharded = st.distribute_module(UNet2d(2, 1, 8, 3, "group").to(device), mesh)
    sx = st.distribute_tensor(x, mesh, (Shard(2),))
    sy = st.distribute_tensor(y, mesh, (Shard(2),))
    opt_p = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt_s = torch.optim.Adam(sharded.parameters(), lr=1e-3)
    run(plain, opt_p, x, y, args.warmup, device)
    run(sharded, opt_s, sx, sy, args.warmup, device)
    tp, ts = [], []
    for _ in range(args.rounds):
        tp.append(run(plain, opt_p, x, y, args.steps, device)[0])
        ts.append(run(sharded, opt_s, sx, sy, args.steps, device)[0])
    p, s = statistics.median(tp), statistics.median(ts)
    load = os.getloadavg()[0]
    print(f"gpu overhead: shardtensor {s * 1e3:.1f} ms vs torch {p * 1e3:.1f} ms per step "
          f"({(s / p - 1) * 100:+.1f} %) on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"U-Net {args.size}^2, median of {args.rounds} x {args.steps} steps, load {load:.2f}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
