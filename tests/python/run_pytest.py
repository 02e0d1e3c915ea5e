"""Runs the Python tests on every rank under mpirun (registered with CTest as python.npN).

    PYTHONPATH=build/python mpirun -np 4 python3 tests/python/run_pytest.py [pytest args]

Every rank runs the same pytest session (same tests, same order). A failure on
any rank prints that rank's report and ends the whole job with MPI_Abort
(shardtensor.abort): the other ranks may be waiting in a collective of the
failed test, so continuing could hang. At the end the ranks agree on one
verdict (pytest's exit code 5, "no tests collected", counts as a pass only if
the file list really has no test for this configuration).
"""

import os
import sys

import pytest
import torch

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))


class AbortOnFailure:
    def __init__(self, rank):
        self.rank = rank

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if report.failed:
            sys.stderr.write(f"\n[rank {self.rank}] FAILED {report.nodeid} ({report.when})\n"
                             f"{report.longreprtext}\n")
            st.abort(1)

    def pytest_internalerror(self, excrepr):
        sys.stderr.write(f"\n[rank {self.rank}] pytest internal error\n{excrepr}\n")
        st.abort(3)


def main():
    st.DistributedManager.initialize()
    rank, size = st.world_rank(), st.world_size()
    torch.set_num_threads(1)
    args = [HERE, "-p", "no:cacheprovider", "-q"] + sys.argv[1:]
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
        args += ["-qq"]
    rc = int(pytest.main(args, plugins=[AbortOnFailure(rank)]))
    if rc == pytest.ExitCode.NO_TESTS_COLLECTED:
        rc = 0
    # One verdict for the job: the worst exit code over the ranks.
    mesh = st.DeviceMesh((-1,))
    codes = st.ShardTensor.from_local(torch.tensor([float(rc)]), mesh, (st.Shard(0),)).full_tensor()
    rc = int(codes.max().item())
    if rank == 0:
        sys.__stdout__.write(f"python tests on {size} rank(s): {'PASSED' if rc == 0 else 'FAILED'}\n")
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
