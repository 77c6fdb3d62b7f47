"""Scoring only the action targets (``train.max_action_tokens_per_row``) changes rounding, nothing else.

The compacted step gathers each row's action targets before the output projection; the full
step projects every position and masks. Same model, same batches: the metrics, π_old and the
updated params must agree to fp32 rounding, on ragged rows (none, a few, exactly the bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_update_step import F32_EPS, WELL_CONDITIONED_EPS, _assert_close, _assert_params_close, tiny_learner
from train_helpers import synthetic_rollout, tiny_train_config

from llds_jax.models.logprobs import balanced_chunk, scored_positions
from llds_jax.train.batch import TrainBatch, scored_positions_per_row
from llds_jax.train.step import StepSizes

pytestmark = pytest.mark.unit

BOUND = 16  # ≥ the 13 action tokens of a synthetic row, < the 127 targets of a trainer row
ALL = 10_000  # more than a row's targets: every position, the full path


def ragged_rollout(seed: int) -> dict[str, np.ndarray]:
    """``synthetic_rollout`` with row 0 action-free and row 1 holding exactly BOUND action tokens."""
    arrays = synthetic_rollout(seed=seed)
    for key, off in (("action_mask", 0.0), ("answer_mask", 0.0), ("action_index", -1)):
        arrays[key][:2] = off
    arrays["action_mask"][1, 8:24] = 1
    arrays["answer_mask"][1, 18:24] = 1
    arrays["action_index"][1, 8:24] = np.repeat([0, 1], 8)
    arrays["attention_mask"][1, :28] = True
    return arrays


def run(bound: int, steps: int = 2, **rl):
    config = tiny_train_config(max_action_tokens_per_row=bound)
    config.optim.eps = WELL_CONDITIONED_EPS
    config.rl.update(rl)
    learner = tiny_learner(config)
    history = []
    for step in range(steps):
        metrics, extra = learner.update(TrainBatch.from_arrays(ragged_rollout(step), length=learner.seq_len))
        extra["params"] = jax.tree.map(np.asarray, jax.device_get(learner.state.params))
        history.append((metrics, extra))
    return learner, history


@pytest.mark.codegen_sensitive
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("rl", [dict(), dict(aggregation="token-sum-norm", entropy_coef=1e-3, llds_gate="response")],
                         ids=["default", "token-sum-norm+entropy+R-gate"])
def test_compacted_step_equals_the_full_step(rl):
    compact, compact_history = run(BOUND, **rl)
    full, full_history = run(ALL, **rl)
    assert StepSizes.from_config(compact.config).scored_positions == BOUND
    assert StepSizes.from_config(full.config).scored_positions == full.seq_len - 1  # every target: the full path
    lr = compact.config.optim.lr
    for step, ((metrics, extra), (ref_metrics, ref_extra)) in enumerate(zip(compact_history, full_history)):
        assert metrics.keys() == ref_metrics.keys()
        action = np.asarray(TrainBatch.from_arrays(ragged_rollout(step), length=full.seq_len).action_mask) > 0
        old, ref_old = np.asarray(extra["old_logp"]), np.asarray(ref_extra["old_logp"])
        assert np.all(old[~action] == 0), "off-action positions of a compacted pass hold 0"
        _assert_close(f"step {step} old_logp on action tokens", old[action], ref_old[action])
        per_mini, ref_per_mini = extra["per_mini_batch"], ref_extra["per_mini_batch"]
        assert per_mini.keys() == ref_per_mini.keys()
        for key in sorted(per_mini):  # losses are O(1) terms cancelling to ~0: scale 1
            floor = 1.0 if key.startswith("loss/") else 0.1
            _assert_close(f"step {step} {key}", per_mini[key], ref_per_mini[key], floor=floor)
        # Per update an entry moves by ≤ lr · |δg| / eps with |δg| ≤ ε₃₂ · (grad norm) (test_update_step).
        updates = (step + 1) * len(ref_per_mini["grad/norm_preclip"])
        grad_scale = float(np.max(ref_per_mini["grad/norm_preclip"]))
        step_bound = updates * lr * min(2.0, F32_EPS * grad_scale / WELL_CONDITIONED_EPS)
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(extra["params"]),
                                     jax.tree.leaves(ref_extra["params"])):
            _assert_params_close(f"step {step} param {jax.tree_util.keystr(path)}", got, want, lr, step_bound)
    assert compact.compile_counts() == full.compile_counts()


def test_a_row_with_more_action_tokens_than_the_bound_fails_naming_the_knob():
    learner = tiny_learner(tiny_train_config(max_action_tokens_per_row=12))
    with pytest.raises(ValueError, match=r"row 1 has 16 action tokens.*train\.max_action_tokens_per_row"):
        learner.update(TrainBatch.from_arrays(ragged_rollout(0), length=learner.seq_len))


def test_the_bound_defaults_to_the_rollouts_and_never_exceeds_the_targets():
    config = tiny_train_config()
    config.rollout.update(dict(max_turns=2, max_action_tokens=48))
    assert scored_positions_per_row(config, 512) == 144  # (2 + 1) actions × 48 tokens
    assert scored_positions_per_row(config, 100) == 99
    config.train.max_action_tokens_per_row = 200
    assert scored_positions_per_row(config, 512) == 200
    assert scored_positions_per_row(config, 512, "sft") == 511  # synthetic thoughts: every position unless set
    config.sft.max_action_tokens_per_row = 96
    assert scored_positions_per_row(config, 512, "sft") == 96


def test_scored_positions_lists_each_rows_targets_in_order():
    mask = jnp.asarray([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], jnp.float32)
    positions, valid = scored_positions(mask, 4)
    np.testing.assert_array_equal(positions, [[1, 2, 4, 0], [0, 0, 0, 0], [0, 1, 2, 3]])
    np.testing.assert_array_equal(valid, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(("length", "size", "chunk"), [(144, 64, 48), (511, 64, 64), (130, 128, 72), (127, 128, 127),
                                                       (5, 64, 5), (1000, 1000, 1000)])
def test_balanced_chunks_split_evenly_within_the_limit(length, size, chunk):
    assert balanced_chunk(length, size) == chunk
    pieces = -(-length // chunk)
    assert chunk <= size and (pieces - 1) * chunk < length <= pieces * chunk


@pytest.mark.codegen_sensitive
def test_a_compacted_sft_step_equals_the_full_one():
    from llds_jax.models.testing import tiny_model
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.placement import shard_model
    from llds_jax.train.sft import SFTStep

    runs = {}
    for bound in (BOUND, ALL):
        config = tiny_train_config()
        config.optim.eps = WELL_CONDITIONED_EPS
        config.sft.update(dict(batch_size=4, max_seq_len=32, max_action_tokens_per_row=bound))
        mesh = make_mesh((1, 1, 1))
        with jax.set_mesh(mesh):
            sft = SFTStep(shard_model(tiny_model("qwen2"), mesh), config, mesh)
        assert sft.scored == min(bound, 31)
        losses = []
        for step in range(3):
            arrays = ragged_rollout(step)
            losses.append(sft({k: arrays[k][:4] for k in ("input_ids", "attention_mask", "action_mask")}))
        runs[bound] = losses, jax.tree.map(np.asarray, jax.device_get(sft.state.params)), config.sft.lr
    (losses, params, lr), (ref_losses, ref_params, _) = runs[BOUND], runs[ALL]
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        for key in want:
            _assert_close(f"SFT step {step} {key}", got[key], want[key], floor=0.1)
    step_bound = 3 * lr * min(2.0, F32_EPS * max(float(m["grad/norm_preclip"]) for m in ref_losses)
                              / WELL_CONDITIONED_EPS)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        _assert_params_close(f"SFT param {jax.tree_util.keystr(path)}", got, want, lr, step_bound)
