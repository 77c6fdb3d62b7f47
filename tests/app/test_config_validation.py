"""One config check, before any weight: a bad value in any section fails naming its field.

``llds_jax.config.validate`` composes every section's checks. Each case below sets one bad value
and points ``model.source`` at a path that does not exist: a mode that loaded weights (or
opened an index, or compiled) before validating would fail on the missing model instead,
so the field named in the error is proof the check ran first.
"""

from __future__ import annotations

import re

import pytest

from llds_jax.config import base_config, validate, validate_sections
from llds_jax.errors import InputError

pytestmark = pytest.mark.unit

MISSING_MODEL = "/nonexistent/model-for-validation-tests"

# (section, dotted field, bad value, text the error must contain)
BAD_VALUES = [
    ("model", "model.dtype", "float64", "model.dtype='float64'"),
    ("model", "model.attention", "flash", "model.attention='flash'"),
    ("mesh", "mesh.shape", (0, 1, 1), "mesh.shape=(0, 1, 1)"),
    ("data", "data.limit_per_source", -1, "data.limit_per_source=-1"),
    ("retrieval", "retrieval.method", "splade", "retrieval.method must be one of"),
    ("retrieval", "retrieval.max_doc_tokens", -5, "retrieval.max_doc_tokens=-5"),
    ("rollout", "rollout.top_p", 1.5, "rollout.top_p=1.5"),
    ("rollout", "rollout.max_turns", 0, "rollout.max_turns=0"),
    ("rl", "rl.llds_gate", "acton", "rl.llds_gate = 'acton' is not one of"),
    ("optim", "optim.clip_norm", 0.0, "optim.clip_norm=0.0"),
    ("train", "train.mini_batch_size", 3, "train.mini_batch_size=3"),
    ("train", "train.delta_every", 0, "train.delta_every=0"),
    ("sft", "sft.batch_size", 0, "sft.batch_size=0"),
    ("eval", "eval.batch_size", 0, "eval.batch_size=0"),
    ("monitor", "monitor.on_phase_two", "panic", "on_phase_two='panic'"),
    ("plan", "plan.check_before_train", "sometimes", "plan.check_before_train='sometimes'"),
    ("plan", "plan.phases", ("update", "sample"), "plan.phases has unknown phases ['sample']"),
    ("resume", "resume", "latest", "resume='latest'"),
    ("train", "train.max_doc_tokens", 60, "train.max_doc_tokens=60 moved to retrieval.max_doc_tokens"),
]


def config_with(field: str, value, workdir):
    c = base_config()
    c.workdir = str(workdir)
    c.model.source = MISSING_MODEL
    c.mesh.shape = (1, 1, 1)
    c.train.warmup_sft_steps = 1  # so the sft section is in use
    c.plan.check_before_train = "never"
    *parents, leaf = field.split(".")
    section = c
    for part in parents:
        section = section[part]
    section[leaf] = value
    return c


def test_the_unmodified_base_config_is_valid():
    c = base_config()
    c.mesh.shape = (1, 1, 1)
    c.train.warmup_sft_steps = 1
    validate(c, num_devices=1)


@pytest.mark.parametrize("section, field, value, message", BAD_VALUES, ids=[f"{c[0]}:{c[1]}" for c in BAD_VALUES])
def test_a_bad_value_in_each_section_fails_validation_naming_the_field(tmp_path, section, field, value, message):
    with pytest.raises(InputError, match=re.escape(message)):
        validate_sections(config_with(field, value, tmp_path))
    with pytest.raises(InputError, match=re.escape(message)):
        validate(config_with(field, value, tmp_path), num_devices=1)


@pytest.mark.parametrize("mode", ["train", "sft", "eval", "plan"])
@pytest.mark.parametrize("section, field, value, message", BAD_VALUES, ids=[f"{c[0]}:{c[1]}" for c in BAD_VALUES])
def test_every_mode_refuses_a_bad_value_before_loading_the_model(tmp_path, mode, section, field, value, message):
    from llds_jax.app.run import sft_main, train_main
    from llds_jax.eval.run import eval_main
    from llds_jax.plan.run import plan_main

    entry = {"train": train_main, "sft": sft_main, "eval": eval_main, "plan": plan_main}[mode]
    config = config_with(field, value, tmp_path)
    with pytest.raises(InputError, match=re.escape(message)):
        entry(config)
    assert not (tmp_path / "config.json").exists(), f"--mode={mode} started the run before validating"


def test_the_missing_model_itself_is_what_a_valid_config_then_fails_on(tmp_path):
    """The control: with every value valid, the same entry point gets past validation to the model."""
    from llds_jax.eval.run import eval_main

    config = config_with("eval.batch_size", 8, tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(MISSING_MODEL)):
        eval_main(config)


def test_one_mesh_shape_resolver_serves_the_config_and_make_mesh():
    from llds_jax.config import mesh_shape
    from llds_jax.parallel.mesh import MeshShapeError, make_mesh

    c = base_config()
    c.mesh.shape = (1, -1, 4)
    with pytest.raises(InputError, match=re.escape("mesh.shape=(1, -1, 4) does not divide the 6 devices")):
        mesh_shape(c, 6)
    assert mesh_shape(c, 8) == (1, 2, 4)
    with pytest.raises(MeshShapeError, match=re.escape("mesh.shape=(3, -1, 1) does not divide the 8 devices")):
        make_mesh((3, -1, 1))


@pytest.mark.parametrize("source, value, message", [
    (MISSING_MODEL, 5.0, "model.random_logit_std=5.0 scales random weights only"),
    ("random:Qwen2.5-0.5B", -1.0, "model.random_logit_std=-1.0: expected a finite number >= 0"),
    ("random:Qwen2.5-0.5B", float("inf"), "model.random_logit_std=inf: expected a finite number >= 0"),
])
def test_random_logit_std_is_a_spread_of_random_weights_only(tmp_path, source, value, message):
    config = config_with("model.random_logit_std", value, tmp_path)
    config.model.source = source
    with pytest.raises(InputError, match=re.escape(message)):
        validate_sections(config)
