"""Runs tests/transport_identity.cpp twice at N ranks: under the MPI launcher (MPI transport)
and the torchrun way (torch.distributed.run: c10d / Gloo), and compares the digests rank 0
prints ("digest <name> <hex>"). Prints "transport identity: PASSED" when every result has
the same bits under both, else names the results that differ.

    python3 transport_identity.py N <program> <mpiexec> [mpiexec flags...]
"""
import re
import subprocess
import sys


def digests(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        print(out)
        sys.exit(f"transport identity: FAILED: the {what} run exited with {r.returncode}")
    found = dict(re.findall(r"^digest (\S+) ([0-9a-f]{16})$", r.stdout, re.M))
    transport = re.search(r"^transport identity: (\S+)$", r.stdout, re.M)
    if not found or not transport:
        print(out)
        sys.exit(f"transport identity: FAILED: the {what} run printed no digests")
    return found, transport.group(1)


def main():
    n, prog, mpiexec, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    mpi, t_mpi = digests([mpiexec, *flags, "-np", n, prog], "mpirun")
    c10d, t_c10d = digests([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--no-python", "--nproc-per-node", n, prog], "torchrun")
    print(f"transports: {t_mpi} (mpirun) vs {t_c10d} (torchrun); {len(mpi)} results")
    if t_mpi == t_c10d:
        sys.exit("transport identity: FAILED: both runs used the same transport")
    differ = sorted(k for k in set(mpi) | set(c10d) if mpi.get(k) != c10d.get(k))
    for k in differ:
        print(f"  differs: {k}: mpi {mpi.get(k)} c10d {c10d.get(k)}")
    print("transport identity: " + ("PASSED" if not differ else f"FAILED ({len(differ)} differ)"))


if __name__ == "__main__":
    main()
