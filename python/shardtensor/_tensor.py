"""The Python ShardTensor type (C++ shardtensor::ShardTensor).

Note [python ShardTensor class]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ShardTensor made in C++ (factories, every sharded op result) reaches Python
through torch's own caster as an ordinary ``torch.Tensor`` object whose impl is
a ShardTensorImpl: global sizes, the local piece and the spec inside. All
torch ops on it already reach the C++ dispatcher. What Python adds is the type:

* ``ShardTensor`` is a ``torch.Tensor`` subclass, and such tensors are given
  that class in place (``t.__class__ = ShardTensor``: same object, same impl, no
  alias or copy, so autograd identity and leaf-ness are kept). torch keeps the
  Python object attached to the impl, so the class sticks.
* ``ShardTensor.__torch_function__`` runs the op with torch-function handling
  disabled and gives the ShardTensor class to exactly those results whose impl
  is a ShardTensorImpl. A plain replicated result (``loss = out.mean()``) stays
  a plain ``torch.Tensor``: ``isinstance(loss, ShardTensor)`` is False, unlike
  the default subclass behaviour, which would re-wrap every result.
  ``isinstance(x, ShardTensor)`` is therefore True exactly for sharded tensors.
* Autograd state lives on the local piece (Note [factories return at::Tensor]
  in C++), so ``grad``, ``requires_grad``, ``requires_grad_()``, ``is_leaf``,
  ``grad_fn`` and ``backward()`` are redirected to it: ``sx.grad`` is a
  ShardTensor with sx's layout.

Rejected alternative: a metaclass ``__instancecheck__`` with properties
monkey-patched onto torch.Tensor would change every plain tensor's ``.grad``.
"""

import torch

from . import _C
from ._mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, _from_codes, _to_codes

__all__ = ["ShardTensor", "scatter_tensor", "distribute_tensor"]

_Tensor = torch.Tensor
_is_shard = _C.is_shard_tensor
_DisableTorchFunction = torch._C.DisableTorchFunction


def _wrap(t):
    """Gives a tensor whose impl is a ShardTensorImpl the class ShardTensor (in place)."""
    if type(t) is _Tensor and _is_shard(t):
        t.__class__ = ShardTensor
    return t


def _wrap_result(ret):
    if isinstance(ret, _Tensor):
        if type(ret) is _Tensor and _is_shard(ret):
            ret.__class__ = ShardTensor
    elif isinstance(ret, (tuple, list)):
        for r in ret:
            _wrap_result(r)
    return ret


def _mesh_of(mesh):
    if isinstance(mesh, DeviceMesh):
        return mesh
    if mesh is None:
        from ._manager import DistributedManager

        return DistributedManager()._default_mesh()
    raise TypeError(f"expected a shardtensor.DeviceMesh, got {type(mesh).__name__}")


def _placements_tuple(placements):
    if isinstance(placements, Placement):
        return (placements,)
    return tuple(placements)


def _shard_sizes(sharding_shapes, placements):
    """PhysicsNeMo's sharding_shapes -> C++ ShardSizes (None: infer by all-gather)."""
    if sharding_shapes is None or isinstance(sharding_shapes, str):
        if sharding_shapes not in (None, "infer", "chunk"):
            raise ValueError(
                f"sharding_shapes must be None, 'infer', 'chunk', a dict or a list, got {sharding_shapes!r}"
            )
        return None
    if isinstance(sharding_shapes, dict):
        sizes = []
        for i, p in enumerate(placements):
            if isinstance(p, Shard):
                sizes.append([int(s[p.dim]) for s in sharding_shapes[i]])
            else:
                sizes.append([])
        return sizes
    return [[int(v) for v in s] for s in sharding_shapes]


class _Spec:
    """``sx._spec``: the layout metadata (identical on every rank). Local."""

    __slots__ = ("_t",)

    def __init__(self, t):
        self._t = t

    @property
    def placements(self):
        return _from_codes(_C.placements(self._t))

    @property
    def mesh(self):
        return DeviceMesh._from_c(_C.mesh(self._t))

    device_mesh = mesh

    @property
    def shape(self):
        return self._t.shape

    def sharding_shapes(self):
        """{mesh_dim: (local shape of each coordinate along it)} for the Shard mesh dims."""
        sizes = _C.shard_sizes(self._t)
        local = list(_C.local_shape(self._t))
        out = {}
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard):
                shapes = []
                for n in sizes[i]:
                    s = list(local)
                    s[p.dim] = n
                    shapes.append(torch.Size(s))
                out[i] = tuple(shapes)
        return out

    def __repr__(self):
        return f"ShardSpec(placements={self.placements}, shape={tuple(self.shape)})"


