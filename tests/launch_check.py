"""Launches a program the torchrun way (issue 24) and checks that it runs as
one job of N processes over the c10d transport (Note [c10d handles]).

usage:
  launch_check.py N --plain program [args...]
      N plain processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
      MASTER_ADDR, MASTER_PORT set and no MPI launcher variables (what torchrun
      gives its workers, without torchrun's agent). Every process must exit 0
      within the limit and print "rank r of N" for its own r (the C++
      `test_launch --init` prints that after shardtensor::init).
  launch_check.py N --torchrun MPIEXEC [MPIEXEC_FLAGS...] -- program [args...]
      `python -m torch.distributed.run --standalone --no-python --nproc-per-node N program`
      and `MPIEXEC FLAGS -np N program`: both must exit 0 and print exactly the
      same standard output (only rank 0 prints in the examples).
"""

import os
import re
import socket
import subprocess
import sys
import time

LIMIT_S = 240


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "MPI_LOCAL"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "SHARDTENSOR_BACKEND")}


def plain(n, cmd):
    base = clean_env()
    base.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    ok = True
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            print(f"process {r}: still running after {LIMIT_S} s (a hang):\n{out}")
            ok = False
            continue
        want = f"rank {r} of {n}"
        if p.returncode != 0 or want not in out:
            print(f"process {r}: exit code {p.returncode}, output lacks '{want}':\n{out}")
            ok = False
        else:
            print(f"process {r}: exit code 0: "
                  + next(line for line in out.splitlines() if want in line).strip())
    print(f"{n} processes ended in {time.monotonic() - start:.1f} s")
    return ok


def run(cmd, env):
    start = time.monotonic()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=LIMIT_S)
    print(f"$ {' '.join(cmd)}\n  exit code {p.returncode} in {time.monotonic() - start:.1f} s")
    if p.returncode != 0:
        print(p.stdout + p.stderr)
    return p.returncode, p.stdout


def torchrun(n, mpiexec, prog):
    env = clean_env()
    rc_t, out_t = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--no-python", "--nproc-per-node", str(n)] + prog, env)
    rc_m, out_m = run(mpiexec + ["-np", str(n)] + prog, env)
    ok = rc_t == 0 and rc_m == 0
    # The examples print wall times; compare everything else exactly.
    norm = [re.sub(r"\d+\.\d+ s\b", "<t> s", o) for o in (out_t, out_m)]
    if norm[0] != norm[1]:
        print("standard output differs:\n--- torchrun\n" + out_t + "--- mpirun\n" + out_m)
        ok = False
    else:
        print(f"identical standard output ({len(out_t.splitlines())} lines):\n{out_t}")
    return ok


def main():
    n = int(sys.argv[1])
    mode = sys.argv[2]
    if mode == "--plain":
        ok = plain(n, sys.argv[3:])
    elif mode == "--torchrun":
        rest = sys.argv[3:]
        cut = rest.index("--")
        ok = torchrun(n, rest[:cut], rest[cut + 1:])
    else:
        raise SystemExit(__doc__)
    print("launch check: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
