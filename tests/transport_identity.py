"""Runs tests/transport_identity.cpp twice at N ranks: under the MPI launcher (MPI transport)
and the torchrun way (torch.distributed.run: c10d / Gloo), and compares the digests rank 0
prints ("digest <name> <hex>"). Prints "transport identity: PASSED" when every result has
the same bits under both, else names the results that differ.

With --staged, both runs stage every transport buffer through a host copy
(SHARDTENSOR_STAGE_HOST=1, Note [host staging]) and a third, unstaged MPI run
is the reference: all three must agree, the staged runs must report staged
bytes and the unstaged one none.

    python3 transport_identity.py [--staged] N <program> <mpiexec> [mpiexec flags...]
"""
import os
import re
import subprocess
import sys


def digests(cmd, what, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        print(out)
        sys.exit(f"transport identity: FAILED: the {what} run exited with {r.returncode}")
    found = dict(re.findall(r"^digest (\S+) ([0-9a-f]{16})$", r.stdout, re.M))
    transport = re.search(r"^transport identity: (\S+)$", r.stdout, re.M)
    if not found or not transport:
        print(out)
        sys.exit(f"transport identity: FAILED: the {what} run printed no digests")
    staged = re.search(r"^staged bytes: (\d+)$", r.stdout, re.M)
    if not staged:
        print(out)
        sys.exit(f"transport identity: FAILED: the {what} run printed no staged bytes")
    return found, transport.group(1), int(staged.group(1))


def main():
    args = sys.argv[1:]
    staged = args[0] == "--staged"
    if staged:
        args = args[1:]
    n, prog, mpiexec, flags = args[0], args[1], args[2], args[3:]
    env = dict(os.environ)
    if staged:
        env["SHARDTENSOR_STAGE_HOST"] = "1"
    else:
        env.pop("SHARDTENSOR_STAGE_HOST", None)
    mpi, t_mpi, s_mpi = digests([mpiexec, *flags, "-np", n, prog], "mpirun", env)
    c10d, t_c10d, s_c10d = digests([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--no-python", "--nproc-per-node", n, prog], "torchrun", env)
    print(f"transports: {t_mpi} (mpirun) vs {t_c10d} (torchrun); {len(mpi)} results; "
          f"staged bytes on rank 0: {s_mpi} (mpirun), {s_c10d} (torchrun)")
    if t_mpi == t_c10d:
        sys.exit("transport identity: FAILED: both runs used the same transport")
    runs = {"mpi": mpi, "c10d": c10d}
    bad = []
    if staged:
        plain_env = dict(os.environ)
        plain_env.pop("SHARDTENSOR_STAGE_HOST", None)
        runs["mpi unstaged"], _, s_plain = digests([mpiexec, *flags, "-np", n, prog],
                                                   "unstaged mpirun", plain_env)
        if s_mpi <= 0 or s_c10d <= 0:
            bad.append("a staged run staged nothing")
        if s_plain != 0:
            bad.append(f"the unstaged run staged {s_plain} bytes")
    elif s_mpi != 0 or s_c10d != 0:
        bad.append("an unstaged run staged bytes")
    keys = sorted(set().union(*runs.values()))
    differ = [k for k in keys if len({r.get(k) for r in runs.values()}) != 1]
    for k in differ:
        print(f"  differs: {k}: " + ", ".join(f"{w} {r.get(k)}" for w, r in runs.items()))
    for b in bad:
        print(f"  {b}")
    ok = not differ and not bad
    print("transport identity: " + ("PASSED" if ok else f"FAILED ({len(differ)} differ)"))


if __name__ == "__main__":
    main()
