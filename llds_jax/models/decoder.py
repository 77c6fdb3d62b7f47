"""Decoder: one Flax NNX implementation for Qwen2 / Qwen2.5 / Qwen3 / Llama.

Layer weights are stored stacked along a leading ``layers`` axis whether or not the
forward scans, so the parameter tree, its shardings and checkpoints do not depend on
``scan_layers``; the block itself is a pure function of one layer's arrays.

Two entry points share that block:
* ``__call__`` / ``hidden_states``: full-sequence forward, positions from the mask.
* ``forward_cached``: writes new tokens' keys/values into a ``KVCache`` at per-row
  offsets and attends over the cache, covering prefill of a left-padded batch,
  one-token decode, and appending a chunk (tool feedback) to a live cache. It always
  unrolls the layers (see there), whatever ``scan_layers`` says.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from llds_jax.models import layers as L
from llds_jax.models.attention import (
    ATTENTION_RESIDUALS,
    DEFAULT_BLOCK,
    KV_CACHE_AXES,
    AttentionMask,
    attend,
    attend_cached,
    resolve_backend,
    resolve_paged_backend,
    target_platform,
)
from llds_jax.models.attention.mask import segment_positions
from llds_jax.models.attention.paged import attend_paged
from llds_jax.models.config import DecoderConfig
from llds_jax.models.paged_cache import PagedKVCache
from llds_jax.parallel.rules import ShardingRules, constrain, logical_to_sharding

INIT_STD = 0.02  # HF initializer_range default for these families


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Decode state for ``Decoder.forward_cached`` over a dense cache: the reference the rollout's
    paged cache (``PagedKVCache``) and its decode kernels are checked against bit for bit. No
    sampler or rollout path runs on it (``docs/decisions.md``: one KV layout).

    k, v: one entry per layer, each [batch, kv_heads, slots, head_dim] — per layer so a
    step updates and reads each layer's buffer in place (a stacked [layers, ...] array
    is sliced, i.e. copied, per layer), heads-major so attention reads a block of slots
    without transposing the cache. ``valid`` [batch, slots] marks slots holding real
    tokens (left padding and holes are False). ``end`` [batch] is the next slot to write
    per row. Slot order is time order: a token sees valid slots at or before its own
    slot. Writes past the last slot are dropped, so size ``max_len`` for the longest row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    end: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def next_positions(self) -> jax.Array:
        """RoPE position of the next real token per row: the count of valid slots."""
        return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)

    def layer_arrays(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(k, v): each layer's keys and values, [batch, kv_heads, slots, head_dim]."""
        return self.k, self.v


def cache_logical_axes(cache: KVCache) -> KVCache:
    """A KVCache of logical-axis tuples, one per buffer of ``cache`` (arrays or shapes)."""
    return KVCache(k=tuple(KV_CACHE_AXES for _ in cache.k), v=tuple(KV_CACHE_AXES for _ in cache.v),
                   valid=("batch", "cache_seq"), end=("batch",))


def init_cache(config: DecoderConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache; under ``jax.set_mesh`` it is laid out by the rules table."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)

    def empty():
        return tuple(constrain(jnp.zeros(shape, dtype), KV_CACHE_AXES) for _ in range(config.num_layers))

    return KVCache(k=empty(), v=empty(), valid=constrain(jnp.zeros((batch, max_len), bool), ("batch", "cache_seq")),
                   end=jnp.zeros((batch,), jnp.int32))


def cache_shardings(config: DecoderConfig, batch: int, max_len: int, mesh: jax.sharding.Mesh,
                    rules: ShardingRules | None = None, dtype: Any = None) -> KVCache:
    """A KVCache of NamedShardings (for ``jax.jit(in_shardings=/out_shardings=)``)."""
    with jax.set_mesh(mesh):
        shapes = jax.eval_shape(lambda: init_cache(config, batch, max_len, dtype))
    return jax.tree.map(lambda axes, leaf: logical_to_sharding(axes, mesh, rules, leaf.shape),
                        cache_logical_axes(shapes), shapes,
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x))


# Gathered by token id: the gradient is a scatter-add over every occurrence of a token.
LOOKUP_TABLES = ("embed",)


