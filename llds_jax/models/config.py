"""DecoderConfig: the one description of a Qwen2 / Qwen2.5 / Qwen3 / Llama decoder.

The families differ only in switches (QKV bias, per-head q/k RMSNorm, tied embeddings,
RoPE scaling), so one config drives one implementation. ``from_hf_config`` reads a
Hugging Face ``config.json`` (transformers 4 layout with ``rope_theta``/``rope_scaling``
or transformers 5 layout with ``rope_parameters``) and names the field it cannot honour.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from llds_jax.errors import InputError

FAMILIES = ("qwen2", "qwen3", "llama")
REMAT_POLICIES = ("none", "full", "dots_saveable", "nothing_saveable", "minimal", "minimal_no_gate")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_BACKENDS = ("auto", "xla_blockwise", "splash", "cudnn", "naive")  # see models/attention

_MODEL_TYPE_TO_FAMILY = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama"}
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


class ConfigError(InputError):
    """A config field we cannot honour; the message names the field and its value."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and switches of a decoder-only transformer.

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in SUPPORTED_ROPE_TYPES plus
    that type's parameters (HF names). ``dtype`` is the compute/activation dtype,
    ``param_dtype`` the stored weight dtype. ``scan_layers`` compiles one block and scans
    it over the stacked layer weights (weights are stacked either way, so checkpoints and
    shardings do not depend on this switch). ``remat`` is the per-layer checkpoint policy.
    ``attention`` names the attention kernel (ATTENTION_BACKENDS; ``models.attention``
    explains each); it is not part of the HF config, so a round trip resets it to "auto".
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    family: str = "qwen2"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | dict[str, Any] | None = None
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    scan_layers: bool = True
    remat: str = "none"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"

    def __post_init__(self):
        # Stored hashable: the config is static metadata of the NNX graph, so jit hashes it.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention={self.attention!r}: expected one of {ATTENTION_BACKENDS}")
        if self.attention == "cudnn" and self.dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"attention='cudnn' with dtype={self.dtype!r}: cuDNN's fused attention takes "
                              f"bfloat16/float16 only (use 'auto', which runs float32 blockwise)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head dimension")
        for field in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, field))
            except TypeError as err:
                raise ConfigError(f"{field}={getattr(self, field)!r} is not a dtype") from err
        if self.rope_scaling is not None:
            kind = self.rope_scaling_dict.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"rope_scaling.rope_type={kind!r}: supported {SUPPORTED_ROPE_TYPES}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides) -> DecoderConfig:
        """Build from an HF config dict, a ``config.json`` path, or a directory holding one."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"no HF config at {path}")
            try:
                hf = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: not valid JSON ({err})") from err
        else:
            hf = dict(source)
        model_type = hf.get("model_type")
        if model_type not in _MODEL_TYPE_TO_FAMILY:
            raise ConfigError(
                f"model_type={model_type!r}: supported {sorted(_MODEL_TYPE_TO_FAMILY)}")
        family = _MODEL_TYPE_TO_FAMILY[model_type]
        for required in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                         "intermediate_size"):
            if required not in hf:
                raise ConfigError(f"HF config field {required!r} is missing")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _read_rope(hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is implemented")
        if family == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window") and family != "llama":
            raise ConfigError("use_sliding_window=True is not supported (full attention only)")
        values = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=hf["intermediate_size"], family=family, rope_theta=rope_theta,
            rope_scaling=rope_scaling, rms_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
            qk_norm=family == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        )
        values.update(overrides)
        return cls(**values)

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` transformers 5 reads back into an equivalent model."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling_dict)
            rope["rope_theta"] = self.rope_theta
        hf = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "dtype": self.param_dtype,
        }
        if self.family != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            hf["mlp_bias"] = False
        else:
            hf["use_sliding_window"] = False
        return hf


def _read_rope(hf: dict) -> tuple[float, dict | None]:
    """RoPE theta and scaling from either transformers layout.

    transformers 5 moved ``rope_theta`` into ``rope_parameters`` together with the
    scaling type; transformers 4 kept ``rope_theta`` top-level and ``rope_scaling`` apart.
    """
    params = hf.get("rope_parameters")
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling.rope_type={kind!r}: supported {SUPPORTED_ROPE_TYPES}")
        scaling["rope_type"] = kind
        scaling.pop("type", None)
    return float(theta), scaling
