"""Starts a program the way `torchrun --nproc-per-node N` does (issue 24):
N plain processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set and no MPI launcher variables, and checks that
every process ends non-zero, promptly, with shardtensor's error naming the
launcher and both sizes (Note [launcher detection]).

usage: launch_check.py N program [args...]
"""

import os
import subprocess
import sys
import time

LIMIT_S = 60


def main():
    n = int(sys.argv[1])
    cmd = sys.argv[2:]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "MPI_LOCAL"))}
    base.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29531")
    start = time.monotonic()
    procs = []
    for r in range(n):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    want = f"torchrun's WORLD_SIZE={n} says {n} processes, but MPI_COMM_WORLD has 1"
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
        if p.returncode == 0 or want not in out or "c10d transport" not in out:
            print(f"process {r}: exit code {p.returncode}, output lacks or has wrong error:\n{out}")
            ok = False
        else:
            print(f"process {r}: exit code {p.returncode}: "
                  + next(line for line in out.splitlines() if want in line).strip())
    print(f"{n} processes ended in {time.monotonic() - start:.1f} s")
    print("launch check: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
