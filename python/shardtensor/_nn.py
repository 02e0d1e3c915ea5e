"""distribute_module, backward and ring attention (C++ nn/ and ops/)."""

import torch

from . import _C
from ._tensor import _mesh_of, _wrap

__all__ = ["distribute_module", "fully_shard", "full_state_dict", "load_full_state_dict",
           "clip_grad_norm_", "unflatten_shard", "backward", "grad", "scaled_dot_product_attention", "halo_exchange",
           "halo_exchange_begin", "halo_exchange_end"]


def distribute_module(module, device_mesh=None, partition_fn=None, input_fn=None, output_fn=None,
                      *, bucket_cap_mb=25, bucket_gradients=True):
    """Makes every rank's copy of ``module`` identical (parameters and buffers
    broadcast from mesh rank 0) and sums the parameters' gradients over the mesh
    in buckets during backward, so that after ``loss.backward()`` every
    ``p.grad`` equals the single-process gradient. Returns ``module``.

    Collective over the mesh. Raises on every rank if the ranks' modules differ
    (names, shapes, dtypes, requires_grad). ``partition_fn(name, submodule,
    mesh)``, ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs,
    mesh)`` behave as in PyTorch's distribute_module. C++: distribute_module.
    """
    mesh = _mesh_of(device_mesh)
    if partition_fn is not None:
        for name, sub in module.named_modules():
            partition_fn(name, sub, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    # names only feed the cross-rank fingerprint; C++ parameter names have no dots
    params = [(n.replace(".", "_"), p) for n, p in module.named_parameters()]
    buffers = [(n.replace(".", "_"), b) for n, b in module.named_buffers()]
    _C.distribute_module(params, buffers, mesh._c, int(bucket_cap_mb * (1 << 20)),
                         bool(bucket_gradients))
    return module


def backward(output, grad=None, retain_graph=None, create_graph=False):
    """Backward pass from any tensor, sharded or plain (``loss.backward()`` works
    for plain scalars; use this for non-scalar sharded outputs). ``grad`` is a
    ShardTensor with the output's layout, a plain tensor of the global shape, or
    None for a single-element output. ``retain_graph`` and ``create_graph`` as in
    torch.autograd.backward. Collective when ``output`` is sharded. Raises
    RuntimeError if ``grad`` does not match the output. C++: shardtensor::backward."""
    _C.backward(output, grad, retain_graph, bool(create_graph))


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=False):
    """torch.autograd.grad for ShardTensors and plain tensors alike: a tuple with
    d(outputs)/d(inputs), a ShardTensor laid out like each sharded input (Partial
    becomes Replicate), a plain tensor for a plain input, None for an unused one
    (with ``allow_unused``). ``grad_outputs``: None (single-element outputs) or
    one per output, each as for :func:`backward`. With ``create_graph=True`` the
    gradients are differentiable (gradient penalties, PINN residuals): second
    derivatives are exact. Collective (it runs a backward pass). Raises
    RuntimeError on every rank where double backward is not supported, naming
    the op. C++: shardtensor::grad."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if grad_outputs is None:
        grad_outputs = []
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs]
    else:
        grad_outputs = list(grad_outputs)
    if grad_outputs and len(grad_outputs) != len(outputs):
        raise ValueError(
            f"shardtensor.grad: got {len(grad_outputs)} grad_outputs for {len(outputs)} outputs"
        )
    res = _C.grad(outputs, inputs, grad_outputs, retain_graph, bool(create_graph),
                  bool(allow_unused))
    return tuple(_wrap(r) if r is not None else None for r in res)


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Attention ``softmax(q k^T * scale + mask) v`` on (..., L, E) tensors; with the
    sequence dim sharded it runs as ring attention (K/V blocks passed around the
    ring, online softmax), never gathering the sequence. Collective over the
    mesh dim that shards the sequence. Differentiable. C++:
    shardtensor::scaled_dot_product_attention."""
    return _wrap(_C.scaled_dot_product_attention(query, key, value, attn_mask, bool(is_causal),
                                                 None if scale is None else float(scale)))


def halo_exchange(tensor, dim, left, right, mode="constant", value=0.0):
    """This rank's local piece of ShardTensor ``tensor`` extended along ``dim`` by
    ``left``/``right`` elements from the neighbouring pieces (multi-hop when wider
    than a neighbour); at the global edge filled per ``mode`` ("constant",
    "reflect", "replicate", "circular"). Returns a plain local tensor connected to
    autograd. Collective over the mesh dim that shards ``dim`` (local if none).
    C++: shardtensor::halo_exchange."""
    return _C.halo_exchange(tensor, int(dim), int(left), int(right), str(mode), float(value))


def halo_exchange_begin(tensor, dim, left, right, mode="constant", value=0.0):
    """Split-phase :func:`halo_exchange` (like PETSc's DMGlobalToLocalBegin/End and
    AMReX's FillBoundary_nowait/_finish): posts the exchange and returns at once a
    pending exchange, so that the caller can compute on the interior of its piece
    while the halos travel::

        pending = st.halo_exchange_begin(u, 2, 1, 1)
        interior = stencil(u.to_local())          # overlaps the messages
        ext = st.halo_exchange_end(pending)       # == st.halo_exchange(u, 2, 1, 1)

    ``pending.test()`` drives MPI progress and says whether the halos arrived.
    Collective over the mesh dim that shards ``dim`` (every rank of it must begin,
    and then end, the same exchange); local if none. Raises RuntimeError as
    halo_exchange does, on every rank and before any message.
    C++: shardtensor::halo_exchange_begin."""
    return _C.halo_exchange_begin(tensor, int(dim), int(left), int(right), str(mode), float(value))


