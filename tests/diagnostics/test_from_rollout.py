"""Diagnostics from a real RolloutBatch: the rollout loop driven by a scripted policy."""

from __future__ import annotations

import numpy as np
import pytest

from llds_jax.diagnostics.from_rollout import first_search_feedback, response_batch_from_rollout
from llds_jax.diagnostics.step_metrics import step_diagnostics
from llds_jax.retrieval import Hit
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.config import default_config
from llds_jax.rollout.multi_turn import run_rollouts
from llds_jax.rollout.scripted_policy import ScriptedPolicy, scripted_logprob
from llds_jax.sampling.token_bytes import vocab_bytes

pytestmark = pytest.mark.unit


class QueryEchoRetriever:
    """Returns one passage named after the query, so equal queries retrieve equal documents."""

    def search(self, queries, topk):
        return [[Hit(id=f"doc:{q}", contents=f'"{q}"\npassage about {q}', score=1.0)] for q in queries]


# Two GRPO groups of two. Group 0: both search "paris capital" (the wrong one's first action is
# correct). Group 1: the wrong response searched something else. Row 4 (group 2) answers directly.
SCRIPTS = [
    (0, "<search> paris capital </search>", "<answer> Paris </answer>", 1.0),
    (0, "<search> paris capital </search>", "<answer> Lyon </answer>", 0.0),
    (1, "<search> tallest mountain </search>", "<answer> Everest </answer>", 1.0),
    (1, "<search> deepest lake </search>", "<answer> Baikal </answer>", 0.0),
]


@pytest.fixture(scope="module")
def rollout(qwen_tokenizer):
    streams = [[qwen_tokenizer.encode(first), qwen_tokenizer.encode(second)] for _, first, second, _ in SCRIPTS]
    policy = ScriptedPolicy(streams, action_stop_table(vocab_bytes(qwen_tokenizer)),
                            stop_token_ids=[qwen_tokenizer.eos_token_id])
    config = default_config()
    config.update(dict(n_samples=1, max_turns=1, max_action_tokens=32, max_obs_tokens=64, max_context=512,
                       pad_to_multiple=64))
    return run_rollouts(policy, qwen_tokenizer, ["q0", "q0", "q1", "q1"], QueryEchoRetriever(), config,
                        group_ids=[g for g, *_ in SCRIPTS])


def test_first_search_feedback_is_equal_exactly_when_the_documents_are(rollout):
    assert rollout.action_feedback == [["search", None]] * 4  # recorded by the rollout, not re-parsed
    keys = first_search_feedback(rollout)
    assert keys[0] == keys[1] and keys[2] != keys[3] and all(k is not None for k in keys)


def test_step_diagnostics_from_a_real_rollout(rollout):
    reward = np.array([r for *_, r in SCRIPTS])
    advantage = np.array([1.0, -1.0, 1.0, -1.0])
    old = rollout.sampler_logprobs  # scripted: logprob of token t is scripted_logprob(id_t)
    new = np.where(rollout.action_mask, old + np.array([[0.01], [0.0], [-0.01], [0.0]]), old)
    batch = response_batch_from_rollout(rollout, advantage=advantage, reward=reward, old_logprobs=old,
                                        new_logprobs=new, num_action_slots=2)
    metrics = step_diagnostics(batch)

    def mean_token_logprob(row, action):
        ids = rollout.input_ids[row][rollout.action_index[row] == action]
        return np.mean([scripted_logprob(i) for i in ids])

    expected_first = np.mean([mean_token_logprob(0, 0), mean_token_logprob(2, 0)])
    assert metrics["diag/ll_correct/action0"] == pytest.approx(expected_first, rel=1e-6)
    # Row 0's likelihood went up, row 2's went down: half the correct responses show LLD.
    assert metrics["diag/lld_rate"] == pytest.approx(0.5)
    # Row 1 (wrong) searched exactly what row 0 (right) searched; row 3 did not.
    assert metrics["diag/first_action_correct_rate"] == pytest.approx(0.5)


def test_the_trainers_padded_record_gives_the_same_diagnostics(rollout):
    """``TrainBatch.from_rollout`` pads to the trainer's fixed length; diagnostics read the wider arrays alike."""
    from llds_jax.train.batch import TrainBatch

    reward = np.array([r for *_, r in SCRIPTS], np.float32)
    width = rollout.input_ids.shape[1]
    batch = TrainBatch.from_rollout(rollout, reward, length=width + 64, ma_search_count="minibatch_executed")
    np.testing.assert_array_equal(batch.input_ids[:, :width], rollout.input_ids)
    np.testing.assert_array_equal(batch.action_mask[:, :width], rollout.action_mask)
    assert not batch.attention_mask[:, width:].any() and (batch.action_index[:, width:] == -1).all()
    np.testing.assert_array_equal(batch.num_searches, rollout.searches)
    np.testing.assert_array_equal(batch.group_ids, rollout.group_ids)
    old = rollout.sampler_logprobs
    padded = np.pad(old, ((0, 0), (0, 64)), constant_values=7.0)  # padding columns must not be read
    args = dict(advantage=np.array([1.0, -1.0, 1.0, -1.0]), reward=reward, num_action_slots=2)
    assert step_diagnostics(response_batch_from_rollout(rollout, old_logprobs=padded, new_logprobs=padded, **args)) \
        == step_diagnostics(response_batch_from_rollout(rollout, old_logprobs=old, new_logprobs=old, **args))


def test_logodds_and_first_action_identity_from_a_real_rollout(rollout):
    from llds_jax.diagnostics.from_rollout import first_action_ids
    from llds_jax.diagnostics.step_metrics import token_logodds

    # Rows 0 and 1 wrote the same first action, rows 2 and 3 did not: one mixed group of two identical.
    ids = first_action_ids(rollout)
    assert ids[0] == ids[1] and ids[2] != ids[3] and all(ids)
    advantage = np.array([1.0, -1.0, 1.0, -1.0])
    old = rollout.sampler_logprobs
    batch = response_batch_from_rollout(rollout, advantage=advantage, reward=np.array([1, 0, 1, 0]),
                                        old_logprobs=old, num_action_slots=2)
    metrics = step_diagnostics(batch)
    assert metrics["diag/identical_first_action_frac"] == pytest.approx(0.5)

    def mean_token_logodds(row, action):
        ids = rollout.input_ids[row][rollout.action_index[row] == action]
        return np.mean(token_logodds([scripted_logprob(i) for i in ids]))

    expected = np.mean([mean_token_logodds(0, 0), mean_token_logodds(2, 0)])
    assert metrics["diag/logodds_correct/action0"] == pytest.approx(expected, rel=1e-6)
