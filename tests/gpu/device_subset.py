"""The device test subset of tools/gpu_check.sh: a few differential checks whose
pieces live on one torch device, each against plain torch on the same device.

    torchrun --standalone --nproc-per-node P python3 tests/gpu/device_subset.py --device cuda

P = 1, or P = 2 sharing one GPU (the c10d transport: Gloo). Each check builds
the full tensor on the device, shards it unevenly (odd lengths), runs an op
forward and backward, gathers, and compares values and input gradients with
the single-device computation (float64: rtol 1e-10). Every rank prints nothing
but rank 0's lines; the last line is "device subset: PASSED (n checks on D, P
ranks)" or "device subset: FAILED ...", and the exit code says so. Under
``--device cpu`` (gpu_check.sh --dry-run) the same checks run on the CPU.
"""

import argparse
import sys
import traceback

import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor import Replicate, Shard

RTOL, ATOL = 1e-10, 1e-12


def check(name, fn, inputs, placements, mesh, device):
    """fn(*tensors) -> tensor; inputs: full float64 tensors (seeded, on the device)."""
    ref_in = [t.clone().requires_grad_(True) for t in inputs]
    ref = fn(*ref_in)
    ref.sum().backward() if ref.is_floating_point() else None
    sh_in = [st.distribute_tensor(t, mesh, p, requires_grad=True) for t, p in zip(inputs, placements)]
    out = fn(*sh_in)
    if out.is_floating_point():
        out.sum().backward()
    # A reduction to a scalar may come back as a plain (replicated) tensor.
    sharded = isinstance(out, st.ShardTensor)
    got = out.full_tensor() if sharded else out.detach()
    ok = got.device == ref.device and torch.allclose(got, ref.detach(), rtol=RTOL, atol=ATOL,
                                                     equal_nan=True)
    diff = (got - ref.detach()).abs().nan_to_num(0.0, posinf=0.0)  # matching inf/NaN checked above
    detail = f"max |diff| {diff.max().item():.3g}" if got.numel() else "empty"
    for i, (s, r) in enumerate(zip(sh_in, ref_in)):
        if r.grad is None:
            continue
        g = s.grad.full_tensor() if s.grad is not None else None
        gok = g is not None and g.device == r.grad.device and torch.allclose(
            g, r.grad, rtol=RTOL, atol=ATOL, equal_nan=True)
        ok = ok and gok
        detail += f"; grad {i} {'ok' if gok else 'WRONG'}"
    local_dev = out.to_local().device if sharded else out.device
    ok = ok and local_dev.type == torch.device(device).type
    return ok, f"{name}: {'ok' if ok else 'WRONG'} ({detail}; pieces on {local_dev})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dm = st.DistributedManager
    dm.initialize()
    mgr = dm()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(mgr.local_rank % torch.cuda.device_count())
    # The factories put each rank's piece on the mesh's device (DeviceMesh.device).
    mesh = st.DeviceMesh(device.type, (-1,), ("domain",))
    P = mesh.size(0)
    root = mesh.get_rank() == 0
    torch.manual_seed(0)
    d = dict(dtype=torch.float64, device=device)
    n = 2 * P + 3  # uneven over P ranks
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double().to(device)
    gn = torch.nn.GroupNorm(2, 4).double().to(device)
    lin = torch.nn.Linear(6, 5).double().to(device)
    cases = [
        ("conv2d 3x3 (halo), Shard(2)", lambda x: conv(x), [torch.randn(2, 3, n, 7, **d)], [(Shard(2),)]),
        ("group_norm, Shard(2)", lambda x: gn(x), [torch.randn(2, 4, n, 5, **d)], [(Shard(2),)]),
        ("linear on a sharded sequence, Shard(1)", lambda x: lin(x), [torch.randn(2, n, 6, **d)],
         [(Shard(1),)]),
        ("matmul over a sharded contraction (Partial)", lambda a, b: a @ b,
         [torch.randn(4, n, **d), torch.randn(n, 3, **d)], [(Shard(1),), (Shard(0),)]),
        ("softmax along the sharded dim", lambda x: torch.softmax(x, dim=1),
         [torch.randn(3, n, **d)], [(Shard(1),)]),
        ("attention, sequence sharded (ring)",
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
         [torch.randn(1, 2, n, 4, **d) for _ in range(3)], [(Shard(2),)] * 3),
        ("rfft along the sharded dim", lambda x: torch.fft.rfft(x, dim=1).abs(),
         [torch.randn(2, n, 4, **d)], [(Shard(1),)]),
        ("cumsum along the sharded dim, inf and NaN", lambda x: torch.cumsum(x, dim=0),
         [torch.tensor([1.0, float("inf"), 2.0, float("nan")] + [0.5] * (n - 4), **d)], [(Shard(0),)]),
        ("sum to a replicated scalar", lambda x: (x * x).sum(), [torch.randn(n, 3, **d)], [(Shard(0),)]),
        ("redistribute Shard(0) -> Shard(1) -> Replicate",
         lambda x: x.redistribute(placements=(Shard(1),)).redistribute(placements=(Replicate(),)) * 2
         if isinstance(x, st.ShardTensor) else x * 2, [torch.randn(n, n + 1, **d)], [(Shard(0),)]),
    ]
    failed, lines = 0, []
    for name, fn, inputs, placements in cases:
        try:
            ok, line = check(name, fn, inputs, placements, mesh, args.device)
        except Exception as e:  # every rank reaches here alike (clear errors on every rank)
            ok, line = False, f"{name}: RAISED {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            if root and "--trace" in sys.argv:
                traceback.print_exc()
        failed += 0 if ok else 1
        lines.append(line)
    # memory_stats counts device memory as torch's CUDA allocator does.
    mem = st.memory_stats()
    if device.type == "cuda":
        want = (f"cuda:{torch.cuda.current_device()}", torch.cuda.memory_allocated(),
                torch.cuda.max_memory_allocated())
        got = (mem["device"], mem["device_current_bytes"], mem["device_peak_bytes"])
        ok = got == want and want[2] > 0
        lines.append(f"memory_stats on {want[0]}: {'OK' if ok else f'WRONG: {got} != {want}'}")
        failed += 0 if ok else 1
    stats = st.comm_stats()
    if root:
        for line in lines:
            print(line, flush=True)
        print(f"comm_stats: {stats['bytes_sent']} bytes sent, {stats['messages']} messages, "
              f"{stats['staged_bytes']} bytes staged through the host", flush=True)
        verdict = "PASSED" if failed == 0 else f"FAILED ({failed} of {len(lines)} wrong or raised)"
        print(f"device subset: {verdict} ({len(lines)} checks on {args.device}, {P} ranks)", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
