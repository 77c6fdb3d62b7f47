"""JAX sampler over the models' paged KV cache: decode slots (``slots.SlotSession``) and its one decode program.

Public API::

    from llds_jax.sampling import generate, GenerateOutput, FinishReason
    generate(model, input_ids, attention_mask, *, max_new_tokens, temperature=1.0, top_p=1.0,
             top_k=0, stop_strings=(), stop_token_ids=(), key, tokenizer=None, pad_id=0)
        -> GenerateOutput(tokens [B, max_new_tokens], logprobs [B, max_new_tokens],
                          lengths [B], finish [B])   # numpy

``model`` is a ``Decoder`` or an ``nnx.split`` ``(graphdef, params)`` pair. ``temperature=0``
is greedy. Stop strings are matched on the bytes of the sampled ids while decoding and
need ``tokenizer=`` (or a prebuilt ``StopStringTable``).

Lower level, for multi-turn callers (the rollout engine, ``rollout/engine.py``):
``slots.SlotSession`` (reset / append a prompt, history or feedback / start an action / decode
segments / cut), whose decode program is ``slots.decode_segment`` over ``decode_loop.token_step``;
``decode_loop.SamplingParams`` (its static ``filtering.SamplingMode``), ``stop_strings.build_stop_table``,
``token_bytes.vocab_bytes``.
"""

from llds_jax.sampling.decode_loop import DecodeState, FinishReason, SamplingParams
from llds_jax.sampling.filtering import SamplingMode
from llds_jax.sampling.generate import GenerateOutput, generate
from llds_jax.sampling.slots import bucket
from llds_jax.sampling.stop_strings import StopStringTable, build_stop_table
from llds_jax.sampling.token_bytes import vocab_bytes

__all__ = [
    "DecodeState",
    "FinishReason",
    "GenerateOutput",
    "SamplingMode",
    "SamplingParams",
    "StopStringTable",
    "bucket",
    "build_stop_table",
    "generate",
    "vocab_bytes",
]
