"""Read a llama.cpp GGUF file as an HF-style config dict plus HF-named numpy tensors.

Dequantisation uses the ``gguf`` package (numpy only, no torch). Converting to HF
names and layouts here lets one loader (``checkpoint_io``) serve both formats.

The one non-obvious step: llama.cpp's converter permutes the rows of Llama's q and k
projections (it interleaves the two RoPE halves per head, to suit its own rotary
kernel). HF and we use the "rotate half" layout, so those rows are permuted back.
Qwen2/Qwen3 GGUFs are written without that permutation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from llds_jax.models.config import ConfigError
from llds_jax.models.safetensors_io import CheckpointError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def undo_llama_qk_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows (head, pair, 2) back to (head, 2, pair)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path``, parsed once per file version.

    The weights and the tokenizer read the same file, and parsing its metadata (≈ 100k
    vocabulary strings, one memmap slice each) takes 2.3 s for SmolLM2; the reader only maps
    the file, so keeping the last two costs no memory.
    """
    path = Path(path)
    try:
        stat = path.resolve().stat()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the GGUF file ({err})") from err
    return _open_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises bare ValueError/struct errors on damage
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from err


def gguf_config(path: str | Path) -> dict:
    """The HF-style config dict of a GGUF file, from its metadata and tensor shapes alone
    (no tensor is read): what the planner needs to size a run."""
    path = Path(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: general.architecture={arch!r}; supported {SUPPORTED_ARCHITECTURES}")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported for GGUF")
    # GGUF lists a tensor's dimensions innermost first: token_embd's are (hidden, vocab).
    shapes = {tensor.name: tuple(int(n) for n in reversed(tensor.shape.tolist())) for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    vocab, hidden = shapes["token_embd.weight"]
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    return {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }


def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF-style config dict, HF tensor name → fp32 array) for a GGUF file."""
    import gguf

    path = Path(path)
    config = gguf_config(path)
    reader = open_gguf(path)
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise CheckpointError(f"{path}: unexpected GGUF tensor {name!r}")
            hf_name = f"model.layers.{int(index)}.{_LAYER_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise ConfigError(f"{path}: tensor rope_freqs.weight (llama3 RoPE scaling) is not supported")
        else:
            raise CheckpointError(f"{path}: unexpected GGUF tensor {name!r}")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[hf_name] = np.asarray(array, np.float32)
    if config["model_type"] == "llama":
        for i in range(config["num_hidden_layers"]):
            for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
                name = f"model.layers.{i}.self_attn.{proj}.weight"
                if name in tensors:  # absence is reported by the loader, with the name
                    tensors[name] = undo_llama_qk_permutation(tensors[name], heads)
    return config, tensors
