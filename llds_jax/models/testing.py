"""Tiny configs and randomly initialised models for tests across the project.

Sizes are small enough to compile in seconds on a 2-core CPU yet keep every switch
that distinguishes the families (GQA with 2 query heads per KV head, biases, q/k norm,
tied vs untied head), and every dimension divides the 8-device test meshes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models.config import DecoderConfig
from llds_jax.models.decoder import INIT_STD, Decoder
from llds_jax.parallel.placement import iter_params

_TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, rope_theta=10000.0, rms_eps=1e-6, max_position_embeddings=512)

_FAMILIES = {
    "qwen2": dict(family="qwen2", qkv_bias=True, tie_embeddings=True, rope_theta=1000000.0),
    "qwen2_untied": dict(family="qwen2", qkv_bias=True, tie_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(family="qwen3", qk_norm=True, tie_embeddings=True, rope_theta=1000000.0),
    "llama": dict(family="llama", tie_embeddings=True, rms_eps=1e-5),
}

TINY_FAMILIES = tuple(_FAMILIES)


def tiny_config(family: str = "qwen2", **overrides) -> DecoderConfig:
    """A 2-layer, width-64, vocab-256 config of ``family`` (see TINY_FAMILIES)."""
    if family not in _FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {TINY_FAMILIES}")
    return DecoderConfig(**{**_TINY, **_FAMILIES[family], **overrides})


def tiny_model(family: str = "qwen2", seed: int = 0, **overrides) -> Decoder:
    """A randomly initialised tiny ``Decoder``: weights ~ N(0, 0.02), norms 1.

    Values come from numpy's generator into an abstract model: eager ``jax.random``
    compiles once per distinct shape (seconds each on a busy 2-core CI box), and tests
    build many tiny models. Same seed, same weights.
    """
    config = tiny_config(family, **overrides)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for name, var in iter_params(model):
        if name.rsplit(".", 1)[-1].endswith("norm"):
            value = np.ones(var.shape, np.float32)
        else:
            value = INIT_STD * rng.standard_normal(var.shape, dtype=np.float32)
        var.set_value(jnp.asarray(value, dtype=config.weight_dtype))
    return model