def halo_exchange_end(pending):
    """Waits for the exchange begun by :func:`halo_exchange_begin` and returns this
    rank's extended piece, exactly what :func:`halo_exchange` returns, with the same
    gradient (a plain local tensor connected to autograd). Raises RuntimeError if
    ``pending`` was already ended. C++: shardtensor::halo_exchange_end."""
    return pending.end()


def fully_shard(module, mesh=None, dim="data", *, reshard_after_forward=True):
    """Shards ``module``'s parameters over mesh dim ``dim`` (FSDP / ZeRO), as
    PyTorch's FSDP2 ``fully_shard``; the other mesh dims keep
    :func:`distribute_module`'s meaning (parameters replicated there, their
    gradients summed). Apply it to blocks first, then to the root. Returns
    ``module``.

    The unit is ``module``'s parameters not already in an inner unit. Every
    parameter and buffer is first broadcast from mesh rank 0. Each rank then
    keeps 1/D of the unit's flattened, padded parameters (D = size of ``dim``)
    in one ``nn.Parameter`` registered as ``module._st_flat_param``; the
    original parameters stay attributes of their modules (same names, same
    shapes), no longer registered, so ``model.parameters()`` gives the shards
    and ``torch.optim`` steps them unchanged (its state is 1/D too). They are
    gathered over ``dim`` before the module's forward, freed when the next
    unit's forward starts (``reshard_after_forward``, ZeRO-3; else kept until
    backward, ZeRO-2), gathered again for backward, and their gradients are
    reduce-scattered into ``_st_flat_param.grad`` (this rank's slice of the
    single-process gradient). Collective over the mesh. Raises on every rank
    if the ranks' modules differ, ``dim`` is not a mesh dim, or the unit mixes
    dtypes. C++: shardtensor::fully_shard (docs/fully_shard.md).
    """
    mesh = _mesh_of(mesh)
    params, owners = [], []
    is_root = False
    for mod_name, mod in module.named_modules():
        for local, p in list(mod._parameters.items()):
            if p is None:
                continue
            if local == "_st_flat_param":
                is_root = is_root or mod is not module
                continue
            if not p.requires_grad:
                continue
            full = f"{mod_name}.{local}" if mod_name else local
            params.append((full, p))
            owners.append((mod, local))
    # shared parameters appear once in named_modules' walk per owner; keep the first
    seen, unique, unique_owners = set(), [], []
    for (n, p), o in zip(params, owners):
        if id(p) in seen:
            continue
        seen.add(id(p))
        unique.append((n, p))
        unique_owners.append(o)
    buffers = [(n, b) for n, b in module.named_buffers()]
    unit = _C.fully_shard(unique, buffers, mesh._c, str(dim), bool(reshard_after_forward), is_root)
    dtype = unique[0][1].dtype if unique else torch.float32
    flat = torch.nn.Parameter(torch.empty(unit.shard_numel(), dtype=dtype))
    unit.set_shard(flat)
    for (mod, local), (_, p) in zip(unique_owners, unique):
        del mod._parameters[local]
        mod.__dict__[local] = p  # still what the module's forward reads
    module.register_parameter("_st_flat_param", flat)
    module._st_unit = unit
    module.register_forward_pre_hook(lambda mod, inputs: unit.unshard())
    return module


def _units(module):
    return [(name, mod._st_unit) for name, mod in module.named_modules() if hasattr(mod, "_st_unit")]


def full_state_dict(module):
    """The full value of every parameter of the fully sharded units in
    ``module``, by dotted name (as ``module.state_dict()`` would name them
    without fully_shard). Collective over each unit's data dim."""
    out = {}
    for prefix, unit in _units(module):
        for n, v in unit.full_state_dict():
            out[f"{prefix}.{n}" if prefix else n] = v
    return out


def load_full_state_dict(module, state):
    """Sets the fully sharded units in ``module`` from full parameter values
    named as :func:`full_state_dict` names them (every rank passes the same
    values; each keeps its slice). Local. Raises if a name is missing or a
    shape differs."""
    for prefix, unit in _units(module):
        sub = []
        for n in unit.names():
            key = f"{prefix}.{n}" if prefix else n
            if key not in state:
                raise KeyError(f"load_full_state_dict: no value for '{key}'")
            sub.append((n, state[key]))
        unit.load_full_state_dict(sub)


def clip_grad_norm_(module, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the sharded gradients of the fully
    sharded units in ``module``: returns the global 2-norm (before clipping)
    and scales the shard gradients so that it is at most ``max_norm``.
    Collective over the data dim."""
    return _C.clip_grad_norm_([u for _, u in _units(module)], float(max_norm))


def unflatten_shard(unit_module, shard_like):
    """Gathers a tensor laid out like ``unit_module._st_flat_param`` (e.g. its
    Adam ``exp_avg``) and returns it per parameter of that unit, by name
    relative to ``unit_module``, with the parameters' shapes (padding
    dropped). Collective over the data dim."""
    unit = unit_module._st_unit
    return dict(zip(unit.names(), unit.unflatten(shard_like)))
