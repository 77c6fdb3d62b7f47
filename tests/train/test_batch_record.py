"""One batch record from rollout to update (issue 16 item 2).

The record (``TrainBatch``) carries rewards, group ids and row weights; the update computes the
advantages inside its jit; the device batch is uploaded once per step and reused by π_old,
π_ref, the update and the Δ pass; every token array is token-aligned; RL and SFT share one
optimizer step (``apply_update``). The numbers must be the ones the code produced before the
change: ``pinned_update.json`` holds them, first computed on the pre-change path (host-side
advantages, per-call uploads); ``pinned_update.py`` computes them and, with ``--write``, records them again.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pinned_update
import pytest
from train_helpers import synthetic_rollout, tiny_train_config

from llds_jax.rl.advantages import compute_advantages
from llds_jax.train.batch import TrainBatch, next_token_targets, token_aligned
from llds_jax.train.state import apply_update, init_train_state, make_optimizer

pytestmark = pytest.mark.unit

PINNED = json.loads(pinned_update.PATH.read_text())
F32_EPS = float(np.finfo(np.float32).eps)
# The same fp32 operations in a differently fused XLA program may round differently; 16 ulps of
# the quantity's magnitude (at least 1: losses and means cancel O(1) per-token terms) bounds that.
ULPS = 16


def _learner(mesh_shape, packing=False):
    return pinned_update.learner(mesh_shape, packing)


def _assert_pinned(name, got, want, floor=1.0):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} vs pinned {want.shape}"
    same_nan = np.isnan(got) & np.isnan(want)
    scale = max(float(np.nanmax(np.abs(want))) if np.isfinite(want).any() else 0.0, floor)
    diff = np.where(same_nan, 0.0, np.abs(got - want))
    assert np.all(diff <= ULPS * F32_EPS * scale), (
        f"{name}: differs from the pre-change value by {np.nanmax(diff):.3e} > {ULPS} ulp × {scale:.3g} "
        f"(got {got}, pinned {want})")


def _two_steps(learner):
    return learner, pinned_update.two_steps(learner)


@pytest.fixture(scope="module")
def pinned_run():
    return _two_steps(_learner((1, 1, 1)))


@pytest.fixture(scope="module")
def packed_run():
    return _two_steps(_learner((1, 1, 1), packing=True))


def test_update_metrics_advantages_and_logprobs_equal_the_pre_change_numbers(pinned_run):
    _, steps = pinned_run
    for step, ((_, extra), want) in enumerate(zip(steps, PINNED["update"])):
        missing = sorted(set(want["per_mini_batch"]) - set(extra["per_mini_batch"]))
        assert not missing, f"step {step}: the update no longer reports pinned metrics {missing}"
        for key, values in want["per_mini_batch"].items():
            _assert_pinned(f"step {step} {key}", extra["per_mini_batch"][key], values)
        _assert_pinned(f"step {step} advantages", extra["advantages"], want["advantages"])
        _assert_pinned(f"step {step} π_old row sums", extra["old_logp"].sum(axis=1, dtype=np.float64),
                       want["old_logp_row_sums"])
        _assert_pinned(f"step {step} π after the update, row sums", extra["logp_now"].sum(axis=1, dtype=np.float64),
                       want["logp_now_row_sums"])


def test_pinned_file_is_what_its_recorder_writes_and_pins_only_update_quantities(pinned_run):
    """``pinned_update.py --write`` regenerates the file: its record of this run has the file's keys and
    values (to the same ulps), and the file pins no metric outside ``PINNED_PREFIXES``."""
    assert not re.search(r"[0-9a-f]{7}", pinned_update.PATH.stem), "the golden's name must not date"
    _, steps = pinned_run
    for step, (got, want) in enumerate(zip(pinned_update.update_record(steps), PINNED["update"], strict=True)):
        assert sorted(got) == sorted(want) and sorted(got["per_mini_batch"]) == sorted(want["per_mini_batch"])
        assert all(pinned_update.pinned_metric(k) for k in want["per_mini_batch"]), sorted(want["per_mini_batch"])
        for key in ("advantages", "old_logp_row_sums", "logp_now_row_sums"):
            _assert_pinned(f"recorded step {step} {key}", got[key], want[key])
    assert all(sorted(want) == sorted(pinned_update.SFT_METRICS) for want in PINNED["sft"])


def test_packed_update_equals_the_pre_change_numbers(packed_run, pinned_run):
    """Packed rows (``train.packing``) give the pinned metrics and advantages to the same 16 ulps.

    Its π_old and π_now are 0 off the action tokens (only action targets are scored, as in any
    compacted pass), so they are compared with the padded run's on action tokens: the same terms
    summed in another order inside attention's key blocks and the LM head, 64 ulps of the scale.
    """
    _, steps = packed_run
    _, padded = pinned_run
    for step, ((_, extra), want, (_, ref)) in enumerate(zip(steps, PINNED["update"], padded, strict=True)):
        for key, values in want["per_mini_batch"].items():
            _assert_pinned(f"packed step {step} {key}", extra["per_mini_batch"][key], values)
        _assert_pinned(f"packed step {step} advantages", extra["advantages"], want["advantages"])
        actions = synthetic_rollout(seed=step)["action_mask"] > 0
        for key in ("old_logp", "logp_now"):
            got, ref_values = extra[key][:, :actions.shape[1]][actions], ref[key][:, :actions.shape[1]][actions]
            bound = 64 * F32_EPS * float(np.max(np.abs(ref_values)))
            assert np.max(np.abs(got - ref_values)) <= bound, f"packed step {step} {key} on action tokens"


def test_returned_logprobs_are_token_aligned(pinned_run):
    """Position t scores the token at t (as the sampler's log-probs): nothing predicts token 0."""
    learner, steps = pinned_run
    _, extra = steps[0]
    assert extra["old_logp"].shape == (16, learner.seq_len)
    assert np.all(extra["old_logp"][:, 0] == 0.0)
    assert np.all(extra["old_logp"][:, 1:28] < 0.0), "real tokens 1..27 must carry a log-prob"
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(next_token_targets(token_aligned(x)), x)


@pytest.mark.parametrize("run", ["pinned_run", "packed_run"])
def test_the_step_uploads_once_and_no_host_transfer_precedes_the_update(run, request):
    """After ``upload``, π_old, π_ref, the advantages, the update and the Δ pass move nothing host → device.

    Before the change the advantages went host → device → host → device and ``logprobs_now``
    uploaded the batch again.
    """
    learner, _ = request.getfixturevalue(run)
    batch = learner.upload(TrainBatch.from_arrays(synthetic_rollout(seed=3), length=learner.seq_len))
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        _, extra = learner.update(batch)
        learner.logprobs_now(extra["batch"])
    assert extra["batch"].input_ids is batch.input_ids
    assert learner.compile_counts() == {"policy_logprobs": 1, "update": 1, "reference_logprobs": 1}


def test_advantages_inside_the_update_equal_the_host_estimator_with_padding_rows_on_a_sharded_mesh():
    """Rows of weight 0 get advantage 0 and stay out of their group's statistics (rows 13–15: group 3)."""
    learner = _learner((2, 2, 2))
    arrays = synthetic_rollout(seed=4)
    arrays["row_weight"] = np.ones(16, np.float32)
    arrays["row_weight"][13:] = 0.0
    arrays["rewards"][12:] = [1.0, 0.0, 1.0, 0.0]
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    rl = learner.config.rl
    want = np.asarray(compute_advantages(jnp.asarray(arrays["rewards"]), jnp.asarray(arrays["group_ids"], jnp.int32),
                                         jnp.asarray(arrays["row_weight"] > 0), estimator=rl.advantage_estimator,
                                         eps=rl.advantage_eps, unbiased_std=rl.unbiased_std))
    assert np.all(want[13:] == 0.0) and want[12] == pytest.approx(1.0 / (1.0 + rl.advantage_eps))  # group of one
    np.testing.assert_allclose(extra["advantages"], want, rtol=0, atol=2 * F32_EPS * np.max(np.abs(want)))


def test_host_record_pads_casts_and_names_bad_fields():
    arrays = synthetic_rollout(seed=0, length=20)
    batch = TrainBatch.from_arrays(arrays, length=32)
    assert batch.input_ids.shape == (16, 32) and batch.input_ids.dtype == np.int32
    assert np.all(batch.action_index[:, 20:] == -1) and not batch.attention_mask[:, 20:].any()
    assert batch.group_ids.dtype == np.int32 and np.all(batch.row_weight == 1.0)
    with pytest.raises(ValueError, match="'input_ids' is 20 tokens long, more than the trainer's fixed length 16"):
        TrainBatch.from_arrays(arrays, length=16)
    with pytest.raises(ValueError, match=r"lack \['rewards'\]"):
        TrainBatch.from_arrays({k: v for k, v in arrays.items() if k != "rewards"}, length=32)
    with pytest.raises(ValueError, match="'rewards' has 15 rows, input_ids has 16"):
        TrainBatch.from_arrays({**arrays, "rewards": arrays["rewards"][:15]}, length=32)


@pytest.mark.parametrize("run", ["pinned_run", "packed_run"])
def test_abstract_record_matches_the_uploaded_one(run, request):
    """The planner compiles against ``TrainBatch.abstract``: same shapes, dtypes and shardings as a real step."""
    learner, steps = request.getfixturevalue(run)
    _, extra = steps[0]
    abstract = TrainBatch.abstract(16, learner.seq_len, with_ref=True, mesh=learner.mesh, rules=learner.rules,
                                   packing=learner.packing)
    assert (abstract.packed is None) == (run == "pinned_run") == (extra["batch"].packed is None)
    # sampler_logp: carried only under rl.rollout_correction, so neither record has it here
    assert abstract.sampler_logp is None and extra["batch"].sampler_logp is None
    wants = jax.tree_util.tree_leaves_with_path(abstract)
    gots = jax.tree.leaves(extra["batch"])
    assert len(wants) == len(gots)
    for (path, want), got in zip(wants, gots, strict=True):
        name = jax.tree_util.keystr(path)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{name}: {got.shape} {got.dtype} vs {want}"
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name


def test_apply_update_clips_applies_adamw_and_skips_non_finite_steps():
    config = tiny_train_config()
    config.optim.update(dict(weight_decay=0.1, clip_norm=1.0))
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = make_optimizer(config.optim)
    state = init_train_state(params, config.optim, seed=0)
    grads = {"w": jnp.array([3.0, 0.0, -4.0])}  # norm 5: clipped to 1
    new, metrics = apply_update(state, grads, jnp.float32(2.0), jnp.float32(0.1), tx, config.optim.clip_norm)
    # Adam's first step: m̂ = g', v̂ = g'², so the direction is g'/(|g'| + eps) ≈ sign(g'); plus decay w·p.
    clipped = np.array([3.0, 0.0, -4.0]) / (5.0 + 1e-6)
    direction = clipped / (np.abs(clipped) + config.optim.eps) + 0.1 * np.array([1.0, -2.0, 3.0])
    np.testing.assert_allclose(new.params["w"], np.array([1.0, -2.0, 3.0]) - 0.1 * direction, rtol=1e-6)
    assert float(metrics["grad/norm_preclip"]) == pytest.approx(5.0)
    assert float(metrics["grad/clip_scale"]) == pytest.approx(1.0 / (5.0 + 1e-6))
    assert (int(new.updates), int(new.skipped_updates), float(metrics["update/skipped"])) == (1, 0, 0.0)

    skipped, metrics = apply_update(new, grads, jnp.float32(np.nan), jnp.float32(0.1), tx, 1.0)
    np.testing.assert_array_equal(skipped.params["w"], new.params["w"])
    for got, want in zip(jax.tree.leaves(skipped.opt_state), jax.tree.leaves(new.opt_state)):
        np.testing.assert_array_equal(got, want)
    assert (int(skipped.updates), int(skipped.skipped_updates), float(metrics["update/skipped"])) == (1, 1, 1.0)


def test_sft_step_through_the_shared_optimizer_step_equals_the_pre_change_numbers():
    sft = pinned_update.sft_step()
    for step, want in enumerate(PINNED["sft"]):
        metrics = sft(pinned_update.sft_inputs(step))
        for key, value in want.items():
            _assert_pinned(f"SFT step {step} {key}", metrics[key], value)
    assert int(sft.state.updates) == 3 and int(sft.state.step) == 3 and sft.compile_count() == 1


def test_adamw_direction_is_optax_adamw():
    """``make_optimizer`` + ``apply_update``'s lr scale is ``optax.adamw`` (decay applied as lr·wd·p)."""
    config = tiny_train_config()
    config.optim.update(dict(weight_decay=0.01, clip_norm=1e9))
    params = {"w": jnp.array([0.5, -1.5])}
    grads = {"w": jnp.array([0.2, -0.1])}
    state = init_train_state(params, config.optim, seed=0)
    ours, _ = apply_update(state, grads, jnp.float32(0.0), jnp.float32(1e-2), make_optimizer(config.optim), 1e9)
    reference = optax.adamw(1e-2, b1=config.optim.b1, b2=config.optim.b2, eps=config.optim.eps, weight_decay=0.01)
    updates, _ = reference.update(grads, reference.init(params), params)
    np.testing.assert_allclose(ours.params["w"], optax.apply_updates(params, updates)["w"], rtol=1e-6)
