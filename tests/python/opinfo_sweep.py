"""PyTorch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db)
run through shardtensor under mpirun (issue 25, part C).

    PYTHONPATH=build/python SHARDTENSOR_TIMEOUT=60 \\
      mpirun -np 2 .venv/bin/python tests/python/opinfo_sweep.py [--full] [--ops REGEX]

For every op in op_db, for dtype float64 and (where the op supports them) one
integer and one complex dtype, the sample inputs are generated from a fixed seed
(the same on every rank). The default run takes the first K samples per op and
dtype, preferring those whose first tensor has an odd extent (so the split is
uneven); --full takes every sample. The first tensor argument (`sample.input`,
or the first tensor of a list input) is distributed Replicate and then Shard(d)
for each of its dims d in turn (balanced-block: odd extents give uneven pieces,
extents below the rank count empty ones at the last coordinates); every other
argument stays a plain tensor. Each run is compared with plain torch on the full
tensors: every output (exact for integer and bool results, rtol=atol=1e-9 for
float64 and complex128, torch.testing's per-dtype tolerances for lower precisions
(integer inputs promoted to float32, whose vectorized and scalar paths round
differently on pieces of other lengths), NaN equal to NaN) and, for float64 samples of differentiable ops,
the first tensor's gradient under a fixed random weighting of every floating
output. Both runs start from the same seed; an op whose plain result changes with
the seed (a random op: shardtensor draws per piece, not as one process would)
is compared on shapes and dtypes only, and its gradient is not compared. So are
the ops whose values are uninitialised memory (UNINITIALIZED: empty_like and its
kin): plain torch can return the same garbage three times in a row (the
allocator hands back the same freed block), so the seed test cannot tell them,
and comparing their values made opinfo.np3 fail by chance (CI, 2026-11-29).

Outcomes per (op, dtype, sample, placement): OK; REFUSED (an exception on every
rank); WRONG (a value or gradient differs on some rank); MIXED (an exception on
some ranks only); SKIP (plain torch itself raises on the sample, or the sample
has no tensor to shard). The ranks agree on each outcome through one all-gather
of per-rank codes (shardtensor's own collective). The run fails on any WRONG or
MIXED, and on any REFUSED op that tests/python/opinfo_expected.py does not list;
listed ops that now pass on every sample are reported as stale (not a failure:
the list is then to be trimmed). Every collective of the library runs under
SHARDTENSOR_TIMEOUT, so a stuck sample ends the run with an error naming it.
"""

import argparse
import math
import os
import re
import sys
import time
import warnings

import torch

import shardtensor as st
from shardtensor import Replicate, Shard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from opinfo_expected import EXPECTED, KNOWN_BUGS  # noqa: E402

OK, REFUSED, WRONG, SKIP = 0, 1, 2, 3
NAMES = {OK: "OK", REFUSED: "REFUSED", WRONG: "WRONG", SKIP: "SKIP", -1: "MIXED"}
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool)
COMPLEX_DTYPES = (torch.complex128, torch.complex64)


def op_key(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def pick_dtypes(op):
    supported = op.supported_dtypes("cpu")
    out = []
    if torch.float64 in supported:
        out.append(torch.float64)
    for group in (INT_DTYPES, COMPLEX_DTYPES):
        for dt in group:
            if dt in supported:
                out.append(dt)
                break
    return out


def first_tensor(sample):
    x = sample.input
    if isinstance(x, torch.Tensor):
        return x, None
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return x[0], 0
    return None, None


def has_odd(t):
    return any(n % 2 == 1 and n > 1 for n in t.shape)


def choose(samples, k, full):
    usable = [s for s in samples if first_tensor(s)[0] is not None]
    if full:
        return usable
    odd = [s for s in usable if has_odd(first_tensor(s)[0])]
    rest = [s for s in usable if not has_odd(first_tensor(s)[0])]
    return (odd + rest)[:k]


def tree_tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in tree_tensors(e)]
    if isinstance(x, dict):
        return [t for e in x.values() for t in tree_tensors(e)]
    return []


def gather(t):
    return t.full_tensor() if isinstance(t, st.ShardTensor) else t


def detached_clone(x, req):
    c = x.detach().clone()
    return c.requires_grad_(req) if req else c


def make_call(op, sample, x, pos):
    inp = sample.input
    if pos is None:
        inp = x
    else:
        inp = list(inp)
        inp[pos] = x
        inp = type(sample.input)(inp) if isinstance(sample.input, tuple) else inp
    return lambda: op(inp, *sample.args, **sample.kwargs)


