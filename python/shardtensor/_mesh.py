"""DeviceMesh: an N-d Cartesian grid of MPI ranks (C++ shardtensor::DeviceMesh)."""

import weakref

from . import _C
from ._runtime import ensure_init

__all__ = ["DeviceMesh", "init_device_mesh"]

# Python DeviceMesh objects by their C++ mesh, so that sx.device_mesh returns
# the object the user made (meshes are few; a linear scan is fine).
_live = []


def _comm_handle(comm):
    if comm is None:
        return 0
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise TypeError("a communicator for DeviceMesh needs mpi4py") from e
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    return MPI._handleof(comm)


class DeviceMesh:
    """An N-d Cartesian grid of ranks: ``DeviceMesh((2, -1), ("data", "domain"))``,
    or PhysicsNeMo's and PyTorch's ``DeviceMesh("cuda", (2, -1), mesh_dim_names=...)``.

    Collective over ``comm`` (an mpi4py communicator; default MPI_COMM_WORLD),
    which must be the same on every rank. One entry of ``mesh_shape`` may be -1
    (inferred). ``device_type`` ("cpu" or "cuda") says where the factories put
    each rank's piece: ``mesh.device`` is the CPU, or the GPU ``LOCAL_RANK %
    torch.cuda.device_count()``. Initializes shardtensor on first use. Raises
    RuntimeError on every rank, before communicating, if the shape does not fit
    the communicator size or the names are wrong, and where CUDA is missing
    for a "cuda" mesh. C++: DeviceMesh::create.
    """

    def __init__(self, *args, mesh_shape=None, mesh_dim_names=None, comm=None, device_type=None,
                 _cmesh=None):
        args = list(args)
        if args and isinstance(args[0], str):
            if device_type is not None:
                raise TypeError("DeviceMesh: device_type given twice")
            device_type = args.pop(0)
        for name, value in (("mesh_shape", mesh_shape), ("mesh_dim_names", mesh_dim_names),
                            ("comm", comm)):
            if args:
                if value is not None:
                    raise TypeError(f"DeviceMesh: {name} given twice")
                value = args.pop(0)
            if name == "mesh_shape":
                mesh_shape = value if value is not None else (-1,)
            elif name == "mesh_dim_names":
                mesh_dim_names = value
            else:
                comm = value
        if args:
            raise TypeError("DeviceMesh: too many arguments")
        if _cmesh is None:
            if hasattr(mesh_shape, "shape") and not isinstance(mesh_shape, (tuple, list)):
                # PyTorch passes the mesh as a tensor of ranks: its shape is ours
                # (ranks in row-major order).
                ranks = [int(r) for r in mesh_shape.flatten().tolist()]
                if ranks != list(range(len(ranks))):
                    raise ValueError(
                        "DeviceMesh: a mesh tensor must list the ranks 0..N-1 in row-major "
                        f"order; got {ranks}")
                mesh_shape = tuple(mesh_shape.shape)
            if isinstance(mesh_shape, int):
                mesh_shape = (mesh_shape,)
            if isinstance(mesh_dim_names, str):
                mesh_dim_names = (mesh_dim_names,)
            handle = _comm_handle(comm)
            ensure_init()
            _cmesh = _C.DeviceMesh.create(
                [int(s) for s in mesh_shape], list(mesh_dim_names or ()), handle,
                str(device_type or "cpu")
            )
        self._c = _cmesh
        _live.append(weakref.ref(self))

    @classmethod
    def _from_c(cls, cmesh):
        for ref in list(_live):
            m = ref()
            if m is None:
                _live.remove(ref)
            elif m._c.same(cmesh):
                return m
        return cls(_cmesh=cmesh)

    # --- PyTorch DeviceMesh-style accessors (local) ---
    @property
    def shape(self):
        return tuple(self._c.shape)

    @property
    def mesh_shape(self):
        return self.shape

    @property
    def device_type(self):
        """Where the factories put pieces: "cpu" or "cuda". Local."""
        return self._c.device_type

    @property
    def device(self):
        """This rank's device (torch.device): the CPU, or its GPU on a cuda mesh. Local."""
        return self._c.device()

    @property
    def ndim(self):
        return self._c.ndim

    @property
    def mesh_dim_names(self):
        names = self._c.dim_names
        return tuple(names) if names else None

    def _dim(self, mesh_dim):
        if isinstance(mesh_dim, str):
            return self._c.dim_index(mesh_dim)
        return mesh_dim

    def size(self, mesh_dim=None):
        """Number of ranks in the mesh, or along one mesh dim (index or name)."""
        if mesh_dim is None:
            return self._c.size()
        return self._c.dim_size(self._dim(mesh_dim))

    def get_coordinate(self):
        """This rank's coordinate in the grid."""
        return list(self._c.coordinate())

    def get_local_rank(self, mesh_dim=None):
        """This rank's coordinate along one mesh dim (index or name)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError("get_local_rank() needs mesh_dim on a mesh with ndim > 1")
            mesh_dim = 0
        return self._c.coordinate()[self._dim(mesh_dim)]

    def get_rank(self):
        """This rank's rank in the mesh's communicator."""
        return self._c.rank()

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._c.same(other._c)

    def __hash__(self):
        return hash((self.shape, self.mesh_dim_names))

    def __repr__(self):
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, shape={self.shape}{names})"


def init_device_mesh(*args, mesh_shape=None, mesh_dim_names=None, comm=None):
    """``init_device_mesh(shape, names)`` or PyTorch's ``init_device_mesh("cuda", shape,
    mesh_dim_names=names)``. Collective; see DeviceMesh."""
    args = list(args)
    device_type = "cpu"
    if args and isinstance(args[0], str):
        device_type = args.pop(0)
    if args:
        mesh_shape = args.pop(0)
    if args:
        mesh_dim_names = args.pop(0)
    if args:
        raise TypeError("init_device_mesh: too many arguments")
    return DeviceMesh(mesh_shape=mesh_shape if mesh_shape is not None else (-1,),
                      mesh_dim_names=mesh_dim_names, comm=comm, device_type=device_type)
