"""Damaged or mismatched checkpoints fail with a message naming the file, tensor or field."""

import json
import shutil

import numpy as np
import pytest

from llds_jax.models import ConfigError, DecoderConfig, from_pretrained, save_pretrained
from llds_jax.models.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from llds_jax.models.testing import tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_pretrained(tiny_model("qwen2_untied"), directory)
    return directory


def _copy(saved_dir, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(saved_dir, target)
    return target


def _rewrite_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors)


def test_truncated_file_names_the_tensor_cut_off(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"truncated: tensor '.*' ends at byte"):
        from_pretrained(directory)


def test_corrupted_header_is_reported_with_the_file(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted safetensors header"):
        from_pretrained(directory)


def test_missing_tensor_is_named(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    _rewrite_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        from_pretrained(directory)


def test_unexpected_tensor_is_named(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    _rewrite_tensors(directory, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.0\.extra\.weight'\]"):
        from_pretrained(directory)


def test_misshaped_tensor_names_both_shapes(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    _rewrite_tensors(directory, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": np.zeros((48, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(48, 64\), config implies \(32, 64\)"):
        from_pretrained(directory)


def test_config_that_disagrees_with_weights_is_caught(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' has shape \(128, 64\), config implies \(96, 64\)"):
        from_pretrained(directory)


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "mistral", r"model_type='mistral'"),
    ("hidden_act", "gelu", r"hidden_act='gelu'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, r"rope_type='yarn'"),
])
def test_unsupported_config_field_is_named(saved_dir, field, value, message):
    config = json.loads((saved_dir / "config.json").read_text())
    config[field] = value
    with pytest.raises(ConfigError, match=message):
        DecoderConfig.from_hf_config(config)


def test_missing_config_json_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        from_pretrained(tmp_path / "nowhere")


def test_sharded_checkpoint_with_index_loads(saved_dir, tmp_path):
    directory = _copy(saved_dir, tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(directory / "model.safetensors").items()}
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        write_safetensors(directory / file, {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = from_pretrained(directory)
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]).T, tensors["lm_head.weight"])


def test_bf16_checkpoint_round_trips_bit_exactly(tmp_path):
    model = tiny_model("qwen3", param_dtype="bfloat16", dtype="bfloat16")
    save_pretrained(model, tmp_path)
    header = read_safetensors(tmp_path / "model.safetensors")
    assert str(header["model.embed_tokens.weight"].dtype) == "bfloat16"
    again = from_pretrained(tmp_path, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(again.embed[...]), np.asarray(model.embed[...]))
