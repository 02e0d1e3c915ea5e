"""CTest driver for the MPI lifecycle from Python (runs mpirun itself, checks the outcome).

    lifecycle_check.py MPIEXEC PYTHON NP [mpiexec flags...]

1. mpi4py first (scripts/mpi4py_first.py): exits 0, prints OK, and mpirun reports
   nothing about processes exiting without finalize.
2. An uncaught exception on one rank (scripts/uncaught_exception.py) while the
   others wait in a collective: the job ends promptly (well under the timeout) with
   a non-zero code, and that rank's traceback is printed.
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, timeout):
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, time.monotonic() - t0


def main():
    mpiexec, python, np = sys.argv[1], sys.argv[2], sys.argv[3]
    flags = sys.argv[4:]
    base = [mpiexec] + flags + ["-np", np, python]
    failures = []

    rc, out, dt = run(base + [os.path.join(HERE, "scripts", "mpi4py_first.py")], 120)
    print(f"--- mpi4py_first: rc {rc}, {dt:.1f}s\n{out}")
    if rc != 0 or "mpi4py_first: OK" not in out:
        failures.append("mpi4py_first did not succeed")
    if "without calling" in out or "finalize" in out.lower():
        failures.append("mpirun reported a finalize problem on a normal exit")

    rc, out, dt = run(base + [os.path.join(HERE, "scripts", "uncaught_exception.py")], 120)
    print(f"--- uncaught_exception: rc {rc}, {dt:.1f}s\n{out}")
    if rc == 0:
        failures.append("the job exited 0 despite an uncaught exception")
    if "Traceback" not in out or "deliberate failure on the last rank" not in out:
        failures.append("the failing rank's traceback was not printed")
    if "unreachable" in out:
        failures.append("a collective completed without the failed rank")

    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
