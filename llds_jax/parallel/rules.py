"""The one table from logical axis names to mesh axes.

Every parameter declares logical axes (``("embed", "q_heads", "head_dim")``) and the
main activations are constrained by logical name too, so moving the model to another
mesh layout means editing this table and nothing else. Weights and activations use
different names for the model dimension (``embed`` vs ``act_embed``) because FSDP
shards the *weights* along it while activations are sharded along the batch instead.

Two rules keep specs legal on any mesh and any model size:
* a mesh axis may appear at most once in a spec (checked, it is a table bug);
* a mesh axis that does not divide the dimension is dropped for that array
  (e.g. Qwen2.5-3B's 2 KV heads on a tensor axis of 4 stay replicated).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: dict[str, MeshAxes] = {
    # activations
    "batch": ("data", "fsdp"),
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    "cache_seq": None,
    # parameters
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name → mesh axis (or tuple of mesh axes, or None = replicated)."""

    table: tuple[tuple[str, MeshAxes], ...] = tuple(DEFAULT_RULES.items())

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, MeshAxes] | None = None, **overrides) -> ShardingRules:
        merged = dict(DEFAULT_RULES if mapping is None else mapping)
        merged.update(overrides)
        return cls(tuple(merged.items()))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        table = dict(self.table)
        if logical not in table:
            raise KeyError(f"logical axis {logical!r} is not in the sharding rules ({sorted(table)})")
        axes = table[logical]
        if axes is None:
            return ()
        return (axes,) if isinstance(axes, str) else tuple(axes)

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | None = None) -> PartitionSpec:
        """PartitionSpec for an array with these logical axes.

        ``mesh``: a mesh, or its axis sizes by name. With ``mesh``, mesh axes absent from it or of size 1 are left out; with ``shape``
        too, axes not dividing the dimension are dropped (trailing ones first), so the
        spec is always placeable.
        """
        if shape is not None and len(shape) != len(logical_axes):
            raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
        mesh_shape = None if mesh is None else dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
        used: dict[str, str] = {}
        entries = []
        for dim, logical in enumerate(logical_axes):
            axes = list(self.mesh_axes(logical))
            for axis in axes:
                if axis in used:
                    raise ValueError(
                        f"mesh axis {axis!r} used twice in one spec: by {used[axis]!r} and {logical!r} "
                        f"(logical axes {tuple(logical_axes)})")
                used[axis] = logical
            if mesh_shape is not None:  # size-1 axes shard nothing; leaving them out keeps specs readable
                axes = [a for a in axes if mesh_shape.get(a, 1) > 1]
                if shape is not None:
                    while axes and shape[dim] % math.prod(mesh_shape[a] for a in axes):
                        axes.pop()
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        return PartitionSpec(*entries)

    def shards(self, logical: str, mesh: jax.sharding.Mesh | Mapping[str, int], size: int | None = None) -> int:
        """How many pieces a dimension named ``logical`` is split into on ``mesh`` (1: replicated).

        The data-parallel size is ``shards("batch", mesh)`` — read from this table, never from
        positions in the mesh shape. With ``size``, axes that do not divide it are left out (as ``spec``).
        """
        sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
        entry = self.spec((logical,), None if size is None else (size,), sizes)[0]
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        return math.prod(sizes[name] for name in names)

    def sharding(self, logical_axes: Sequence[str | None], mesh: jax.sharding.Mesh,
                 shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))


DEFAULT = ShardingRules()
_ACTIVE_RULES: contextvars.ContextVar[ShardingRules] = contextvars.ContextVar("llds_rules", default=DEFAULT)


def current_rules() -> ShardingRules:
    """The table ``constrain`` uses: DEFAULT unless inside ``use_rules``."""
    return _ACTIVE_RULES.get()


@contextlib.contextmanager
def use_rules(rules: ShardingRules) -> Iterator[ShardingRules]:
    """Make ``rules`` the table for activation constraints traced inside this block.

    Rules are read at trace time: a function jitted under one table keeps it in its
    compiled cache, so trace (call the jitted function the first time) inside the block.
    """
    token = _ACTIVE_RULES.set(rules)
    try:
        yield rules
    finally:
        _ACTIVE_RULES.reset(token)


def logical_to_sharding(logical_axes: Sequence[str | None], mesh: jax.sharding.Mesh,
                        rules: ShardingRules | None = None,
                        shape: Sequence[int] | None = None) -> NamedSharding:
    """NamedSharding on ``mesh`` for an array whose dims carry these logical names."""
    return (rules or current_rules()).sharding(logical_axes, mesh, shape)


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: ShardingRules | None = None) -> jax.Array:
    """Sharding constraint by logical names against the ambient mesh (``jax.set_mesh``)
    and the ambient rules table (``use_rules``; DEFAULT otherwise).

    Without an ambient mesh (single device, plain tests) this is the identity, so model
    code reads the same everywhere; with one, the constraint is real on every backend,
    CPU included.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = (rules or current_rules()).spec(logical_axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)
