"""shardtensor: domain parallelism for PyTorch, over the same C++ core as the C++ API.

    import shardtensor as st
    from shardtensor import ShardTensor, Shard, Replicate, Partial, DeviceMesh
    mesh = DeviceMesh((-1,), ("domain",))
    sx = st.scatter_tensor(x, 0, mesh, (Shard(2),), requires_grad=True)
    out = torch.nn.Conv2d(8, 8, 3, padding=1)(sx)      # any torch.nn module / torch op

Launch: ``mpirun -np 4 python3 app.py``. Importing initializes nothing; MPI is
started (or mpi4py's adopted) by the first call that needs it. See docs/python.md.
"""

import torch  # noqa: F401  (first: loads libtorch_python, which _C links against)

# Note [torch version check]: _C and libshardtensor are compiled against one torch's C++
# libraries, whose ABI changes between releases; under another torch, loading _C can fail
# on undefined symbols or crash later. So compare with the torch recorded at build time
# (_build_info.py, plain Python written by CMake) before _C is loaded. The local label
# (+cpu, +cu130) is not compared: the builds of one release share the C++ ABI.
from ._build_info import torch_version as _built_torch_version  # noqa: E402

if torch.__version__.split("+")[0] != _built_torch_version.split("+")[0]:
    raise ImportError(
        f"shardtensor was built against torch {_built_torch_version}, but torch {torch.__version__} "
        f"is installed ({torch.__file__}); rebuild shardtensor against this torch with "
        "`pip install --no-build-isolation .` in the shardtensor source tree (docs/python.md)")

from . import _C, _runtime
from . import io  # noqa: F401  (shardtensor.io: HDF5 and checkpoints)
from ._irregular import (GhostPlan, RebalancedGraph, balanced_sizes_by_cost, extend_rows, gather_rows,
                         ghost_accumulate, ghost_accumulate_nograd, ghost_exchange, ghost_plan, knn,
                         neighborhood_attention, node_tensor, radius_search, rebalance, rebalance_graph,
                         rows_like, scatter_rows)
from ._manager import DistributedManager
from ._mesh import DeviceMesh, init_device_mesh
from ._nn import (backward, clip_grad_norm_, distribute_module, full_state_dict, fully_shard, grad,
                  halo_exchange, halo_exchange_begin, halo_exchange_end, load_full_state_dict,
                  scaled_dot_product_attention, unflatten_shard)
from ._tensor import ShardTensor, distribute_tensor, scatter_tensor
from .placement import Partial, Placement, Replicate, Shard

__version__ = "0.1.0"

__all__ = [
    "ShardTensor", "Shard", "Replicate", "Partial", "Placement", "DeviceMesh", "init_device_mesh",
    "scatter_tensor", "distribute_tensor", "distribute_module", "fully_shard", "full_state_dict",
    "load_full_state_dict", "clip_grad_norm_", "unflatten_shard", "backward", "grad",
    "scaled_dot_product_attention", "halo_exchange", "halo_exchange_begin", "halo_exchange_end",
    "DistributedManager", "comm_stats", "reset_comm_stats",
    "memory_stats", "reset_peak_memory_stats", "io", "set_timeout", "timeout", "set_strict",
    "strict", "init", "world_rank", "world_size", "abort", "mpi_cuda_support",
    # irregular data (docs/irregular.md)
    "knn", "radius_search", "neighborhood_attention", "GhostPlan", "ghost_plan", "ghost_exchange",
    "ghost_accumulate", "ghost_accumulate_nograd", "extend_rows", "gather_rows", "scatter_rows",
    "node_tensor", "rows_like", "balanced_sizes_by_cost", "rebalance", "rebalance_graph",
    "RebalancedGraph",
]

world_rank = _runtime.world_rank


def init(process_group=None):
    """Collective. Starts shardtensor now instead of at the first call that needs it.
    ``process_group``: a torch.distributed process group (the default group, or one from
    ``torch.distributed.new_group``) that shardtensor then runs on, its ranks becoming
    shardtensor's world (shardtensor's traffic runs on its own Gloo group over the same
    members, made through the group's store). Without one, shardtensor adopts
    torch.distributed's default group if it is initialized, else starts MPI (mpirun,
    srun) or its own Gloo group (torchrun). Note [adopted process group]. Idempotent;
    raises if shardtensor already runs on another group."""
    _runtime.ensure_init(process_group)


world_size = _runtime.world_size
abort = _runtime.abort


def mpi_cuda_support():
    """Whether the MPI library reads and writes CUDA memory itself, so that the MPI
    transport hands CUDA pieces to it without host copies: dict with aware (bool) and
    reason (how that was decided: SHARDTENSOR_MPI_CUDA_AWARE=0/1, or Open MPI's
    MPIX_CUDA_AWARE_SUPPORT and MPIX_Query_cuda_support()). Local. Note [CUDA-aware MPI]."""
    return _C.mpi_cuda_support()


def comm_stats():
    """This rank's communication counters since the last reset: dict with
    bytes_sent, bytes_received, messages, comm_seconds, gathered_bytes (bytes
    replicated beyond this rank's piece by a rule or the generic fallback),
    staged_bytes (bytes copied between a device and host memory around
    transport calls; 0 for CPU pieces). Local."""
    return _C.comm_stats()


def reset_comm_stats():
    """Local."""
    _C.reset_comm_stats()


def memory_stats():
    """This process's live tensor memory. Local.

    A dict: current_bytes and peak_bytes (CPU tensors), and device,
    device_current_bytes and device_peak_bytes (torch's CUDA caching allocator
    on the current CUDA device, what torch.cuda.memory_allocated() reports;
    device is "" and both counts 0 while CUDA is not in use)."""
    return _C.memory_stats()


def reset_peak_memory_stats():
    """Local."""
    _C.reset_peak_memory_stats()


def set_timeout(seconds):
    """Sets the collective watchdog's timeout in seconds for every later wait of
    this process (0 disables it; default: SHARDTENSOR_TIMEOUT, else 600). On
    expiry the rank prints the op, the MPI call and the peers it waits for, and
    the job ends with exit code 85. Set the same value on every rank. Local.
    Raises ValueError/RuntimeError for a negative or non-finite value.
    C++: shardtensor::set_timeout (docs/reliability.md)."""
    _C.set_timeout(float(seconds))


def timeout():
    """The watchdog timeout in seconds (0: disabled). Local."""
    return _C.timeout()


def set_strict(on=True):
    """Strict mode: ops without a rule, and rules that would replicate more than a
    rank's piece, raise on every rank instead of gathering (default:
    SHARDTENSOR_STRICT). Local; set the same value on every rank: strict mode
    decides whether a rule gathers, so ranks that differ make different
    collectives. SHARDTENSOR_STRICT is agreed across ranks at init (every rank
    raises the same error when it differs); a set_strict() on some ranks only is
    checked, at each use, only under SHARDTENSOR_DEBUG=1 (Note [agreed settings]).
    C++: shardtensor::set_strict (docs/ops.md)."""
    _C.set_strict(bool(on))


def strict():
    """Whether strict mode is on. Local."""
    return _C.strict()


_runtime.install_excepthook()
