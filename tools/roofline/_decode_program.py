"""The decode step as ``roofline.py`` compiles it: the rollout engine's token step over the paged KV
cache, in straight-line steps with the sampling mode fixed, or in the engine's own segment loop.

The engine's program (``sampling/slots.py::decode_segment``) takes the sampling knobs as traced
arrays with the static mode ``SamplingParams.create`` derives from them. Here the knobs are
constants of the compiled program as well, so XLA folds what they decide and each sampling mode is
charged what it runs.

The cache is the engine's: per layer a k and a v pool of ``CACHED_BLOCK``-slot blocks on one device,
every row's block table covering ``slots`` cache slots and the pool holding every row's blocks (as
``SlotSession`` sizes it when no smaller pool is asked for). The step is ``decode_loop.token_step``,
the one ``decode_segment`` runs, with the per-call work (the layer weight slices) done once before
the steps, as the session does once per policy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from llds_jax.sampling.slots import DECODE_COMPILER_OPTIONS

# Greedy: what evaluation and ``bench_sampler.py`` run. top-p: the training rollout's sampler
# (``rollout.temperature`` 1, ``rollout.top_p`` 0.95, the paper's setting).
SAMPLING_MODES = {"greedy": (0.0, 0, 1.0), "top-p": (1.0, 0, 0.95)}


def fixed_sampling(sampling, sampling_mode: str):
    """``sampling`` with ``sampling_mode``'s knobs as constants and the static mode they need."""
    from llds_jax.sampling.filtering import SamplingMode

    temperature, top_k, top_p = SAMPLING_MODES[sampling_mode]
    return dataclasses.replace(sampling, temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                               top_p=jnp.float32(top_p), mode=SamplingMode.of(temperature, top_k, top_p))


def engine_step(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, *, width: int):
    """(the initial ``DecodeState``, the one-token step) of the engine's decode at the start of an
    action: buffers of ``width`` columns, rows in ``done`` frozen, the layer weights sliced once.
    To trace inside a jit."""
    from flax import nnx

    from llds_jax.sampling.decode_loop import DecodeState, FinishReason, token_step

    model = nnx.merge(graphdef, params)
    layer_weights = model.layer_weights()
    batch = logits.shape[0]
    pad_id = jnp.int32(0)
    budget = jnp.minimum(budget.astype(jnp.int32), width)
    state = DecodeState(
        tokens=jnp.full((batch, width), pad_id, jnp.int32), logprobs=jnp.zeros((batch, width), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32), done=done | (budget <= 0),
        finish=jnp.full((batch,), FinishReason.CAP, jnp.int32),
        stop_state=jnp.zeros((batch, sampling.stop_table.shape[0]), jnp.int8), logits=logits,
        cache=cache, step=jnp.zeros((), jnp.int32), keys=keys, drawn=drawn.astype(jnp.int32))
    return state, token_step(model, layer_weights, sampling, budget, pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "tokens", "sampling_mode"), donate_argnames=("cache",),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def decode_steps(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, *, tokens: int,
                 sampling_mode: str):
    """``tokens`` engine token steps in a row, no while loop, after the once-per-call set-up:
    compiled at 1 and 2 tokens, the difference is what one more token costs."""
    state, step = engine_step(graphdef, params, logits, cache, done, budget, keys, drawn,
                              fixed_sampling(sampling, sampling_mode), width=tokens)
    for _ in range(tokens):
        state = step(state)
    return state


@functools.partial(jax.jit, static_argnames=("graphdef", "width"), donate_argnames=("cache",),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def engine_segment(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, *, width: int):
    """The engine's real decode program: ``slots.decode_segment`` (traced knobs, its segment loop
    and chunks of ``STOP_CHECK_EVERY`` tokens) for one action of up to ``width`` tokens per row, its
    body traced inside this program (jax takes compiler options at the top-level jit only: this one
    carries the engine's)."""
    from flax import nnx

    from llds_jax.sampling.slots import decode_segment

    state, _ = engine_step(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, width=width)
    layer_weights = nnx.merge(graphdef, params).layer_weights()
    return decode_segment.__wrapped__(graphdef, params, layer_weights, state, jnp.ones_like(done), done, budget,
                                      sampling, steps=width)


def paged_cache(decoder_cfg, batch: int, slots: int, mesh):
    """An abstract ``PagedKVCache`` on a one-device mesh: each row's table covers ``slots`` cache
    slots (rounded up to ``CACHED_BLOCK``-slot blocks), the pool holds every row's blocks, in the
    compute dtype (the engine's pools, ``init_paged_pools``)."""
    from llds_jax.models import PagedKVCache
    from llds_jax.models.attention import CACHED_BLOCK

    here = jax.NamedSharding(mesh, jax.P())
    columns = -(-slots // CACHED_BLOCK)
    pool = jax.ShapeDtypeStruct((1, batch * columns, decoder_cfg.num_kv_heads, CACHED_BLOCK, decoder_cfg.head_dim),
                                jnp.dtype(decoder_cfg.dtype), sharding=here)
    layers = decoder_cfg.num_layers
    return PagedKVCache(k=(pool,) * layers, v=(pool,) * layers,
                        table=jax.ShapeDtypeStruct((batch, columns), jnp.int32, sharding=here),
                        end=jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=here))


def decode_arguments(decoder_cfg, state, cache, mesh, batch: int) -> tuple:
    """Abstract arguments of :func:`decode_steps` (and of :func:`engine_segment`) on a one-device mesh."""
    from llds_jax.sampling.decode_loop import SamplingParams

    replicated = jax.NamedSharding(mesh, jax.P())

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    stop_states = 16  # stop_strings._STATE_BUCKET: "</search>", "</answer>" fit one bucket
    sampling = SamplingParams(arr((), jnp.float32), arr((), jnp.int32), arr((), jnp.float32),
                              arr((8,), jnp.int32), arr((2, stop_states, decoder_cfg.vocab_size), jnp.int8))
    # The learner hands the sampler its weights cast to the compute dtype once per policy
    # (``models.params_in_compute_dtype``); fp32 masters here would charge a cast per token.
    compute = jnp.dtype(decoder_cfg.dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, compute if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=x.sharding), state.params)
    return (params, arr((batch, decoder_cfg.vocab_size), compute), cache, arr((batch,), jnp.bool_),
            arr((batch,), jnp.int32), arr(keys.shape, keys.dtype), arr((batch,), jnp.int32), sampling)
