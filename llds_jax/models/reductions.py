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
    """``jnp.sum(x, axis=-1)``, rounded the same whatever the leading dimensions on XLA:CPU.

    The tree halves the row until one column is left; at an odd width the last column is set
    aside and added at the end (a fixed order too). No padding: a pad to the next power of two
    (576 → 1024 for SmolLM2's RMSNorm, 49152 → 65536 for its vocabulary) was a separate
    XLA:CPU fusion that wrote the padded row out before the adds read it.
    """
    if target_platform() != "cpu":
        return jnp.sum(x, axis=-1, keepdims=keepdims)
    x = _pairwise(x, jnp.add)
    return x if keepdims else x[..., 0]


def row_max(x: jax.Array) -> jax.Array:
    """``jnp.max(x, axis=-1)`` as a fixed tree of elementwise maxima on XLA:CPU.

    A maximum is exact in any order, but XLA:CPU hands a ``reduce`` to a ynnpack fusion in some
    programs and not in others, by their sizes. With ``jnp.max`` as the online softmax's running
    maximum over a key-block cache (the dense sampler cache of the time) the rollout's wave test saw one
    sampler log-prob one ulp apart between waves of 4 rows and of 10; with this tree, none.
    """
    if target_platform() != "cpu":
        return jnp.max(x, axis=-1)
    return _pairwise(x, jnp.maximum)[..., 0]


def row_sum_of(fn, *operands: jax.Array, keepdims: bool = False) -> jax.Array:
    """``row_sum(fn(*operands))`` bit for bit, for an elementwise ``fn``, without writing ``fn``'s
    output out on XLA:CPU.

    XLA:CPU does not fuse an elementwise producer into the tree's first level, which reads it
    through two slices: it writes the whole ``fn`` output and reads it back (the top-p search's
    masked weights, 1.6 MB a pass at 8 × 49 152). Here the first level slices the operands and
    applies ``fn`` to each half, so ``fn`` fuses into the adds. Operands broadcast against each
    other; those whose last axis has size 1 are not sliced.
    """
    if target_platform() != "cpu":
        return jnp.sum(fn(*operands), axis=-1, keepdims=keepdims)
    width = max(x.shape[-1] for x in operands)

    def columns(start: int, stop: int) -> jax.Array:
        return fn(*(x[..., start:stop] if x.shape[-1] == width else x for x in operands))

    if width < 2:
        return row_sum(fn(*operands), keepdims=keepdims)
    half = width // 2
    set_aside = columns(width - 1, width) if width % 2 else None
    x = _pairwise(columns(0, half) + columns(half, 2 * half), jnp.add, set_aside)
    return x if keepdims else x[..., 0]


def _pairwise(x: jax.Array, combine, set_aside: jax.Array | None = None) -> jax.Array:
    """The last axis folded to width 1 by ``combine`` of its halves, an odd width's last column
    set aside and combined at the end: the same order whatever the leading dimensions.
    ``set_aside``: columns already set aside by levels folded before this call."""
    while x.shape[-1] > 1:
        width = x.shape[-1]
        half = width // 2
        if width % 2:
            odd = x[..., width - 1:]
            set_aside = odd if set_aside is None else combine(set_aside, odd)
        x = combine(x[..., :half], x[..., half:2 * half])
    return x if set_aside is None else combine(x, set_aside)


def _shift_and_log_normaliser(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The row maximum and log Σ exp(x − max), summed by :func:`row_sum`."""
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return top, jnp.log(row_sum(jnp.exp(x - top), keepdims=True))


def log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, axis=-1)`` with its normaliser summed by :func:`row_sum`."""
    top, log_normaliser = _shift_and_log_normaliser(x)
    return (x - top) - log_normaliser


def log_softmax_at(x: jax.Array, index: jax.Array) -> jax.Array:
    """``log_softmax(x)[..., index]`` (``index`` one per row), bit for bit, without writing out
    the ``[..., V]`` log-probabilities: the sampler needs one entry per row."""
    top, log_normaliser = _shift_and_log_normaliser(x)
    return ((jnp.take_along_axis(x, index[..., None], axis=-1) - top) - log_normaliser)[..., 0]
