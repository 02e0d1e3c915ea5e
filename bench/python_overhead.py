"""Python-path overhead: one U-Net training step through `import shardtensor`,
timed the way `shardtensor_bench run --workload unet2d --mode train` times the C++
path (same model: examples/models/unet.h via examples/python/unet_train.py's port;
same step: zero_grad, forward, loss = mean(out^2), backward, SGD(momentum 0.9);
a barrier before every timed step; the step time is the max over ranks).

    PYTHONPATH=build/python mpirun -np 2 /usr/bin/python3 bench/python_overhead.py --size 512
    mpirun -np 2 build/bench/shardtensor_bench run --workload unet2d --shape 512,512 --no-baseline

Prints one line per timed step and the median; compare with the C++ bench's median.
"""

import argparse
import os
import statistics
import sys
import time

import torch

import shardtensor as st
from shardtensor import Shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "python"))
from unet_train import UNet2d  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--base-channels", type=int, default=16)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-wrapper-timing", action="store_true",
                    help="do not measure the time spent in ShardTensor.__torch_function__ itself")
    args = ap.parse_args()

    # The Python layer's own cost, independent of machine load: time spent in
    # ShardTensor.__torch_function__ outside the op it forwards (re-typing results).
    wrapper = {"calls": 0, "outside": 0.0}
    if not args.no_wrapper_timing:
        from shardtensor import _tensor

        cls = _tensor.ShardTensor
        disable, wrap_result = _tensor._DisableTorchFunction, _tensor._wrap_result

        def timed_torch_function(klass, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            with disable():
                t1 = time.perf_counter()
                ret = func(*args, **(kwargs or {}))
                t2 = time.perf_counter()
            out = wrap_result(ret)
            wrapper["calls"] += 1
            wrapper["outside"] += (t1 - t0) + (time.perf_counter() - t2)
            return out

        cls.__torch_function__ = classmethod(timed_torch_function)

    mesh = st.DeviceMesh((-1,))
    torch.manual_seed(0)
    net = UNet2d(1, 1, args.base_channels, args.depth, "group")
    st.distribute_module(net, mesh)
    net.train(True)
    x = torch.randn(1, 1, args.size, args.size) if mesh.get_rank() == 0 else None
    sx = st.scatter_tensor(x, 0, mesh, (Shard(2),))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sync = st.distribute_tensor(torch.zeros(mesh.size()), mesh, (Shard(0),))

    def step():
        opt.zero_grad()
        loss = net(sx).pow(2).mean()
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    times = []
    wrapper["calls"], wrapper["outside"] = 0, 0.0
    for _ in range(args.steps):
        sync.full_tensor()  # barrier
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    worst = st.ShardTensor.from_local(torch.tensor(times, dtype=torch.float64)[None], mesh,
                                      (Shard(0),)).full_tensor().max(0).values.tolist()
    if mesh.get_rank() == 0:
        print(f"python path: unet2d train {args.size}x{args.size}, P={mesh.size()}, base "
              f"{args.base_channels} depth {args.depth}: step times (max over ranks) "
              + " ".join(f"{t:.3f}" for t in worst)
              + f" s; median {statistics.median(worst):.3f} s", flush=True)
        if not args.no_wrapper_timing:
            calls = wrapper["calls"] / args.steps
            outside = wrapper["outside"] / args.steps
            print(f"python layer (rank 0): {calls:.0f} __torch_function__ calls per step, "
                  f"{outside * 1e3:.2f} ms per step outside the ops "
                  f"({outside / calls * 1e6:.1f} us per call, "
                  f"{100 * outside / statistics.median(worst):.3f}% of the step)", flush=True)


if __name__ == "__main__":
    main()
