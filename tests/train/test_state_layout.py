"""One builder of the train state's layout (``train.state_layout``) for the learner, SFT, the planner and resume."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import tiny_train_config

import llds_jax
from llds_jax.models.testing import tiny_model
from llds_jax.parallel.mesh import make_mesh
from llds_jax.parallel.placement import shard_model
from llds_jax.train.checkpoint import Checkpointer
from llds_jax.train.learner import Learner
from llds_jax.train.sft import SFTStep

pytestmark = pytest.mark.unit

MESH = (1, 2, 1)  # FSDP over 2 devices: the layout's shardings are not all replicated


def _model(mesh):
    with jax.set_mesh(mesh):
        return shard_model(tiny_model("qwen2"), mesh)


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _abstract_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_resume_holds_one_model_and_one_train_state_at_the_restore(tmp_path, monkeypatch):
    """Before, resume built a fresh learner state (params, Adam moments, π_ref) only to read its shapes,
    then restored a second state beside it: at 3B ≈ 99 GB across the mesh. Now the restore target is
    abstract, so at the restore the devices hold what they held before resume plus one train state."""
    config = tiny_train_config()
    config.mesh.shape = MESH
    mesh = make_mesh(MESH)
    model = _model(mesh)
    saved = Learner.create(model, config, mesh)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, saved.state, {"data": {}})
    saved_params = jax.tree.map(np.asarray, jax.device_get(saved.state.params))
    del saved, ckpt
    model = _model(mesh)  # the run's loaded model (the saved learner's state was built from the first one)

    at_restore = []
    restore = Checkpointer.restore

    def counting_restore(self, step, abstract_state):
        out = restore(self, step, abstract_state)
        at_restore.append(_live_bytes())
        return out

    monkeypatch.setattr(Checkpointer, "restore", counting_restore)
    before = _live_bytes()  # the model, and whatever earlier tests left alive
    state_bytes = _abstract_bytes(Learner.restore_target(model, config, mesh))
    learner, restored = Learner.resume(model, config, mesh, Checkpointer(tmp_path))
    assert len(at_restore) == 1 and restored.step == 3
    grown = at_restore[0] - before
    assert grown <= state_bytes, (f"resume held {grown} B beyond the model at the restore, more than one train "
                                  f"state ({state_bytes} B)")
    assert learner.state is restored.state and learner.reference_is_policy_in is None
    for got, want in zip(jax.tree.leaves(jax.device_get(learner.state.params)), jax.tree.leaves(saved_params),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_learner_sft_and_planner_share_one_layout():
    """The three builders of a train state agree leaf for leaf (shape, dtype, sharding) where they overlap."""
    from llds_jax.models.loading import decoder_config
    from llds_jax.parallel.rules import DEFAULT
    from llds_jax.plan.aot import abstract_train_state

    config = tiny_train_config()
    config.mesh.shape = MESH
    mesh = make_mesh(MESH)
    model = _model(mesh)
    learner = Learner.create(model, config, mesh)
    target = Learner.restore_target(model, config, mesh)
    for got, want in zip(jax.tree.leaves(learner.state), jax.tree.leaves(target), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    config.model.source = "tiny:qwen2"
    _, planned, _ = abstract_train_state(config, decoder_config(config.model), mesh, DEFAULT)
    for got, want in zip(jax.tree.leaves(planned), jax.tree.leaves(target), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype) and got.sharding.is_equivalent_to(want.sharding,
                                                                                                   len(got.shape))
    sft = SFTStep(_model(mesh), config, mesh)
    for got, want in zip(jax.tree.leaves(sft.state.params), jax.tree.leaves(target.params), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype) and got.sharding.is_equivalent_to(want.sharding,
                                                                                                   got.ndim)


def test_one_call_site_builds_train_state_shardings():
    """``train_state_shardings`` is called by ``train.state_layout`` alone (before: learner, sft and plan each did)."""
    package = Path(llds_jax.__file__).parent
    callers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if re.search(r"train_state_shardings\(", path.read_text()) and path.name != "state.py")
    assert callers == ["train/state_layout.py"], callers


def test_the_trainer_reads_the_ambient_rules_table():
    """One way the sharding table reaches the trainer: the ambient one (``use_rules``), which the model's
    constraints read too. Before, the learner and SFT fell back to DEFAULT inside a ``use_rules`` block."""
    from jax.sharding import PartitionSpec

    from llds_jax.parallel.rules import ShardingRules, use_rules

    config = tiny_train_config()
    config.mesh.shape = (2, 2, 1)
    mesh = make_mesh((2, 2, 1))
    data_only = ShardingRules.from_mapping(batch="data")
    with use_rules(data_only):
        model = _model(mesh)
        learner, sft = Learner.create(model, config, mesh), SFTStep(model, config, mesh)
    assert learner.rules is data_only and sft.rules is data_only
    assert learner.batch_shardings.input_ids.spec == PartitionSpec("data", None)
    assert sft.batch_shardings["input_ids"].spec == PartitionSpec("data", None)
