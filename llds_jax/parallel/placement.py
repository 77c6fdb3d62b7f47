"""Placing a model's parameters on a mesh from their declared logical axes.

Every ``nnx.Param`` in ``llds_jax.models`` carries ``logical_axes`` metadata; these
helpers turn that into PartitionSpecs / NamedShardings through the rules table, so
shardings can be computed from an abstract model (``nnx.eval_shape``) before any
weight exists, and checkpoints can be loaded straight into them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.parallel.rules import ShardingRules, current_rules

GOLDEN_DIR = Path(__file__).parent / "golden"


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def iter_params(model: nnx.Module) -> Iterator[tuple[str, nnx.Variable]]:
    """(dotted path, Param) for every parameter, in a stable order."""
    state = nnx.state(model, nnx.Param)
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    for path, var in flat:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        yield name, var


def logical_axes_of(var: nnx.Variable, name: str = "?") -> tuple[str | None, ...]:
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        raise ValueError(f"parameter {name} declares no logical_axes")
    if len(axes) != len(var.shape):
        raise ValueError(f"parameter {name}: logical_axes {axes} do not match shape {var.shape}")
    return tuple(axes)


def param_specs(model: nnx.Module, mesh, rules: ShardingRules | None = None) -> dict[str, PartitionSpec]:
    """Dotted parameter path → PartitionSpec on ``mesh`` (shape-aware, see rules.spec)."""
    rules = rules or current_rules()
    return {name: rules.spec(logical_axes_of(var, name), var.shape, mesh) for name, var in iter_params(model)}


def param_shardings(model: nnx.Module, mesh, rules: ShardingRules | None = None) -> dict[str, NamedSharding]:
    return {name: NamedSharding(mesh, spec) for name, spec in param_specs(model, mesh, rules).items()}


def shard_model(model: nnx.Module, mesh, rules: ShardingRules | None = None) -> nnx.Module:
    """Move every parameter of ``model`` onto its rules-table sharding (in place; returns it)."""
    shardings = param_shardings(model, mesh, rules)
    for name, var in iter_params(model):
        var.set_value(jax.device_put(var.get_value(), shardings[name]))
    return model


def specs_to_json(specs: dict[str, PartitionSpec]) -> dict[str, list]:
    """JSON-friendly form: each spec as a list of null / axis / [axes]."""
    return {name: [list(e) if isinstance(e, tuple) else e for e in spec] for name, spec in sorted(specs.items())}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def write_golden(name: str, specs: dict[str, PartitionSpec]) -> Path:
    path = golden_path(name)
    lines = [f" {json.dumps(name)}: {json.dumps(spec)}" for name, spec in specs_to_json(specs).items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one parameter per line: readable diffs
    return path
