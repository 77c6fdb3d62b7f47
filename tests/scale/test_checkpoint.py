"""Checkpointer: resharded restore, keep-N, atomicity, damaged files, resume settings, SIGTERM."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.app.run_control import NonFiniteStreak, PreemptionGuard
from llds_jax.train.checkpoint import (
    INTEGRITY_FILE,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    abstract_like,
    parse_resume,
    resume,
    with_shardings,
)
from tests.scale import toy_train

pytestmark = pytest.mark.unit


def _to_numpy(tree):
    """Host copy; typed keys become their raw data so they compare as arrays."""
    def leaf(x):
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return jax.tree.map(leaf, tree)


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def _abstract_on(mesh):
    abstract = jax.eval_shape(toy_train.init_state_host, 0)
    return with_shardings(abstract, toy_train.state_shardings(mesh))


def _trained_state(mesh, steps=2):
    state = toy_train.init_state(0, mesh)
    step_fn = toy_train.jit_train_step(mesh)
    for i in range(steps):
        state, _ = step_fn(state, *toy_train.batch(i))
    return state


@pytest.fixture
def saved_on_2x4(tmp_path):
    """A checkpoint of step 2 written from a (2, 4) mesh, plus the live state's host copy."""
    mesh = toy_train.make_mesh((2, 4))
    state = _trained_state(mesh)
    host_copy = _to_numpy(state)
    with Checkpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(2, state, {"data": {"epoch": 0, "cursor": 17}, "config": {"lr": 0.01}})
    return tmp_path, state, host_copy


@pytest.mark.parametrize("target_shape", [(4, 2), (1, 8)])
def test_checkpoint_from_2x4_mesh_restores_onto_other_mesh_and_next_step_matches(saved_on_2x4, target_shape):
    workdir, state, _ = saved_on_2x4
    original_mesh = toy_train.make_mesh((2, 4))
    expected_state, expected_loss = toy_train.jit_train_step(original_mesh)(state, *toy_train.batch(2))

    mesh = toy_train.make_mesh(target_shape)
    restored = Checkpointer(workdir).restore_latest(_abstract_on(mesh))
    assert restored.step == 2
    assert restored.extra == {"data": {"epoch": 0, "cursor": 17}, "config": {"lr": 0.01}}
    w = restored.state["params"]["w"]
    assert w.sharding == NamedSharding(mesh, P("data", "fsdp"))
    assert jax.dtypes.issubdtype(restored.state["rng"].dtype, jax.dtypes.prng_key)

    next_state, loss = toy_train.jit_train_step(mesh)(restored.state, *toy_train.batch(2))
    # Same values, different reduction layout: equal to float32 rounding, not bit for bit.
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(next_state["params"]), jax.tree.leaves(expected_state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_restore_on_same_mesh_is_bit_identical(saved_on_2x4):
    workdir, _, host_copy = saved_on_2x4
    mesh = toy_train.make_mesh((2, 4))
    restored = Checkpointer(workdir).restore(2, _abstract_on(mesh))
    _assert_trees_equal(_to_numpy(restored.state), host_copy)


def test_keep_n_deletes_oldest_and_resaving_a_step_is_a_noop(tmp_path):
    mesh = toy_train.make_mesh((2, 4))
    state = toy_train.init_state(0, mesh)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, state, {"step": step})
        ckpt.save(4, state, {"step": "again"})  # already there: ignored, not an error
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        assert (ckpt.step_dir(4) / INTEGRITY_FILE).exists()
        assert ckpt.restore(4, _abstract_on(mesh)).extra == {"step": 4}


def test_checkpoint_being_written_is_never_picked_up(saved_on_2x4):
    """Orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames on commit; a leftover is ignored."""
    workdir, _, _ = saved_on_2x4
    ckdir = workdir / "checkpoints"
    shutil.copytree(ckdir / "2", ckdir / "7.orbax-checkpoint-tmp-1795343798123456")
    ckpt = Checkpointer(workdir)
    assert ckpt.all_steps() == [2]
    assert ckpt.restore_latest(_abstract_on(toy_train.make_mesh((2, 4)))).step == 2


def _largest_data_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir / "state") for f in fs]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "delete"])
def test_damaged_checkpoint_file_raises_naming_the_file(saved_on_2x4, damage):
    workdir, _, _ = saved_on_2x4
    victim = _largest_data_file(workdir / "checkpoints" / "2")
    if damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 2)
    elif damage == "flip_byte":
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.remove(victim)
    with pytest.raises(CheckpointCorruptError) as err:
        Checkpointer(workdir).restore_latest(_abstract_on(toy_train.make_mesh((2, 4))))
    message = str(err.value)
    assert os.path.relpath(victim, workdir / "checkpoints" / "2") in message
    assert {"truncate": "bytes", "flip_byte": "crc32", "delete": "missing"}[damage] in message
    assert "no older checkpoint" in message


