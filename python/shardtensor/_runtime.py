"""MPI lifecycle from Python (Note [python MPI lifecycle]).

Importing shardtensor initializes nothing. The first call that needs MPI
(creating a DeviceMesh, DistributedManager.initialize(), world_rank()) calls
``ensure_init()``: shardtensor._C.init() initializes MPI, or adopts the MPI that
mpi4py (or another library) already initialized. An atexit handler finalizes
MPI only if shardtensor started it, so mpirun sees a clean exit.

An uncaught exception on one rank: ``sys.excepthook`` prints that rank's
traceback as usual, then ends the whole job with MPI_Abort (shardtensor._C.abort)
when more than one rank runs. Otherwise the other ranks could wait forever in a
collective, and the atexit MPI_Finalize of the failing rank would wait for them.
"""

import atexit
import os
import sys
import threading

from . import _C

_lock = threading.Lock()
_started = False


def _group_to_adopt(process_group):
    """Note [adopted process group]: the c10d group shardtensor runs on, or None for
    its own start (MPI, or its own Gloo rendezvous). An explicit ``process_group``
    wins; else torch.distributed's default group when it is initialized, unless
    SHARDTENSOR_BACKEND asks for mpi."""
    if process_group is not None:
        return process_group
    if os.environ.get("SHARDTENSOR_BACKEND", "").strip() == "mpi":
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def ensure_init(process_group=None):
    """Collective on first call: over every process of the job (MPI_COMM_WORLD, or
    the launch's c10d world), or over ``process_group`` / torch.distributed's
    initialized default group, which shardtensor then adopts (Note [adopted process
    group]). Idempotent: a later call with another group raises."""
    global _started
    if _started:
        if process_group is not None:
            _C.init_with_group(process_group.boxed())  # raises unless it is the same group
        return
    with _lock:
        if _started:
            return
        group = _group_to_adopt(process_group)
        if group is not None:
            _C.init_with_group(group.boxed())
        else:
            _C.init()
        atexit.register(_finalize_at_exit)
        # Note [launcher detection]: init() exported torch's RANK, WORLD_SIZE, ... where
        # unset (C environ); os.environ is Python's copy, which torch.distributed reads.
        for name, value in _C.exported_launch_env().items():
            os.environ.setdefault(name, value)
        _started = True


def detect_launch(env=None):
    """Local. Which launcher started this process (Note [launcher detection]): a dict
    with launcher ("torchrun", "slurm", "openmpi", "pmi" or "none"), rank, world_size,
    local_rank and local_world_size (-1 when not given), mpi_launcher. ``env``: a dict
    of variables, default this process's environment. Raises RuntimeError naming the
    variable on a malformed value."""
    return _C.detect_launch(None if env is None else {str(k): str(v) for k, v in env.items()})


def _finalize_at_exit():
    try:
        _C.finalize()
    except Exception as e:  # never turn a clean exit into a traceback
        print(f"shardtensor: finalize failed: {e}", file=sys.stderr)


def world_rank():
    ensure_init()
    return _C.world_rank()


def world_size():
    ensure_init()
    return _C.world_size()


def _mpi_is_up():
    if _C.is_initialized():
        return True
    mpi4py = sys.modules.get("mpi4py.MPI")
    return mpi4py is not None and mpi4py.Is_initialized() and not mpi4py.Is_finalized()


def abort(code=1):
    """Ends the whole job now (every rank). Not collective; never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _C.is_initialized():
        _C.abort(code)
    mpi4py = sys.modules.get("mpi4py.MPI")
    if mpi4py is not None and mpi4py.Is_initialized() and not mpi4py.Is_finalized():
        mpi4py.COMM_WORLD.Abort(code)
    os._exit(code)


_previous_excepthook = sys.excepthook


def _excepthook(exc_type, exc, tb):
    rank = None
    size = 1
    try:
        if _mpi_is_up():
            rank, size = _C.world_rank(), _C.world_size()
    except Exception:
        pass
    if rank is not None and size > 1:
        print(f"shardtensor: uncaught exception on rank {rank} of {size}; aborting the job",
              file=sys.stderr)
    _previous_excepthook(exc_type, exc, tb)
    if size > 1:
        abort(1)


def install_excepthook():
    if sys.excepthook is _previous_excepthook:
        sys.excepthook = _excepthook
