"""End to end with the JAX sampler: a tiny Qwen2-shaped model over the real Qwen2.5 vocabulary.

The rollout continues one KV cache across turns (feedback appended, never re-prefilled).
If anything drifted — a feedback token written at the wrong slot, a position off by one, a
log-prob stored next to the wrong token — the log-probs recorded while sampling would
differ from a single full forward pass over the arrays the trainer receives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_model
from llds_jax.rollout import default_config, run_rollouts
from llds_jax.rollout.protocol import INVALID_ACTION_FEEDBACK

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(qwen_tokenizer):
    return tiny_model("qwen2", seed=0, vocab_size=151936)


def small_config(**overrides):
    cfg = default_config()
    cfg.update(dict(n_samples=2, max_turns=2, max_action_tokens=12, max_context=512, top_p=1.0))
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def sampled(model, qwen_tokenizer, bm25):
    questions = ["who got the first nobel prize in physics", "what is the capital of france"]
    return run_rollouts(model, qwen_tokenizer, questions, bm25, small_config(), key=jax.random.key(0))


def test_sampler_logprobs_equal_a_full_forward_over_the_final_arrays(model, sampled):
    batch = sampled
    logp, _ = jax.jit(lambda ids, mask: sequence_logprobs(model, ids, mask, with_entropy=False))(
        jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask))
    forward = np.zeros_like(batch.sampler_logprobs)
    forward[:, 1:] = np.asarray(logp)  # entry t-1 scores token t
    on_actions = batch.action_mask
    diff = np.abs(np.where(on_actions, forward - batch.sampler_logprobs, 0.0))
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    assert diff.max() < 2e-4, f"max |Δ logp| {diff.max():.3g} at (row, col) {worst}"
    assert on_actions.sum() == 4 * 3 * 12, "3 capped actions of 12 tokens per row"


def test_random_policy_rows_are_capped_invalid_actions_with_feedback_between(sampled, qwen_tokenizer):
    batch = sampled
    assert batch.turns.tolist() == [3] * 4 and batch.searches.tolist() == [0] * 4
    assert batch.truncated.all() and not batch.finished.any()
    for row in range(4):
        feedback = batch.input_ids[row][batch.feedback_mask[row]]
        assert qwen_tokenizer.decode(feedback) == INVALID_ACTION_FEEDBACK * 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert not np.array_equal(batch.input_ids[0], batch.input_ids[1]), "two samples of one prompt are identical"


def test_greedy_rollout_is_deterministic_and_samples_of_a_prompt_agree(model, qwen_tokenizer, bm25):
    cfg = small_config(temperature=0.0, max_turns=1, max_action_tokens=8)
    questions = ["q one", "q two"]  # same batch bucket as the sampled rollout: no new programs
    a = run_rollouts(model, qwen_tokenizer, questions, bm25, cfg, key=jax.random.key(1))
    b = run_rollouts(model, qwen_tokenizer, questions, bm25, cfg, key=jax.random.key(2))
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.input_ids[0], a.input_ids[1])
    np.testing.assert_array_equal(a.input_ids[2], a.input_ids[3])
