"""Sums along the last axis whose rounding does not depend on how many rows there are.

Why: XLA:CPU picks its row-reduction kernel by the number of rows (measured: a row's
``jnp.sum`` over 64 values changes in the last bit between 32 and 64 rows, a
``log_softmax`` between 16 and 32), so the same trajectory sampled in a wave of 4 rows and in
one of 16 got log-probs 1 ulp apart. A matrix product is row-invariant there but a
mat-vec is not. ``row_sum`` adds the halves of the row pairwise (a fixed tree of
elementwise adds, which every kernel rounds alike), so a row's result depends on the
row alone. On TPU and GPU it is the plain reduction: the tree would cut sharded
dimensions (the vocabulary) in halves across devices.

The platform is the one being compiled for (the ambient mesh's devices), read at trace
time, so a TPU plan compiled from a CPU host takes the TPU path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_platform() -> str:
    """The platform being compiled for: the ambient mesh's devices, else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def row_sum(x: jax.Array, *, keepdims: bool = False) -> jax.Array:
    """``jnp.sum(x, axis=-1)``, rounded the same whatever the leading dimensions on XLA:CPU."""
    if target_platform() != "cpu":
        return jnp.sum(x, axis=-1, keepdims=keepdims)
    width = x.shape[-1]
    size = 1 << max(width - 1, 0).bit_length()
    if size != width:  # zeros add exactly
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - width)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x if keepdims else x[..., 0]


def log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, axis=-1)`` with its normaliser summed by :func:`row_sum`."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted), keepdims=True))
