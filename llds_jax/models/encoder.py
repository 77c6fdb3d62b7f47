"""A BERT-family text encoder in Flax NNX (E5, BGE, MiniLM all share this layout).

Self-contained on purpose: the decoder's layers (RMSNorm, RoPE, GQA) share nothing with
BERT's post-LayerNorm, learned absolute positions and full bidirectional attention, and
the retrieval service must not import the policy model. Parameter names mirror HF's
``BertModel`` so `llds_jax.models.encoder_weights` maps safetensors keys one to one.

Numerics follow transformers' ``BertModel`` (the parity reference, ≤1e-4 in fp32):
exact-erf GELU, LayerNorm eps from the config, padded keys masked with the dtype's most
negative value before the softmax.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

POOLING_METHODS = ("mean", "cls")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The subset of HF ``config.json`` that determines the computation."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported; expected one of {sorted(_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config") -> BertConfig:
        if hf.get("model_type", "bert") != "bert":  # RoBERTa offsets positions by padding_idx + 1
            raise ValueError(f"{source}: model_type {hf.get('model_type')!r} is not a BERT-layout encoder")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{source}: position_embedding_type {hf['position_embedding_type']!r} not supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = [name for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "intermediate_size") if name not in hf]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        return cls(**{k: v for k, v in hf.items() if k in fields})

    @classmethod
    def from_json_file(cls, path: str | Path) -> BertConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()), source=str(path))


_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        self.word_embeddings = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        positions = jnp.arange(input_ids.shape[1])[None, :]
        summed = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(summed)


class BertSelfAttention(nnx.Module):
    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        linear = lambda: nnx.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.query, self.key, self.value = linear(), linear(), linear()

    def __call__(self, x: jax.Array, key_bias: jax.Array) -> jax.Array:
        batch, length, _ = x.shape
        split = lambda t: t.reshape(batch, length, self.num_heads, self.head_dim)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim) + key_bias
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, -1)


class BertAttention(nnx.Module):
    """HF nests ``attention.self`` and ``attention.output``; ``self`` is a keyword here, hence the alias."""

    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        self.self_attention = BertSelfAttention(cfg, dtype, rngs)
        self.output = BertResidualOutput(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps, dtype, rngs)

    def __call__(self, x: jax.Array, key_bias: jax.Array) -> jax.Array:
        return self.output(self.self_attention(x, key_bias), x)


class BertResidualOutput(nnx.Module):
    """``LayerNorm(residual + dense(x))``: BERT is post-norm, unlike the pre-norm decoder."""

    def __init__(self, in_features: int, hidden: int, eps: float, dtype, rngs: nnx.Rngs):
        self.dense = nnx.Linear(in_features, hidden, dtype=dtype, rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(hidden, epsilon=eps, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nnx.Module):
    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        self.attention = BertAttention(cfg, dtype, rngs)
        self.intermediate = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.output = BertResidualOutput(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps, dtype, rngs)
        self.activation = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array, key_bias: jax.Array) -> jax.Array:
        attended = self.attention(x, key_bias)
        return self.output(self.activation(self.intermediate(attended)), attended)


class BertEncoder(nnx.Module):
    """Token ids → last hidden states ``[batch, length, hidden]``; no pooler (retrievers pool themselves)."""

    def __init__(self, cfg: BertConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, dtype, rngs)
        self.layers = nnx.List([BertLayer(cfg, dtype, rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        hidden = self.embeddings(input_ids, token_type_ids)
        key_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        for layer in self.layers:
            hidden = layer(hidden, key_bias)
        return hidden


def pool(hidden: jax.Array, attention_mask: jax.Array, method: str = "mean", normalize: bool = True) -> jax.Array:
    """Sentence vectors: masked mean (E5, MiniLM) or the [CLS] state (BGE), then optional L2 norm.

    Pooling runs in fp32 whatever the model dtype: the sum over up to 512 tokens is where
    bf16 would lose the digits the faiss inner product compares.
    """
    hidden = hidden.astype(jnp.float32)
    if method == "mean":
        mask = attention_mask[..., None].astype(jnp.float32)
        vectors = (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    elif method == "cls":
        vectors = hidden[:, 0]
    else:
        raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {method!r}")
    if normalize:
        vectors = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return vectors
