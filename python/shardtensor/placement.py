"""Placements: how a tensor is laid out along one mesh dimension (pure metadata).

``Shard(dim)``, ``Replicate()`` and ``Partial()`` print and compare as PyTorch's
DTensor placements do (``repr(Shard(2)) == "Shard(dim=2)"``). Placements are
passed and returned as tuples, one per mesh dimension.
"""

__all__ = ["Placement", "Shard", "Replicate", "Partial"]


class Placement:
    """Base class of the three placements."""

    __slots__ = ()

    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return False

    def is_partial(self):
        return False


class Shard(Placement):
    """Split tensor dim ``dim`` across the mesh dim (balanced blocks unless sizes are given)."""

    __slots__ = ("dim",)

    def __init__(self, dim=0):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim) needs an int, got {dim!r}")
        object.__setattr__(self, "dim", dim)

    def __setattr__(self, name, value):
        raise AttributeError("placements are immutable")

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def __eq__(self, other):
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self):
        return hash(("Shard", self.dim))

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"


class Replicate(Placement):
    """Every coordinate along the mesh dim holds the whole extent."""

    __slots__ = ()

    def is_replicate(self):
        return True

    def __eq__(self, other):
        return isinstance(other, Replicate)

    def __hash__(self):
        return hash("Replicate")

    def __repr__(self):
        return "Replicate()"

    def __str__(self):
        return "R"


class Partial(Placement):
    """Every coordinate holds a summand; the value is the pending sum over the mesh dim."""

    __slots__ = ()

    reduce_op = "sum"

    def is_partial(self):
        return True

    def __eq__(self, other):
        return isinstance(other, Partial)

    def __hash__(self):
        return hash("Partial")

    def __repr__(self):
        return "Partial()"

    def __str__(self):
        return "P"


def _to_codes(placements, ndim=None):
    """Placements -> the (kind, dim) pairs of shardtensor._C. Negative Shard dims wrap by ndim."""
    if isinstance(placements, Placement):
        placements = (placements,)
    codes = []
    for p in placements:
        if isinstance(p, Shard):
            d = p.dim
            if d < 0 and ndim is not None:
                d += ndim
            codes.append((0, d))
        elif isinstance(p, Replicate):
            codes.append((1, 0))
        elif isinstance(p, Partial):
            codes.append((2, 0))
        else:
            raise TypeError(
                f"placements must be Shard(dim), Replicate() or Partial(), got {p!r} in {placements!r}"
            )
    return codes


_REPLICATE = Replicate()
_PARTIAL = Partial()


def _from_codes(codes):
    out = []
    for kind, dim in codes:
        out.append(Shard(dim) if kind == 0 else (_REPLICATE if kind == 1 else _PARTIAL))
    return tuple(out)