class ShardTensor(torch.Tensor):
    """A torch.Tensor that reports the global shape and holds this rank's piece.

    Made by ``scatter_tensor``, ``distribute_tensor``, ``ShardTensor.from_local``
    or any torch op on ShardTensors; never constructed directly. ``shape`` is
    global, ``dtype``/``device`` are the local piece's. Every torch op on it runs
    the C++ sharding rules (same results as single-process PyTorch on the
    gathered tensor). See Note [python ShardTensor class].
    """

    def __new__(cls, *args, **kwargs):
        raise TypeError(
            "ShardTensor is not constructed directly: use shardtensor.scatter_tensor, "
            "distribute_tensor or ShardTensor.from_local"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with _DisableTorchFunction():
            ret = func(*args, **(kwargs or {}))
        return _wrap_result(ret)

    # ---- factories -----------------------------------------------------------
    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, sharding_shapes=None):
        """Wraps this rank's piece (no copy; autograd history kept).

        Collective over the mesh when ``sharding_shapes`` is None/"infer"/"chunk"
        (the local extents are all-gathered); with explicit sizes (a list per mesh
        dim, or PhysicsNeMo's dict ``{mesh_dim: [shape per coordinate]}``) only an
        error flag is all-reduced. Raises on every rank if the pieces do not fit.
        C++: ShardTensor::from_local.
        """
        mesh = _mesh_of(device_mesh)
        placements = _placements_tuple(placements if placements is not None else (Replicate(),))
        sizes = _shard_sizes(sharding_shapes, placements)
        codes = _to_codes(placements, local_tensor.dim())
        return _wrap(_C.from_local(local_tensor, mesh._c, codes, sizes))

    # ---- layout ----------------------------------------------------------------
    @property
    def placements(self):
        """Tuple of placements, one per mesh dim. Local."""
        return _from_codes(_C.placements(self))

    @property
    def device_mesh(self):
        """The DeviceMesh this tensor is sharded over. Local."""
        return DeviceMesh._from_c(_C.mesh(self))

    @property
    def _spec(self):
        return _Spec(self)

    @property
    def _local_tensor(self):
        return _C.local(self)

    def to_local(self):
        """This rank's piece (a plain tensor; differentiable, autograd history lives here). Local."""
        return _C.local(self)

    def full_tensor(self, grad_placements=None):
        """The whole tensor on every rank. Collective over the non-Replicate mesh dims;
        differentiable. C++: ShardTensor::full_tensor."""
        return _C.full_tensor(self)

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False,
                     sharding_shapes=None):
        """New layout on the same mesh: ``sx.redistribute(placements)`` or
        ``sx.redistribute(mesh, placements)``. Collective over the mesh dims that
        change; differentiable. Raises on every rank for invalid placements/sizes."""
        if placements is None and not isinstance(device_mesh, DeviceMesh):
            device_mesh, placements = None, device_mesh
        if device_mesh is not None and device_mesh != self.device_mesh:
            raise ValueError("ShardTensor.redistribute: another mesh is not supported")
        if placements is None:
            raise ValueError("ShardTensor.redistribute: placements are required")
        placements = _placements_tuple(placements)
        sizes = _shard_sizes(sharding_shapes, placements)
        return _wrap(_C.redistribute(self, _to_codes(placements, self.dim()), sizes))

    # ---- autograd (state lives on the local piece) --------------------------------
    @property
    def grad(self):
        """The gradient as a ShardTensor with this tensor's layout, or None. Local."""
        g = _C.grad(self)
        return None if g is None else _wrap(g)

    @grad.setter
    def grad(self, value):
        _C.set_grad(self, value)

    @grad.deleter
    def grad(self):
        _C.set_grad(self, None)

    @property
    def requires_grad(self):
        return _C.requires_grad(self)

    @requires_grad.setter
    def requires_grad(self, value):
        _C.set_requires_grad(self, bool(value))

    def requires_grad_(self, requires_grad=True):
        _C.set_requires_grad(self, bool(requires_grad))
        return self

    @property
    def is_leaf(self):
        return _C.is_leaf(self)

    @property
    def grad_fn(self):
        return _C.local(self).grad_fn

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Backward from a sharded output: ``gradient`` is a ShardTensor with the same
        layout, a plain tensor of the global shape, or None for one element;
        ``retain_graph`` and ``create_graph`` as in torch. Collective. Raises
        NotImplementedError for ``inputs`` (use shardtensor.grad). C++:
        shardtensor::backward."""
        if inputs is not None:
            raise NotImplementedError(
                "ShardTensor.backward: inputs is not supported; use shardtensor.grad"
            )
        _C.backward(self, gradient, retain_graph, bool(create_graph))

    # ---- printing (never communicates, never fails) -------------------------------
    def __repr__(self, *args, **kwargs):
        try:
            return _C.to_string(self)
        except Exception as e:  # pragma: no cover - defensive
            return f"ShardTensor(<unprintable: {e}>)"

    __str__ = __repr__

    def __format__(self, spec):
        return self.__repr__()

    def __deepcopy__(self, memo):
        """A ShardTensor with the same layout and a copy of this rank's piece (and
        of its grad); requires_grad is kept. Local: no communication, so every
        rank may copy independently (torch.optim's load_state_dict, copy.deepcopy
        of a model holding ShardTensors). Like torch, only leaves can be copied."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment (a ShardTensor that is not a leaf)"
            )
        with torch.no_grad():
            new = _wrap(_Tensor.clone(self))
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        g = self.grad
        if g is not None:
            new.grad = g.__deepcopy__(memo) if isinstance(g, ShardTensor) else g.clone()
        return new

    def __reduce_ex__(self, protocol):
        raise RuntimeError(
            "a ShardTensor cannot be pickled or torch.save()d: save sx.full_tensor() "
            "(collective) or sx.to_local() with its placements"
        )


