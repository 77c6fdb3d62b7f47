"""Attention that never materialises [T, S] scores, with one backend chosen per program.

``model.attention`` picks the kernel:

* ``"auto"`` — splash on TPU, cuDNN flash on GPU when cuDNN loads in this process,
  ``xla_blockwise`` otherwise (CPU, and GPU plans compiled without cuDNN);
* ``"xla_blockwise"`` — flash-style key blocks in plain XLA (any backend);
* ``"splash"`` — Pallas splash attention (TPU only);
* ``"cudnn"`` — ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only);
* ``"naive"`` — the dense oracle that builds fp32 [B, H, T, S] scores (tests, tiny shapes).

Splash and cuDNN serve the full-sequence forward (training, log-probs); a cached
forward (prefill into a KV cache, appends) uses the blockwise kernel on every backend,
which reads only the key blocks below the rows' furthest slot. The rollout's cache is the
paged one (``paged.attend_paged``): it decodes on TPU by ``decode_tpu``'s paged kernel and on
GPU by ``decode_gpu``'s Triton kernel (``resolve_paged_backend``: unless ``xla_blockwise`` is
forced). ``attend_cached`` writes a chunk into the dense one-buffer-per-layer ``KVCache`` and
attends over it with the blockwise kernel: the reference the paged cache and its kernels are
checked against bit for bit (no rollout path runs it).

The choice is resolved at trace time from the platform the program is compiled for
(the ambient mesh's devices, so a TPU plan from a CPU host picks splash), cached per
(request, platform): no device query runs inside the compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from llds_jax.models.attention.blockwise import (
    ATTENTION_RESIDUALS,
    CACHED_BLOCK,
    DEFAULT_BLOCK,
    KV_RESIDUAL,
    Q_RESIDUAL,
    QUERY_BLOCK,
    blockwise_attention,
    query_piece,
)
from llds_jax.models.attention.cudnn import CUDNN_DTYPES, cudnn_attention, cudnn_available
from llds_jax.models.attention.mask import AttentionMask
from llds_jax.models.attention.naive import MASKED_SCORE, naive_attention
from llds_jax.models.attention.splash import splash_attention
from llds_jax.models.config import ATTENTION_BACKENDS, ConfigError
from llds_jax.models.reductions import target_platform
from llds_jax.parallel.rules import constrain

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_RESIDUALS", "CACHED_BLOCK", "DEFAULT_BLOCK", "KV_CACHE_AXES", "MASKED_SCORE", "QUERY_BLOCK",
           "AttentionMask", "attend", "attend_cached", "blockwise_attention", "cudnn_attention", "naive_attention", "query_piece", "resolve_backend", "resolve_paged_backend",
           "splash_attention", "target_platform"]


@functools.cache
def resolve_backend(requested: str, platform: str) -> str:
    """The concrete kernel for ``model.attention=requested`` on ``platform``."""
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(f"model.attention={requested!r}: expected one of {ATTENTION_BACKENDS}")
    gpu = platform in _GPU_PLATFORMS
    if requested == "auto":
        if platform == "tpu":
            return "splash"
        return "cudnn" if gpu and cudnn_available() else "xla_blockwise"
    if requested == "splash" and platform != "tpu":
        raise ConfigError(f"model.attention='splash' needs a TPU; this program compiles for {platform!r} "
                          f"(use 'auto' or 'xla_blockwise')")
    if requested == "cudnn" and not (gpu and cudnn_available()):
        raise ConfigError(f"model.attention='cudnn' needs an NVIDIA GPU with cuDNN loaded in this process; "
                          f"this program compiles for {platform!r} (use 'auto' or 'xla_blockwise')")
    return requested


def resolve_paged_backend(requested: str, platform: str) -> str:
    """The kernel of a paged-cache forward (``attention/paged.py``) for ``model.attention=requested``.

    As :func:`resolve_backend`, except on a GPU: there ``"auto"`` and ``"cudnn"`` give ``"triton"``,
    whose one-token decode is the Pallas Triton kernel of ``decode_gpu`` (it needs no cuDNN, so a
    GPU plan compiled from a CPU host gets it too). A user who sets ``"xla_blockwise"`` (or
    ``"naive"``) on a GPU keeps the XLA loop, so a benchmark can compare the two paths.
    """
    backend = resolve_backend(requested, platform)
    if platform in _GPU_PLATFORMS and requested in ("auto", "cudnn"):
        return "triton"
    return backend


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, backend: str,
           block_size: int = DEFAULT_BLOCK, *, kv_heads_major: bool = False) -> jax.Array:
    """Grouped-query attention with a resolved ``backend``: q [B, T, H, Dh], k, v [B, S, KVH, Dh]
    (``kv_heads_major``: [B, KVH, S, Dh], a KV cache's layout, which the blockwise kernel reads as is)."""
    if backend not in ("xla_blockwise", "splash", "cudnn", "naive"):
        raise ValueError(f"attend: backend={backend!r} is not resolved (see resolve_backend)")
    if backend == "cudnn" and q.dtype not in CUDNN_DTYPES:  # cuDNN's fused kernel takes half precision only
        backend = "xla_blockwise"
    if backend == "xla_blockwise" or (not mask.self_attention and backend != "naive"):
        return blockwise_attention(q, k, v, mask, block_size, kv_heads_major=kv_heads_major)
    if kv_heads_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # The kernels below keep their residuals inside (splash's and cuDNN's custom VJPs), so a remat
    # policy reruns their forward; named inputs spare it the q/k/v projections before that.
    q = checkpoint_name(q, Q_RESIDUAL)
    k, v = checkpoint_name(k, KV_RESIDUAL), checkpoint_name(v, KV_RESIDUAL)
    if backend == "naive":
        return naive_attention(q, k, v, mask)
    if backend == "splash":
        return splash_attention(q, k, v, mask, block_size)
    return cudnn_attention(q, k, v, mask, block_size)


KV_CACHE_AXES = ("batch", "act_kv_heads", "cache_seq", None)  # one layer's cached k or v, heads-major


def _write(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """``new`` [B, T, KVH, Dh] written at ``slots`` [B, T] of a layer's cache (slots ≥ S dropped)."""
    rows = jnp.arange(new.shape[0])[:, None]
    return constrain(cache.at[rows, :, slots].set(new.astype(cache.dtype), mode="drop"), KV_CACHE_AXES)


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                  mask: AttentionMask, backend: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write a chunk's k, v [B, T, KVH, Dh] into heads-major caches [B, KVH, S, Dh] at slots
    ``mask.query_index`` (slots ≥ S are dropped) and attend q [B, T, H, Dh] over the caches.
    ``mask`` is the cache mask after the write. Returns (attention, k_cache, v_cache)."""
    k_cache, v_cache = _write(k_cache, k, mask.query_index), _write(v_cache, v, mask.query_index)
    attn = attend(q, k_cache.astype(k.dtype), v_cache.astype(v.dtype), mask, backend, CACHED_BLOCK,
                  kv_heads_major=True)
    return attn, k_cache, v_cache
