"""GGUF import on tiny files written here the way llama.cpp's converter writes them.

The converter permutes the rows of Llama's q/k projections (``permute`` in
convert_hf_to_gguf.py: per head, rows (2, pair) -> (pair, 2)); re-implemented below
independently of our inverse, so a wrong inverse changes the logits.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.config import base_config
from llds_jax.models import from_pretrained, save_pretrained
from llds_jax.models.loading import decoder_config
from llds_jax.models.safetensors_io import read_safetensors
from llds_jax.models.testing import tiny_model

pytestmark = pytest.mark.unit

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(model, hf_dir, path, arch: str):
    cfg = model.config
    save_pretrained(model, hf_dir)
    tensors = {k: np.array(v) for k, v in read_safetensors(hf_dir / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_context_length(cfg.max_position_embeddings)
    for name, value in sorted(tensors.items()):
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_HF_TO_GGUF[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                value = llama_cpp_permute(value, cfg.num_heads)
            if arch == "llama" and rest == "self_attn.k_proj.weight":
                value = llama_cpp_permute(value, cfg.num_kv_heads)
        writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("family,arch", [("llama", "llama"), ("qwen2_untied", "qwen2")])
def test_gguf_written_like_llama_cpp_loads_to_the_same_logits(family, arch, tmp_path):
    model = tiny_model(family, seed=4)
    path = tmp_path / "model.gguf"
    write_gguf(model, tmp_path / "hf", path, arch)
    loaded = from_pretrained(path)
    assert loaded.config.tie_embeddings == model.config.tie_embeddings
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, 256)
    graphdef, _ = nnx.split(model)
    run = jax.jit(lambda s: nnx.merge(graphdef, s)(ids))
    want, got = run(nnx.state(model)), run(nnx.state(loaded))
    diff = float(jnp.max(jnp.abs(got - want)))
    assert diff <= 1e-5, f"{arch} GGUF round trip: max logit diff {diff:.3g}"


SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "tie_embeddings", "rope_theta", "rms_eps", "max_position_embeddings")


@pytest.mark.parametrize("family,arch", [("llama", "llama"), ("qwen2_untied", "qwen2")])
def test_the_planners_config_of_a_gguf_equals_the_loaded_models(family, arch, tmp_path):
    """``--mode=plan`` sizes a run from the file's metadata and tensor shapes, reading no tensor."""
    path = tmp_path / "model.gguf"
    write_gguf(tiny_model(family, seed=4), tmp_path / "hf", path, arch)
    section = base_config().model
    section.source = str(path)
    planned = decoder_config(section)
    loaded = from_pretrained(path).config
    assert {f: getattr(planned, f) for f in SHAPE_FIELDS} == {f: getattr(loaded, f) for f in SHAPE_FIELDS}


@pytest.mark.codegen_sensitive
def test_unpermuting_is_needed_for_llama(tmp_path, monkeypatch):
    """Guard against a vacuous pass: loading the permuted rows as-is must change the logits."""
    from llds_jax.models import gguf_io

    model = tiny_model("llama", seed=4)
    path = tmp_path / "model.gguf"
    write_gguf(model, tmp_path / "hf", path, "llama")
    monkeypatch.setattr(gguf_io, "undo_llama_qk_permutation", lambda weight, heads: weight)
    wrong = from_pretrained(path)
    ids = jnp.arange(7)[None, :]
    graphdef, _ = nnx.split(model)
    run = jax.jit(lambda s: nnx.merge(graphdef, s)(ids))
    diff = float(jnp.max(jnp.abs(run(nnx.state(wrong)) - run(nnx.state(model)))))
    assert diff > 1e-3, f"skipping the q/k un-permutation changed logits by only {diff:.3g}"


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"general.architecture='gpt2'"):
        from_pretrained(path)


def test_damaged_gguf_is_reported_with_its_path(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        from_pretrained(path)
