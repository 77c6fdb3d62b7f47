"""The decode step as ``roofline.py`` compiles it: straight-line token steps, sampling mode fixed.

The real ``decode`` program takes the sampling knobs as traced arrays and picks greedy, a plain
draw or a filtered draw at run time (``lax.cond``). XLA's cost analysis charges a conditional its
costliest branch, so the one program would be charged the filtered draw even for greedy decoding.
Here the knobs are constants of the compiled program, XLA drops the branches not taken, and each
sampling mode is charged what it runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Greedy: what evaluation and ``bench_sampler.py`` run. top-p: the training rollout's sampler
# (``rollout.temperature`` 1, ``rollout.top_p`` 0.95, the paper's setting).
SAMPLING_MODES = {"greedy": (0.0, 0, 1.0), "top-p": (1.0, 0, 0.95)}


@functools.partial(jax.jit, static_argnames=("graphdef", "tokens", "sampling_mode"), donate_argnames=("cache",))
def decode_steps(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, *, tokens: int,
                 sampling_mode: str):
    """``tokens`` steps of the decode loop's body in a row, no while loop, after its once-per-call
    set-up: compiled at 1 and 2 tokens, the difference is what one more token costs."""
    from llds_jax.sampling.decode_loop import decode_program
    from llds_jax.sampling.filtering import SamplingMode

    temperature, top_k, top_p = SAMPLING_MODES[sampling_mode]
    sampling = dataclasses.replace(sampling, temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                                   top_p=jnp.float32(top_p), mode=SamplingMode.of(temperature, top_k, top_p))
    state, step = decode_program(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, width=tokens)
    for _ in range(tokens):
        state = step(state)
    return state


def decode_arguments(decoder_cfg, state, cache, mesh, batch: int) -> tuple:
    """Abstract arguments of :func:`decode_steps` (and of the real ``decode``) on a one-device mesh."""
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
    return (params, arr((batch, decoder_cfg.vocab_size), jnp.float32), cache, arr((batch,), jnp.bool_),
            arr((batch,), jnp.int32), arr(keys.shape, keys.dtype), arr((batch,), jnp.int32), sampling)