def test_damaged_newest_checkpoint_falls_back_only_when_asked(tmp_path):
    mesh = toy_train.make_mesh((2, 4))
    state = toy_train.init_state(0, mesh)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {"step": 1})
        ckpt.save(2, state, {"step": 2})
    os.remove(_largest_data_file(tmp_path / "checkpoints" / "2"))
    with pytest.raises(CheckpointCorruptError, match="resume from step 1"):
        Checkpointer(tmp_path).restore_latest(_abstract_on(mesh))
    restored = Checkpointer(tmp_path, on_corrupt="previous").restore_latest(_abstract_on(mesh))
    assert restored.step == 1 and restored.extra == {"step": 1}


def test_unreadable_manifest_and_missing_json_item_are_named(saved_on_2x4):
    workdir, _, _ = saved_on_2x4
    step_dir = workdir / "checkpoints" / "2"
    (step_dir / INTEGRITY_FILE).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=INTEGRITY_FILE):
        Checkpointer(workdir).restore(2, _abstract_on(toy_train.make_mesh((2, 4))))
    (step_dir / INTEGRITY_FILE).unlink()
    shutil.rmtree(step_dir / "extra")
    with pytest.raises(CheckpointCorruptError, match=str(step_dir)):
        Checkpointer(workdir, integrity="none").restore(2, _abstract_on(toy_train.make_mesh((2, 4))))


# A failed Orbax restore leaves tensorstore read coroutines un-awaited; they are collected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_restore_target_mismatch_and_missing_sharding_are_loud(saved_on_2x4):
    workdir, state, _ = saved_on_2x4
    ckpt = Checkpointer(workdir)
    bare = jax.eval_shape(toy_train.init_state_host, 0)
    with pytest.raises(CheckpointError, match=r"leaf \['opt_state'\]\[0\]\.count has no sharding"):
        ckpt.restore(2, bare)
    wrong_shape = _abstract_on(toy_train.make_mesh((2, 4)))
    w = wrong_shape["params"]["w"]
    wrong_shape["params"]["w"] = jax.ShapeDtypeStruct((8, 8), w.dtype, sharding=w.sharding)

    def no_read(*args, **kwargs):
        raise AssertionError("a mismatched target must be refused before any array is read")

    ckpt._manager.restore = no_read
    saved = tuple(state["params"]["w"].shape)
    with pytest.raises(CheckpointMismatchError, match="checkpoints/2: leaf 'params/w' was saved as " + re.escape(str(saved))):
        ckpt.restore(2, wrong_shape)
    extra_leaf = _abstract_on(toy_train.make_mesh((2, 4)))
    extra_leaf["params"]["bias2"] = extra_leaf["params"]["w"]
    with pytest.raises(CheckpointMismatchError, match="that the checkpoint lacks, first 'params/bias2'"):
        ckpt.restore(2, extra_leaf)
    del ckpt._manager.restore
    gc.collect()
    with pytest.raises(CheckpointError, match="step 5"):
        ckpt.restore(5, abstract_like(state))


def test_extra_must_be_json(tmp_path):
    mesh = toy_train.make_mesh((2, 4))
    with Checkpointer(tmp_path) as ckpt, pytest.raises(TypeError, match=r"extra\['iterator'\]"):
        ckpt.save(1, toy_train.init_state(0, mesh), {"iterator": object()})


def test_resume_settings(tmp_path):
    mesh = toy_train.make_mesh((2, 4))
    abstract = _abstract_on(mesh)
    ckpt = Checkpointer(tmp_path)
    assert resume(ckpt, "auto", abstract) is None
    assert resume(ckpt, "never", abstract) is None
    ckpt.save(3, toy_train.init_state(0, mesh), {})
    ckpt.wait()
    assert resume(ckpt, "auto", abstract).step == 3
    assert resume(ckpt, "3", abstract).step == 3
    with pytest.raises(CheckpointError, match="resume='never'"):
        resume(ckpt, "never", abstract)
    for bad in ("latest", -1, True, 1.5):
        with pytest.raises(ValueError, match="config.resume"):
            parse_resume(bad)
    for field, value in (("keep", 0), ("integrity", "md5"), ("on_corrupt", "ignore")):
        with pytest.raises(ValueError, match=f"{field}="):
            Checkpointer(tmp_path, **{field: value})


def test_sigterm_requests_a_stop_at_the_next_step_boundary():
    guard = PreemptionGuard().install()
    try:
        assert not guard.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.signalled and guard.should_stop(1)
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_export_hf_writes_complete_directory_only(tmp_path):
    calls = []

    def fake_save_pretrained(model, directory, **kwargs):
        calls.append((model, directory, kwargs))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"model": model}, f)

    target = Checkpointer(tmp_path).export_hf(12, "policy", save_pretrained=fake_save_pretrained, dtype="bf16")
    assert target.name == "step_12" and (target / "config.json").exists()
    assert calls[0][2] == {"dtype": "bf16"}
    assert not list((tmp_path / "hf").glob(".*tmp"))


def test_non_finite_streak_trips_only_on_consecutive_skips():
    streak = NonFiniteStreak(limit=3)
    assert not streak.record([0, 1, 1])      # two in a row
    assert not streak.record([0, 1])         # a finite update resets the streak
    assert streak.record([1, 1])             # 1 + 2 = 3 across the step boundary
    assert "3 optimizer updates in a row" in streak.message and "5 skipped" in streak.message
    with pytest.raises(ValueError, match="limit=0"):
        NonFiniteStreak(limit=0)
