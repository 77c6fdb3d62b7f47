"""HF checkpoint I/O: ``from_pretrained`` (safetensors dir or GGUF file) and ``save_pretrained``.

One table, ``_weight_specs``, states how each of our parameters maps to HF tensors
(name template, per-layer or global, layout change), and both directions are derived
from it. HF stores projections as ``[out, in]`` matrices; we keep head-split
``[in, heads, head_dim]`` layouts, so loading transposes and reshapes per layer.

With a mesh, each parameter is built with ``jax.make_array_from_callback``: a device
asks only for its shard, which is cut from memory-mapped per-layer tensors, so the
full stacked fp32 weight never has to exist on the host.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models.config import DecoderConfig
from llds_jax.models.decoder import Decoder
from llds_jax.models.safetensors_io import CheckpointError, read_checkpoint_dir, write_safetensors
from llds_jax.parallel.placement import iter_params
from llds_jax.parallel.rules import ShardingRules, current_rules

# Present in some HF checkpoints, never needed: RoPE tables are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _WeightSpec:
    """Our parameter ``ours`` ← HF tensor ``hf`` (``{i}`` = layer index when ``per_layer``)."""

    ours: str
    hf: str
    per_layer: bool
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _weight_specs(cfg: DecoderConfig) -> list[_WeightSpec]:
    """The mapping, with layout changes written as ``.T``/``.reshape`` only, so they apply to
    numpy memmaps and to abstract arrays alike (shapes are checked without allocating)."""
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = lambda a: a
    transpose = lambda a: a.T

    def heads_in(heads):  # HF [heads*hd, d] <-> ours [d, heads, hd]
        return (lambda a: a.T.reshape(d, heads, hd), lambda a: a.reshape(d, heads * hd).T)

    def bias(heads):
        return (lambda a: a.reshape(heads, hd), lambda a: a.reshape(heads * hd))

    attn = "model.layers.{i}.self_attn"
    mlp = "model.layers.{i}.mlp"
    specs = [
        _WeightSpec("embed", "model.embed_tokens.weight", False, same, same),
        _WeightSpec("final_norm", "model.norm.weight", False, same, same),
        _WeightSpec("layers.attn_norm", "model.layers.{i}.input_layernorm.weight", True, same, same),
        _WeightSpec("layers.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", True, same, same),
        _WeightSpec("layers.q_proj", f"{attn}.q_proj.weight", True, *heads_in(h)),
        _WeightSpec("layers.k_proj", f"{attn}.k_proj.weight", True, *heads_in(kvh)),
        _WeightSpec("layers.v_proj", f"{attn}.v_proj.weight", True, *heads_in(kvh)),
        _WeightSpec("layers.o_proj", f"{attn}.o_proj.weight", True,
                    lambda a: a.T.reshape(h, hd, d), lambda a: a.reshape(h * hd, d).T),
        _WeightSpec("layers.gate_proj", f"{mlp}.gate_proj.weight", True, transpose, transpose),
        _WeightSpec("layers.up_proj", f"{mlp}.up_proj.weight", True, transpose, transpose),
        _WeightSpec("layers.down_proj", f"{mlp}.down_proj.weight", True, transpose, transpose),
    ]
    if not cfg.tie_embeddings:
        specs.append(_WeightSpec("lm_head", "lm_head.weight", False, transpose, transpose))
    if cfg.qkv_bias:
        specs += [
            _WeightSpec("layers.q_bias", f"{attn}.q_proj.bias", True, *bias(h)),
            _WeightSpec("layers.k_bias", f"{attn}.k_proj.bias", True, *bias(kvh)),
            _WeightSpec("layers.v_bias", f"{attn}.v_proj.bias", True, *bias(kvh)),
        ]
    if cfg.qk_norm:
        specs += [
            _WeightSpec("layers.q_norm", f"{attn}.q_norm.weight", True, same, same),
            _WeightSpec("layers.k_norm", f"{attn}.k_norm.weight", True, same, same),
        ]
    return specs


def _hf_names(spec: _WeightSpec, num_layers: int) -> list[str]:
    return [spec.hf.format(i=i) for i in range(num_layers)] if spec.per_layer else [spec.hf]


def _check_tensors(source: str, cfg: DecoderConfig, specs, tensors: dict, abstract: dict) -> None:
    """Missing, unexpected and mis-shaped tensors, all reported with their names."""
    wanted = {name for spec in specs for name in _hf_names(spec, cfg.num_layers)}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    tolerated = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unexpected = sorted(n for n in set(tensors) - wanted - tolerated if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {unexpected[:8]}" +
                              (" ..." if len(unexpected) > 8 else ""))
    for spec in specs:
        want_shape = abstract[spec.ours].shape[1:] if spec.per_layer else abstract[spec.ours].shape
        hf_shape = jax.eval_shape(spec.to_hf, jax.ShapeDtypeStruct(want_shape, jnp.float32)).shape
        for name in _hf_names(spec, cfg.num_layers):
            if tuple(tensors[name].shape) != hf_shape:
                raise CheckpointError(
                    f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config implies {hf_shape}")


def _load_param(spec: _WeightSpec, tensors: dict, cfg: DecoderConfig, shape, dtype, sharding):
    def layer(i):
        return np.asarray(spec.to_ours(tensors[spec.hf.format(i=i)]), dtype)

    if sharding is None:
        if spec.per_layer:
            return jnp.asarray(np.stack([layer(i) for i in range(cfg.num_layers)]))
        return jnp.asarray(np.asarray(spec.to_ours(tensors[spec.hf]), dtype))

    def shard(index):
        if not spec.per_layer:
            return np.ascontiguousarray(spec.to_ours(tensors[spec.hf])[index], dtype)
        layer_ids = range(cfg.num_layers)[index[0]]
        return np.stack([layer(i)[index[1:]] for i in layer_ids])

    return jax.make_array_from_callback(shape, sharding, shard)


def from_pretrained(path: str | Path, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None,
                    rules: ShardingRules | None = None, **config_overrides) -> Decoder:
    """Load an HF directory (config.json + safetensors) or a ``.gguf`` file into a Decoder.

    ``dtype`` sets both the stored and the compute dtype (override either with
    ``param_dtype=`` / ``dtype`` via ``config_overrides``). With ``mesh``, each weight lands
    directly on its rules-table sharding.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.suffix == ".gguf":
        from llds_jax.models.gguf_io import read_gguf

        hf_config, tensors = read_gguf(path)
    else:
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected an HF directory or a .gguf file")
        hf_config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None
        if hf_config is None:
            raise CheckpointError(f"{path}: config.json is missing")
        tensors = read_checkpoint_dir(path)
    overrides = {"dtype": dtype, "param_dtype": dtype, **config_overrides}
    cfg = DecoderConfig.from_hf_config(hf_config, **overrides)
    abstract_model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    abstract = dict(iter_params(abstract_model))
    specs = _weight_specs(cfg)
    _check_tensors(str(path), cfg, specs, tensors, abstract)
    rules = rules or current_rules()
    for spec in specs:
        var = abstract[spec.ours]
        sharding = None
        if mesh is not None:
            sharding = rules.sharding(var.get_metadata()["logical_axes"], mesh, var.shape)
        var.set_value(_load_param(spec, tensors, cfg, var.shape, cfg.weight_dtype, sharding))
    return abstract_model


def save_pretrained(model: Decoder, path: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads as-is."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    params = dict(iter_params(model))
    tensors = {}
    for spec in _weight_specs(cfg):
        value = np.asarray(jax.device_get(params[spec.ours].get_value()))
        if spec.per_layer:
            for i in range(cfg.num_layers):
                tensors[spec.hf.format(i=i)] = np.ascontiguousarray(spec.to_hf(value[i]))
        else:
            tensors[spec.hf] = np.ascontiguousarray(spec.to_hf(value))
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2) + "\n")
    return path