@functools.partial(jax.jit, static_argnames=("dtype", "keep_lookup_tables"))
def params_in_compute_dtype(params, dtype, *, keep_lookup_tables: bool = False) -> Any:
    """The floating leaves of ``params`` wider than ``dtype`` cast to it (the others as they are).

    With fp32 master weights and bf16 compute, every use casts the weights: inside a decode
    loop that cast runs per token (seen in the XLA:GPU/TPU programs: a 622 MB convert of
    Qwen2.5-3B's embedding inside the loop body), inside an update per micro-batch, in the
    forward, its remat and the backward. Cast once per policy (sampling) or per optimizer
    update (training) instead; the values are the same casts, so the numbers are identical.
    Narrower leaves (bf16 reference weights under fp32 compute) are left alone: the model
    widens them per use anyway, and a widened copy would only cost memory.

    ``keep_lookup_tables`` (for differentiating): the embedding table stays in its master
    dtype. Its gradient sums over every occurrence of a token; from a bf16 table those sums
    would run in bf16, while the model's per-use cast (of the gathered rows, and of the tied
    head) sums them in the master dtype. Every other gradient is the same either way: a
    cast's transpose is the reverse cast.
    """
    dtype = jnp.dtype(dtype)

    def cast(path, x):
        kept = keep_lookup_tables and getattr(path[0], "key", None) in LOOKUP_TABLES
        narrower = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dtype.itemsize
        return x.astype(dtype) if narrower and not kept else x

    return jax.tree_util.tree_map_with_path(cast, params)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """HF's convention: position = cumsum(mask) - 1, clipped at 0 (pads get 0)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def _param(key, shape, dtype, axes, *, std=INIT_STD):
    return nnx.Param(std * jax.random.normal(key, shape, dtype), logical_axes=axes)


def _ones(shape, dtype, axes):
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


class DecoderLayers(nnx.Module):
    """All transformer blocks' weights, stacked on a leading ``layers`` axis.

    Projections are kept in head-split layouts ([embed, heads, head_dim]) so heads can
    be sharded on the tensor axis without reshapes of sharded dimensions.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        n, d, f = config.num_layers, config.hidden_size, config.intermediate_size
        h, kvh, hd = config.num_heads, config.num_kv_heads, config.head_dim
        dt = config.weight_dtype
        self.attn_norm = _ones((n, d), dt, ("layers", "norm"))
        self.q_proj = _param(rngs.params(), (n, d, h, hd), dt, ("layers", "embed", "q_heads", "head_dim"))
        self.k_proj = _param(rngs.params(), (n, d, kvh, hd), dt, ("layers", "embed", "kv_heads", "head_dim"))
        self.v_proj = _param(rngs.params(), (n, d, kvh, hd), dt, ("layers", "embed", "kv_heads", "head_dim"))
        self.o_proj = _param(rngs.params(), (n, h, hd, d), dt, ("layers", "q_heads", "head_dim", "embed"))
        if config.qkv_bias:
            self.q_bias = _param(rngs.params(), (n, h, hd), dt, ("layers", "q_heads", "head_dim"))
            self.k_bias = _param(rngs.params(), (n, kvh, hd), dt, ("layers", "kv_heads", "head_dim"))
            self.v_bias = _param(rngs.params(), (n, kvh, hd), dt, ("layers", "kv_heads", "head_dim"))
        if config.qk_norm:
            self.q_norm = _ones((n, hd), dt, ("layers", "head_dim"))
            self.k_norm = _ones((n, hd), dt, ("layers", "head_dim"))
        self.mlp_norm = _ones((n, d), dt, ("layers", "norm"))
        self.gate_proj = _param(rngs.params(), (n, d, f), dt, ("layers", "embed", "mlp"))
        self.up_proj = _param(rngs.params(), (n, d, f), dt, ("layers", "embed", "mlp"))
        self.down_proj = _param(rngs.params(), (n, f, d), dt, ("layers", "mlp", "embed"))

    def stacked(self) -> dict[str, jax.Array]:
        """Name → stacked array for every weight this config has."""
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def _block(config: DecoderConfig, weights: dict[str, jax.Array], x: jax.Array, cos, sin, attend_kv,
           mlp=L.swiglu_mlp):
    """One pre-norm transformer block. ``attend_kv(q, k, v) -> (attention, extra)`` decides
    what the queries read: the chunk's own keys (full-sequence forward) or a KV cache the
    chunk is written into (cached forward, whose updated cache is ``extra``). ``mlp``: XLA's
    SwiGLU, or a GPU decode step's kernel (``mlp_gpu.swiglu_mlp``)."""
    dtype = config.compute_dtype
    w = {name: value.astype(dtype) for name, value in weights.items()}
    h = L.rms_norm(x, w["attn_norm"], config.rms_eps)
    q = L.project(h, w["q_proj"])
    k = L.project(h, w["k_proj"])
    v = L.project(h, w["v_proj"])
    if config.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if config.qk_norm:
        q = L.rms_norm(q, w["q_norm"], config.rms_eps)
        k = L.rms_norm(k, w["k_norm"], config.rms_eps)
    q = constrain(L.apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
    k = constrain(L.apply_rope(k, cos, sin), ("batch", "seq", "act_kv_heads", None))
    v = constrain(v, ("batch", "seq", "act_kv_heads", None))
    attn, extra = attend_kv(q, k, v)
    x = x + L.project(attn, w["o_proj"], contract=2)
    x = checkpoint_name(constrain(x, ("batch", "seq", "act_embed")), "block_mid")
    h = L.rms_norm(x, w["mlp_norm"], config.rms_eps)
    x = x + mlp(h, w["gate_proj"], w["up_proj"], w["down_proj"])
    return constrain(x, ("batch", "seq", "act_embed")), extra


# What remat="minimal" keeps per layer: the values whose recomputation would cost a matmul or the
# attention kernel (``checkpoint_name``d where they are made). Everything else, the RMSNorms,
# RoPE, SiLU·up and layout transposes, is recomputed in the backward from these and the layer's
# input. Without remat JAX keeps every intermediate, several in two layouts: SmolLM2 at 4 x 256
# saved 71 MB per layer, this 24 MB (the update's XLA:CPU temp buffer 3.50 -> 2.09 GB). Opaque
# kernels (splash, cuDNN) keep their residuals inside, so the backward reruns their forward from
# the saved q, k, v, as under "full" but without the projections.
MINIMAL_SAVED_NAMES = ("block_mid", *L.MLP_RESIDUALS, *ATTENTION_RESIDUALS)
# remat="minimal_no_gate": the same less the MLP gate projection's output (with the up projection's, the
# widest value kept), which the backward recomputes: one [tokens, hidden] x [hidden, mlp] matmul a layer
# (for chips where minimal does not fit: docs/performance.md, "the update's remat").
MINIMAL_NO_GATE_SAVED_NAMES = tuple(name for name in MINIMAL_SAVED_NAMES if name != L.GATE_RESIDUAL)


def _remat(config: DecoderConfig, fn):
    if config.remat == "none":
        return fn
    policy = {
        "full": None,
        "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "minimal": jax.checkpoint_policies.save_only_these_names(*MINIMAL_SAVED_NAMES),
        "minimal_no_gate": jax.checkpoint_policies.save_only_these_names(*MINIMAL_NO_GATE_SAVED_NAMES),
    }[config.remat]
    return jax.checkpoint(fn, policy=policy)


def _run_layers(config: DecoderConfig, stacked: dict, carry, layer_fn):
    """Apply ``layer_fn(weights, carry, layer_index) -> carry`` over layers: one scanned
    block, or an unrolled loop (full-sequence forwards; the cached forward always unrolls)."""
    layer_fn = _remat(config, layer_fn)
    if config.scan_layers:
        layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
        carry, _ = jax.lax.scan(lambda c, xs: (layer_fn(xs[0], c, xs[1]), None), carry, (stacked, layer_ids))
        return carry
    # One split per weight, not a slice per layer: the gradient of a split is one concatenate,
    # the gradients of per-layer slices are padded to the whole stack and summed.
    per_layer = jax.tree.map(lambda a: [x[0] for x in jnp.split(a, config.num_layers)], stacked)
    for i in range(config.num_layers):
        carry = layer_fn({name: layers[i] for name, layers in per_layer.items()}, carry, i)
    return carry


class Decoder(nnx.Module):
    """Decoder-only LM. ``model(input_ids, attention_mask)`` → logits [B, T, V] (fp32)."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.weight_dtype
        self.embed = _param(rngs.params(), (config.vocab_size, config.hidden_size), dt, ("vocab", "embed"))
        self.layers = DecoderLayers(config, rngs=rngs)
        self.final_norm = _ones((config.hidden_size,), dt, ("norm",))
        if not config.tie_embeddings:
            self.lm_head = _param(rngs.params(), (config.hidden_size, config.vocab_size), dt, ("embed", "vocab"))

    # -- shared pieces ---------------------------------------------------------------
    def output_head(self) -> tuple[jax.Array, bool]:
        """(table, vocab_major) for ``layers.unembed``, in compute dtype: a tied model's
        embedding [V, D] as stored (never transposed), else ``lm_head`` [D, V]."""
        if self.config.tie_embeddings:
            return self.embed[...].astype(self.config.compute_dtype), True
        return self.lm_head[...].astype(self.config.compute_dtype), False

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(self.config.compute_dtype)
        return constrain(x, ("batch", "seq", "act_embed"))

    def _rope(self, positions: jax.Array):
        inv_freq = L.rope_inverse_frequencies(
            self.config.head_dim, self.config.rope_theta, self.config.rope_scaling_dict)
        return L.rope_tables(positions, inv_freq)

    def logits_from_hidden(self, hidden: jax.Array, dtype=jnp.float32) -> jax.Array:
        """The LM head: fp32 accumulators, rounded once to ``dtype`` (fp32 by default)."""
        table, vocab_major = self.output_head()
        logits = L.unembed(hidden, table, vocab_major=vocab_major, preferred_element_type=dtype)
        return constrain(logits, ("batch", "seq", "act_vocab"))

    # -- full-sequence forward ----------------------------------------------------------
    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                      positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, D] (compute dtype), no LM head.

        Left or right padding: pads neither attend nor are attended to; positions default
        to ``cumsum(mask) - 1``. Rows of pad tokens hold meaningless values.

        ``segment_ids`` [B, T] (packed rows: several sequences per row, 0 = padding; the
        attention mask is then ``segment_ids > 0``): no token attends across segments and
        positions default to restarting at 0 with each segment, so every segment's states are
        the ones it would get alone in a row (up to the attention's summation order).
        """
        if segment_ids is not None:
            attention_mask = segment_ids > 0
            if positions is None:
                positions = segment_positions(segment_ids)
            mask = AttentionMask.packed(segment_ids)
        else:
            if attention_mask is None:
                attention_mask = jnp.ones(input_ids.shape, bool)
            attention_mask = attention_mask.astype(bool)
            if positions is None:
                positions = positions_from_mask(attention_mask)
            mask = AttentionMask.causal(attention_mask)
        cos, sin = self._rope(positions)
        backend = resolve_backend(self.config.attention, target_platform())

        def attend_chunk(q, k, v):
            return attend(q, k, v, mask, backend, DEFAULT_BLOCK), None

        def layer_fn(weights, x, _):
            return _block(self.config, weights, x, cos, sin, attend_chunk)[0]

        x = _run_layers(self.config, self.layers.stacked(), self.embed_tokens(input_ids), layer_fn)
        return L.rms_norm(x, self.final_norm[...], self.config.rms_eps)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, positions))

    # -- cached forward -----------------------------------------------------------------
    def layer_weights(self) -> tuple[dict[str, jax.Array], ...]:
        """Each layer's weights as its own arrays (static slices of the stacked ones).

        A decode loop takes these once, before the loop: slicing inside the loop body copies
        every layer's weights out of the stack on every token (measured on XLA:CPU: the
        copies took 40% of a SmolLM2 decode step).
        """
        stacked = self.layers.stacked()
        return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.config.num_layers))

    def forward_cached(self, tokens: jax.Array, cache: KVCache | PagedKVCache, token_mask: jax.Array | None = None,
                       positions: jax.Array | None = None, *, all_logits: bool = False,
                       layer_weights: tuple[dict[str, jax.Array], ...] | None = None
                       ) -> tuple[jax.Array, KVCache]:
        """Append ``tokens`` [B, T] to ``cache`` row by row and return logits.

        Row b's tokens go to slots ``cache.end[b] .. cache.end[b] + T - 1``. ``token_mask``
        [B, T] marks real tokens (False for left padding of a prefill, right padding of an
        appended chunk, or a finished row in decode); masked tokens are written as invalid
        slots. ``end`` then advances past the row's last real token (not at all for a row
        with none), so right padding is overwritten by the next write. Positions default
        to the count of valid slots before each token, which continues a row's positions
        across appends exactly as the uncached forward numbers them.

        Returns logits [B, V] in the compute dtype at each row's last real token (``all_logits``:
        [B, T, V]) and the new cache. The compute dtype, not fp32, because these are what the sampler
        draws from: the ``[rows, vocab]`` array it reads twice a token is, after the weights and the
        KV cache, a decode step's largest traffic (0.58 of 2.87 GB at Qwen2.5-0.5B × 320 rows in
        fp32), and a bf16 model's rounded head output is what transformers, vLLM (Search-R1's
        sampler) and MaxText sample from (docs/decisions.md). Log-probs for the objective come from
        ``models.logprobs`` (an fp32 head, in chunks). ``layer_weights``: :meth:`layer_weights`, when the caller hoists them.

        A :class:`~llds_jax.models.paged_cache.PagedKVCache` (rows without holes, real tokens a
        prefix of each row's chunk) is written and read through its block table
        (``attention/paged.py``); masked tokens are not written at all.
        """
        batch, length = tokens.shape
        if token_mask is None:
            token_mask = jnp.ones((batch, length), bool)
        token_mask = token_mask.astype(bool)
        if positions is None:
            positions = cache.next_positions()[:, None] + positions_from_mask(token_mask)
        slots = cache.end[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        paged = isinstance(cache, PagedKVCache)
        if not paged:
            rows = jnp.arange(batch)[:, None]
            valid = cache.valid.at[rows, slots].set(token_mask, mode="drop")
            mask = AttentionMask.cached(slots, valid)  # a key is seen iff valid and at or before the query's slot
        cos, sin = self._rope(positions)
        platform = target_platform()
        backend = (resolve_paged_backend if paged else resolve_backend)(self.config.attention, platform)
        if layer_weights is None:
            layer_weights = self.layer_weights()
        mlp = L.swiglu_mlp
        if paged and backend == "triton" and length == 1:  # a GPU decode step: its MLP kernel too
            from llds_jax.models import mlp_gpu  # noqa: PLC0415  (Pallas Triton: GPU programs only)

            if mlp_gpu.supported(self.config.hidden_size, self.config.intermediate_size):
                mlp = functools.partial(mlp_gpu.swiglu_mlp, interpret=platform not in ("gpu", "cuda", "rocm"))
        x = self.embed_tokens(tokens)
        new_k, new_v = [], []
        # Unrolled, not scanned: each layer's cache is its own buffer, updated in place, and
        # each layer's weights are their own arrays (a scan slices, i.e. copies, them per call).
        for layer, weights in enumerate(layer_weights):

            def attend_cache(q, k, v, layer=layer):
                if paged:
                    attn, k_all, v_all = attend_paged(q, k, v, cache.k[layer], cache.v[layer], cache.table, slots,
                                                      token_mask, backend)
                else:
                    attn, k_all, v_all = attend_cached(q, k, v, cache.k[layer], cache.v[layer], mask, backend)
                return attn, (k_all, v_all)

            x, (k_layer, v_layer) = _block(self.config, weights, x, cos, sin, attend_cache, mlp)
            new_k.append(k_layer)
            new_v.append(v_layer)
        hidden = L.rms_norm(x, self.final_norm[...], self.config.rms_eps)
        last_real = jnp.max(jnp.where(token_mask, jnp.arange(length)[None, :] + 1, 0), axis=-1)
        end = cache.end + last_real.astype(jnp.int32)
        if paged:
            new_cache = PagedKVCache(k=tuple(new_k), v=tuple(new_v), table=cache.table, end=end)
        else:
            new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid, end=end)
        dtype = self.config.compute_dtype
        if all_logits:
            return self.logits_from_hidden(hidden, dtype), new_cache
        last_hidden = jnp.take_along_axis(hidden, jnp.maximum(last_real - 1, 0)[:, None, None], axis=1)
        return self.logits_from_hidden(last_hidden, dtype)[:, 0], new_cache