def scatter_tensor(tensor, global_src, mesh, placements, global_shape=None, dtype=None,
                   requires_grad=False, *, device=None):
    """Scatters ``tensor`` (needed on rank ``global_src`` of the mesh only; others
    may pass None) so each rank receives only its piece. Collective over the
    mesh. The piece lives on ``device``, or on the mesh's device when None (each
    rank its own GPU on a ``DeviceMesh("cuda", ...)``), and is a leaf that
    requires grad if ``requires_grad``. Raises on every rank if the tensor does
    not fit the placements. C++: scatter_tensor."""
    mesh = _mesh_of(mesh)
    placements = _placements_tuple(placements)
    if tensor is not None and dtype is not None:
        tensor = tensor.to(dtype)
    # Placements go to C++ exactly as given on every rank (only src knows ndim;
    # C++ checks them against the broadcast shape on every rank).
    return _wrap(_C.scatter_tensor(tensor, int(global_src), mesh._c, _to_codes(placements),
                                   bool(requires_grad), _device_or_none(device)))


def _device_or_none(device):
    return None if device is None else torch.device(device)


def distribute_tensor(tensor, device_mesh=None, placements=None, *, requires_grad=None,
                      sharding_shapes=None, device=None):
    """Every rank has ``tensor`` and keeps a copy of its piece (no communication).
    The piece is a leaf that requires grad if ``requires_grad`` (default: the
    tensor's own flag), on ``device``, or on the mesh's device when None (as
    PyTorch's distribute_tensor moves a tensor to its mesh's device type).
    C++: distribute_tensor."""
    mesh = _mesh_of(device_mesh)
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    placements = _placements_tuple(placements)
    if requires_grad is None:
        requires_grad = tensor.requires_grad
    sizes = _shard_sizes(sharding_shapes, placements)
    with torch.no_grad():
        return _wrap(_C.distribute_tensor(tensor.detach(), mesh._c,
                                          _to_codes(placements, tensor.dim()),
                                          bool(requires_grad), sizes,
                                          _device_or_none(device)))
