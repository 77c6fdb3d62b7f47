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

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[jax.Device] | None = None,
              axis_names: Sequence[str] = MESH_AXES) -> jax.sharding.Mesh:
    """Mesh of ``shape`` (one entry per axis; a single -1 takes the remaining devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} needs one entry per axis {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {tuple(shape)}: at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:
            raise ValueError(f"mesh shape {tuple(shape)} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        if math.prod(shape) > len(devices):
            raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, have {len(devices)}")
        devices = devices[: math.prod(shape)]
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    # jax.make_mesh orders devices for the physical topology (ICI rings on TPU).
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=auto, devices=devices)