def close(a, b):
    """Whether the gathered result `a` matches plain torch's `b` (exact for integers)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    if not (a.is_floating_point() or a.is_complex()):
        return (torch.equal(a, b), "integer values differ")
    try:
        if a.dtype in (torch.float64, torch.complex128):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, equal_nan=True)
        else:  # float32 etc. (an integer input promoted): torch's own tolerances per dtype
            torch.testing.assert_close(a, b, equal_nan=True)
        return True, ""
    except AssertionError as e:
        return False, str(e).splitlines()[0] + " " + " ".join(str(e).splitlines()[1:4])


def weights(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) if o.is_floating_point() else None
            for o in outs]


# Ops whose index results torch leaves unspecified among equal values (an unstable
# selection or sort): an index result that differs from plain torch's is accepted
# where the values matched exactly and it points at an equal value of the input.
TIES = {"kthvalue", "topk", "sort", "argsort", "mode", "median", "nanmedian", "msort"}


def same_values_at(x, idx, ref_idx):
    """Whether, along some dim of x, both index tensors pick equal values."""
    if idx.shape != ref_idx.shape or idx.dtype != torch.int64:
        return False
    for d in range(x.dim()):
        try:
            i, r = (idx, ref_idx) if idx.dim() == x.dim() else (idx.unsqueeze(d), ref_idx.unsqueeze(d))
            if torch.equal(torch.take_along_dim(x, i, d), torch.take_along_dim(x, r, d)):
                return True
        except (RuntimeError, IndexError):
            continue
    return False


# Ops whose result values are undefined (torch.empty's memory): only their shapes
# and dtypes mean anything.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted"}


def seeded(op):
    """Whether OpInfo wraps the op in wrapper_set_seed (a random op that reseeds inside)."""
    from torch.testing._utils import wrapper_set_seed
    code = getattr(op.op, "__code__", None)
    return op.gradcheck_wrapper is wrapper_set_seed or bool(code and "wrapper_set_seed" in code.co_names)


def is_random(op, sample, x0, pos, ref_outs):
    """Whether the op is random: OpInfo wraps it in wrapper_set_seed (it reseeds inside,
    so plain torch looks deterministic), or plain torch gives another result under
    other seeds."""
    if seeded(op):
        return True
    for seed in (4321, 99, 2024):
        torch.manual_seed(seed)
        try:
            again = tree_tensors(make_call(op, sample, x0.detach().clone(), pos)())
        except Exception:  # noqa: BLE001
            return False
        if any(not close(a.detach(), b.detach())[0] for a, b in zip(again, ref_outs)):
            return True
    return False


def run_one(op, sample, pl, mesh, grad):
    """One (sample, placement) on this rank: (code, message)."""
    x0, pos = first_tensor(sample)
    req = grad and x0.is_floating_point()
    # Plain torch on the full tensors (the reference); raising there means SKIP.
    xr = detached_clone(x0, req)
    try:
        torch.manual_seed(1234)
        ref = make_call(op, sample, xr, pos)()
        ref_outs = tree_tensors(ref)
        ws = weights(ref_outs, 7)
        ref_grad = None
        if req:
            terms = [(o * w).sum() for o, w in zip(ref_outs, ws) if w is not None and o.requires_grad]
            if terms:
                sum(terms).backward()
                ref_grad = xr.grad
    except Exception as e:  # noqa: BLE001
        return SKIP, "reference raised: " + str(e).splitlines()[0][:200]
    try:
        sx = st.distribute_tensor(x0.detach().clone(), mesh, pl, requires_grad=req)
        torch.manual_seed(1234)
        out = make_call(op, sample, sx, pos)()
        outs = tree_tensors(out)
        if len(outs) != len(ref_outs):
            return WRONG, f"{len(outs)} outputs vs {len(ref_outs)}"
        full = [gather(o) for o in outs]
        random = True if seeded(op) or op.name in UNINITIALIZED else None
        for i, (a, b) in enumerate(zip(full, ref_outs)):
            ok, why = close(a.detach(), b.detach())
            if not ok:
                if random is None:
                    random = is_random(op, sample, x0, pos, ref_outs)
                if random and a.shape == b.shape and a.dtype == b.dtype:
                    continue  # a random op: shapes and dtypes only (Note in the docstring)
                if i > 0 and op.name in TIES and close(full[0].detach(), ref_outs[0].detach())[0] \
                        and same_values_at(x0.detach(), a, b):
                    continue  # another index of an equal value (ties: see TIES)
                return WRONG, f"output {i}: {why}"
        if ref_grad is not None and not random:
            terms = [(f * w).sum() for f, w, o in zip(full, ws, ref_outs)
                     if w is not None and o.requires_grad and f.requires_grad]
            if len(terms) != sum(1 for w, o in zip(ws, ref_outs) if w is not None and o.requires_grad):
                return WRONG, "an output lost its gradient connection"
            sum(terms).backward()
            g = sx.grad
            if g is None:
                return WRONG, "no input gradient"
            ok, why = close(gather(g), ref_grad)
            if not ok:
                return WRONG, f"input grad: {why}"
        return OK, ""
    except Exception as e:  # noqa: BLE001
        return REFUSED, f"{type(e).__name__}: " + " ".join(str(e).split())[:300]


def agree(mesh, code):
    codes = st.ShardTensor.from_local(torch.tensor([float(code)]), mesh, (Shard(0),)).full_tensor()
    codes = [int(c) for c in codes.tolist()]
    if len(set(codes)) == 1:
        return codes[0], codes
    if WRONG in codes:
        return WRONG, codes
    if REFUSED in codes:
        return -1, codes  # raised on some ranks only
    return WRONG, codes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="every sample of every op")
    ap.add_argument("--k", type=int, default=1, help="samples per op and dtype (default run)")
    ap.add_argument("--ops", default="", help="regex on the op name (op.variant)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--run-known-bugs", action="store_true",
                    help="also run the (op, dtype) pairs of KNOWN_BUGS (they end the job)")
    ap.add_argument("--trace", action="store_true", help="every rank names each run on stderr")
    ap.add_argument("--start", default="", help="skip ops before the first matching this regex")
    a = ap.parse_args()

    st.DistributedManager.initialize()
    rank, size = st.world_rank(), st.world_size()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    mesh = st.DeviceMesh((-1,), ("domain",))
    say = print if rank == 0 else (lambda *x, **k: None)
    t0 = time.time()
    tally = {c: 0 for c in NAMES}
    refused_ops, passing_ops, failures, not_run, wrong_ops = {}, set(), [], set(), set()
    for op in op_db:
        key = op_key(op)
        if a.start and re.search(a.start, key):
            a.start = ""
        if a.start or (a.ops and not re.search(a.ops, key)):
            continue
        any_run = False
        for dt in pick_dtypes(op):
            torch.manual_seed(0)
            grad = dt == torch.float64 and op.supports_autograd
            try:
                samples = list(op.sample_inputs("cpu", dt, requires_grad=grad))
            except Exception:  # noqa: BLE001
                continue
            for si, sample in enumerate(choose(samples, a.k, a.full)):
                x0, _ = first_tensor(sample)
                pls = [(Replicate(),)] + [(Shard(d),) for d in range(x0.dim())]
                for pl in pls:
                    if a.trace:
                        sys.stderr.write(f"[rank {rank}] {key} {dt} sample {si} {pl[0]}\n")
                        sys.stderr.flush()
                    if (key, str(dt)) in KNOWN_BUGS and not a.run_known_bugs:
                        not_run.add((key, str(dt)))
                        continue
                    code, msg = run_one(op, sample, pl, mesh, grad)
                    try:
                        verdict, codes = agree(mesh, code)
                    except RuntimeError as e:
                        # A rank raised inside a collective the others were in: the
                        # library's carried error (every later call raises; the job
                        # must end). Reported as MIXED, and the sweep stops here.
                        say(f"MIXED {key} {dt} sample {si} shape {tuple(x0.shape)} {pl[0]}: this rank"
                            f" {NAMES[code]} {msg}; then: {' '.join(str(e).split())[:400]}", flush=True)
                        sys.stderr.write(f"[rank {rank}] MIXED {key} {dt} {pl[0]}: {NAMES[code]} {msg}\n")
                        say("opinfo sweep: FAILED (stopped at a mixed outcome)", flush=True)
                        return 1
                    tally[verdict] += 1
                    where = f"{key} {dt} sample {si} shape {tuple(x0.shape)} {pl[0]}"
                    if a.verbose or verdict in (WRONG, -1):
                        say(f"  {NAMES[verdict]:8} {where} {msg} (ranks: {codes})", flush=True)
                    if verdict in (WRONG, -1):
                        wrong_ops.add(key)
                        failures.append(f"{NAMES[verdict]} {where}: {msg} (per-rank codes {codes})")
                    elif verdict == REFUSED:
                        refused_ops.setdefault(key, f"{where}: {msg}")
                    if verdict != SKIP:
                        any_run = True
        if any_run and key not in refused_ops and key not in wrong_ops:
            passing_ops.add(key)
    unlisted = {k: v for k, v in refused_ops.items() if k not in EXPECTED}
    stale = sorted(k for k in EXPECTED if k in passing_ops)
    say(f"\nopinfo sweep at {size} rank(s), {'full' if a.full else f'first {a.k} sample(s)'}"
        f" per op and dtype, {time.time() - t0:.0f} s: "
        + ", ".join(f"{NAMES[c]} {n}" for c, n in tally.items()))
    say(f"ops: {len(passing_ops)} pass on every sample, {len(wrong_ops)} wrong on some,"
        f" {len(refused_ops)} refuse some"
        f" ({len(refused_ops) - len(unlisted)} listed in opinfo_expected.py)")
    for k in sorted(not_run):
        say(f"KNOWN BUG, not run: {k[0]} {k[1]}: {KNOWN_BUGS[k]}")
    for k in stale:
        say(f"STALE expected entry (now passes): {k} [{EXPECTED[k][0]}: {EXPECTED[k][1]}]")
    for k, v in sorted(unlisted.items()):
        say(f"UNLISTED refusal: {k}: {v}")
    for f in failures:
        say(f"FAIL {f}")
    ok = not failures and not unlisted
    say(f"opinfo sweep: {'PASSED' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
