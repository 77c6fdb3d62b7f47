"""Device mesh with axes ("data", "fsdp", "tensor").

Axis types are ``Auto`` on purpose: the decoder, sampler and trainer state their
layouts with sharding constraints by logical name (``parallel.rules``) and let GSPMD
propagate the rest. ``Explicit`` axes (JAX's default since 0.7) would make every
contraction over a sharded dim and every reshape of a sharded dim a trace-time type
error that needs a hand-written ``out_sharding``, which couples model code to the mesh
layout; with Auto, changing the rules table is the only edit a new layout needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from llds_jax.errors import InputError

MESH_AXES = ("data", "fsdp", "tensor")


class MeshShapeError(InputError):
    """``mesh.shape`` cannot be laid out on the devices; the message names the shape and the count."""


def resolve_mesh_shape(shape: Sequence[int], num_devices: int, axis_names: Sequence[str] = MESH_AXES,
                       field: str = "mesh.shape") -> tuple[int, ...]:
    """``shape`` with its single ``-1`` resolved against ``num_devices`` (the one resolver: config checks,
    the planner and ``make_mesh`` all use it). A shape needing fewer devices than given is kept as is."""
    shape = tuple(shape)
    if len(shape) != len(axis_names) or shape.count(-1) > 1 or any(
            isinstance(s, bool) or not isinstance(s, int) or s == 0 or s < -1 for s in shape):
        raise MeshShapeError(f"{field}={shape!r} must be {len(axis_names)} positive sizes, one entry per axis "
                             f"({', '.join(axis_names)}); one may be -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshShapeError(f"{field}={shape!r} does not divide the {num_devices} devices")
        return tuple(num_devices // known if s == -1 else s for s in shape)
    if known > num_devices:
        raise MeshShapeError(f"{field}={shape!r} needs {known} devices, have {num_devices}")
    return shape


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[jax.Device] | None = None,
              axis_names: Sequence[str] = MESH_AXES) -> jax.sharding.Mesh:
    """Mesh of ``shape`` (one entry per axis; a single -1 takes the remaining devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(shape, len(devices), axis_names)
    devices = devices[: math.prod(shape)]
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    # jax.make_mesh orders devices for the physical topology (ICI rings on TPU).
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=auto, devices=devices)
