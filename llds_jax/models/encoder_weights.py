"""HF BERT safetensors → `BertEncoder`, without torch and without random initialisation.

The model is built abstractly (``nnx.eval_shape``) and every parameter is filled from the
checkpoint, so a missing or misshapen tensor is an error naming the key and the file, never
a silently random weight. Names follow HF ``BertModel``; checkpoints saved from task heads
(``bert.`` prefix) and old TF ports (LayerNorm ``gamma``/``beta``) are accepted too.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from llds_jax.models.encoder import BertConfig, BertEncoder

# HF tensors an encoder-only retriever does not use.
IGNORED_KEYS = re.compile(r"^(bert\.)?(pooler\.|embeddings\.position_ids$)|^cls\.")


def hf_key(path: tuple) -> tuple[str, bool]:
    """(HF key, transpose?) for one of our parameter paths; Linear kernels are stored transposed by HF."""
    *modules, leaf = (str(p) for p in path)
    name = ".".join(modules)
    name = re.sub(r"^layers\.(\d+)\.", r"encoder.layer.\1.", name)
    name = name.replace(".self_attention.", ".self.").replace(".intermediate", ".intermediate.dense")
    hf_leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}[leaf]
    return f"{name}.{hf_leaf}", leaf == "kernel"


def _find(tensors: dict[str, np.ndarray], key: str) -> str | None:
    """The key as stored: plain, with a ``bert.`` prefix, or with TF-style LayerNorm names."""
    candidates = [key, "bert." + key]
    if ".LayerNorm." in key:
        tf_name = key.replace(".weight", ".gamma").replace(".bias", ".beta")
        candidates += [tf_name, "bert." + tf_name]
    return next((c for c in candidates if c in tensors), None)


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (only safetensors checkpoints are supported)")
    return files


def load_bert_encoder(model_dir: str | Path, dtype=jnp.float32) -> BertEncoder:
    """``config.json`` + ``*.safetensors`` of an HF BERT directory → a ready `BertEncoder`."""
    model_dir = Path(model_dir)
    cfg = BertConfig.from_json_file(model_dir / "config.json")
    tensors: dict[str, np.ndarray] = {}
    for file in safetensors_files(model_dir):
        tensors.update(load_file(file))
    source = ", ".join(str(f) for f in safetensors_files(model_dir))

    abstract = nnx.eval_shape(lambda: BertEncoder(cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    used: set[str] = set()
    filled = []
    for path, variable in nnx.to_flat_state(abstract_state):
        key, transpose = hf_key(path)
        stored = _find(tensors, key)
        if stored is None:
            raise KeyError(f"{source}: missing tensor '{key}' (for parameter {'.'.join(map(str, path))})")
        array = tensors[stored].T if transpose else tensors[stored]
        if array.shape != variable.shape:
            raise ValueError(f"{source}: tensor '{stored}' has shape {array.shape}, expected {variable.shape}")
        used.add(stored)
        filled.append((path, variable.replace(jnp.asarray(array, dtype=variable.dtype))))
    unexpected = sorted(k for k in tensors if k not in used and not IGNORED_KEYS.search(k))
    if unexpected:
        raise ValueError(f"{source}: tensors the BERT encoder does not use: {unexpected[:8]}")
    return nnx.merge(graphdef, nnx.from_flat_state(filled))
