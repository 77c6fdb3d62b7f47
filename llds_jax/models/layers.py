"""Pure array functions of the decoder: RMSNorm, RoPE, SwiGLU (attention: ``models.attention``).

One implementation for every family; the family switches are arguments. Numerics
follow Hugging Face so parity holds to fp32 rounding: RMSNorm normalises in fp32 and
casts back before the weight multiply; RoPE tables are built in fp32 and use the
"rotate half" layout (not interleaved pairs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from llds_jax.models.reductions import row_sum
from llds_jax.parallel.rules import constrain


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean_square = row_sum(x32 * x32, keepdims=True) / x.shape[-1]  # batch-invariant rounding (reductions.py)
    normed = x32 * jax.lax.rsqrt(mean_square + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> jax.Array:
    """Per-pair inverse frequencies [head_dim/2], with HF's "linear" and "llama3" scaling."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_context / low, old_context / high
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type={kind!r} is not implemented")


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim/2] in fp32 for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, head_dim] with HF's rotate-half pairing (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def project(x: jax.Array, w: jax.Array, contract: int = 1, *, preferred_element_type=None) -> jax.Array:
    """``x [..., *in] · w [*in, *out]`` as one 2-D matmul over a flat token axis.

    An einsum such as ``btd,dhk->bthk`` contracts both ``b`` and ``t`` in its weight
    gradient; XLA:CPU then writes the activation gradient transposed from inside an
    elementwise fusion, which is slow (measured: SmolLM2 MLP fwd+bwd at 4×256, 110 ms as
    einsums vs 62 ms flattened, the matmul roofline). Flattening is a bitcast everywhere
    and merges only a major sharded axis into another, so no layout or collective changes.
    """
    lead, inner, outer = x.shape[:-contract], w.shape[:contract], w.shape[contract:]
    tokens = x.reshape(math.prod(lead), math.prod(inner))
    out = jnp.matmul(tokens, w.reshape(math.prod(inner), math.prod(outer)), preferred_element_type=preferred_element_type)
    return out.reshape(*lead, *outer)


def unembed(hidden: jax.Array, table: jax.Array, *, vocab_major: bool, preferred_element_type=None) -> jax.Array:
    """Logits ``hidden [..., D] → [..., V]`` from an output table stored ``[V, D]`` or ``[D, V]``.

    A tied model's table is its embedding, ``[V, D]``; contracting its ``D`` in place keeps
    XLA from copying a transposed table (113 MB for SmolLM2) on every call and transposing
    its gradient back (SmolLM2 log-prob head fwd+bwd at 4×256, same-run A/B: 22% faster).
    """
    if not vocab_major:
        return project(hidden, table, preferred_element_type=preferred_element_type)
    tokens = hidden.reshape(-1, hidden.shape[-1])
    logits = jax.lax.dot_general(tokens, table, (((1,), (1,)), ((), ())),
                                 preferred_element_type=preferred_element_type)
    return logits.reshape(*hidden.shape[:-1], table.shape[0])


# ``checkpoint_name``s of the MLP's two input projections (models.decoder.MINIMAL_SAVED_NAMES).
MLP_RESIDUALS = GATE_RESIDUAL, UP_RESIDUAL = ("mlp_gate", "mlp_up")


def swiglu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    hidden = jax.nn.silu(checkpoint_name(project(x, gate), GATE_RESIDUAL)) * checkpoint_name(project(x, up), UP_RESIDUAL)
    hidden = constrain(hidden, ("batch", "seq", "act_mlp"))
    return project(hidden, down)
