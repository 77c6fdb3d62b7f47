"""Dynamic sampling (train.dynamic_sampling, DAPO's filter_groups): which groups are kept, the batch shape, the cap.

Unit level on RolloutBatch records built from arrays (train.dynamic_sampling.select, the loop's
dynamic_batch with a draw function that returns prepared draws); then a real tiny job (random
tiny model, real tokenizer, bundled BM25 corpus, a seeded coin-flip reward so groups are mixed
at random) through ``rl_loop``: draws are logged, the cap holds, the learner's own count of
rows with A ≠ 0 is the kept groups' rows, and every jitted function compiles once.
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_collections import ConfigDict
from train_helpers import tiny_loop_config

from llds_jax.rollout.batch_ops import concatenate, take_rows
from llds_jax.rollout.trajectory import RolloutBatch
from llds_jax.train.dynamic_sampling import Draw, draw_metrics, mixed_groups, select
from llds_jax.train.loop import dynamic_batch

pytestmark = pytest.mark.unit

PAD = 7


def rollout(rewards_by_group, *, width: int, first_group: int = 0, seed: int = 0, timings=None) -> tuple:
    """A RolloutBatch of len(rewards_by_group) groups (question-major) whose ids say (group, row) and its rewards."""
    n = len(rewards_by_group[0])
    rows = len(rewards_by_group) * n
    rng = np.random.default_rng(seed)
    ids = np.full((rows, width), PAD, np.int32)
    lengths = rng.integers(4, width + 1, rows)
    for r, length in enumerate(lengths):
        ids[r, :length] = 1000 * seed + r + 1  # row identity in every real token
    real = ids != PAD
    action = real & (np.arange(width) >= 2)
    index = np.where(action, 0, -1).astype(np.int32)
    batch = RolloutBatch(
        input_ids=ids, attention_mask=real, prompt_mask=real & ~action, action_mask=action,
        feedback_mask=np.zeros_like(real), action_index=index, answer_mask=np.zeros_like(real),
        sampler_logprobs=np.where(action, -0.5, 0.0).astype(np.float32),
        prompt_lengths=np.full(rows, 2, np.int32), lengths=lengths.astype(np.int32),
        group_ids=np.repeat(np.arange(first_group, first_group + len(rewards_by_group)), n),
        turns=np.ones(rows, np.int32), searches=np.zeros(rows, np.int32),
        search_actions_written=np.zeros(rows, np.int32), valid_actions=np.ones(rows, np.int32),
        finished=np.ones(rows, bool), truncated=np.zeros(rows, bool),
        response_texts=[f"r{seed}.{r}" for r in range(rows)], action_texts=[[f"a{seed}.{r}"] for r in range(rows)],
        answers=[None] * rows, action_feedback=[[None]] * rows, timings=timings or {"total_s": 1.0})
    return batch, np.asarray(rewards_by_group, np.float32).reshape(-1)


def draw(rewards_by_group, **kwargs) -> Draw:
    batch, rewards = rollout(rewards_by_group, **kwargs)
    records = [f"q{kwargs.get('seed', 0)}.{g}" for g in range(len(rewards_by_group))]
    return Draw(batch, rewards, records)


def test_mixed_groups_are_those_whose_rewards_differ():
    batch, rewards = rollout([[0, 0], [0, 1], [1, 1], [0.5, 0.5], [1, 0]], width=8)
    np.testing.assert_array_equal(mixed_groups(rewards, batch.group_ids), [False, True, False, False, True])


def test_concatenate_pads_to_the_widest_with_the_rollouts_padding_and_sums_timings():
    a, _ = rollout([[0, 1]], width=8, seed=1, timings={"total_s": 1.5, "decode_s": 1.0})
    b, _ = rollout([[1, 1], [0, 0]], width=16, seed=2, timings={"total_s": 2.0})
    both = concatenate([a, b], pad_id=PAD)
    assert both.input_ids.shape == (6, 16) and both.size == 6
    np.testing.assert_array_equal(both.input_ids[:2, :8], a.input_ids)
    assert (both.input_ids[:2, 8:] == PAD).all() and (both.action_index[:2, 8:] == -1).all()
    assert not both.attention_mask[:2, 8:].any() and (both.sampler_logprobs[:2, 8:] == 0).all()
    np.testing.assert_array_equal(both.input_ids[2:], b.input_ids)
    assert both.response_texts == a.response_texts + b.response_texts
    assert both.timings == {"total_s": 3.5, "decode_s": 1.0}
    picked = take_rows(both, [5, 0])
    assert picked.response_texts == [both.response_texts[5], both.response_texts[0]]
    np.testing.assert_array_equal(picked.lengths, both.lengths[[5, 0]])


def test_the_engines_counts_add_up_and_its_sizes_stay_one_engines():
    """Two draws' engine timings (what every model rollout records): seconds and work counts add up, the
    engine's sizes and peaks stay the largest one engine had, per-device lists go element by element."""
    engine = dict(decode_s=1.0, decode_steps=10, waves=1, slots=8, peak_kv_blocks=5,
                  busy_rows_per_device=[3, 1], rows_per_device=[4, 4])
    a, _ = rollout([[0, 1]], width=8, seed=1, timings=engine)
    b, _ = rollout([[1, 1]], width=8, seed=2, timings=dict(engine, decode_steps=4, peak_kv_blocks=7,
                                                           busy_rows_per_device=[2, 4]))
    assert concatenate([a, b], pad_id=PAD).timings == dict(
        decode_s=2.0, decode_steps=14, waves=2, slots=8, peak_kv_blocks=7, busy_rows_per_device=[3, 4],
        rows_per_device=[4, 4])


def test_select_keeps_exactly_the_mixed_groups_in_draw_order_with_a_constant_shape():
    draws = [draw([[0, 0], [0, 1], [1, 1]], width=8, seed=1),
             draw([[1, 0], [0, 0], [1, 0]], width=16, seed=2)]
    chosen = select(draws, 3, pad_id=PAD, first_group=10)
    assert chosen.rollout.input_ids.shape[0] == 3 * 2
    # group 1 of draw 0, groups 0 and 2 of draw 1 — row identities 1000·seed + row + 1
    np.testing.assert_array_equal(chosen.rollout.input_ids[:, 0], [1003, 1004, 2001, 2002, 2005, 2006])
    np.testing.assert_array_equal(chosen.rewards, [0, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(chosen.rollout.group_ids, [10, 10, 11, 11, 12, 12])
    assert chosen.records == ["q1.1", "q2.0", "q2.2"]
    assert chosen.metrics == {"dynamic/draws": 2.0, "dynamic/prompts_drawn": 6.0, "dynamic/mixed_groups_drawn": 3.0,
                              "dynamic/mixed_frac": 0.5, "dynamic/groups_kept": 3.0, "dynamic/filled_groups": 0.0}
    # surplus mixed groups are dropped (verl: batch[:traj_bsz]); the shape stays num_groups × n
    assert select(draws, 2, pad_id=PAD).rollout.input_ids.shape[0] == 4


def test_short_of_mixed_groups_the_batch_is_filled_with_uniform_groups_earliest_first():
    draws = [draw([[0, 0], [0, 1], [1, 1]], width=8, seed=1), draw([[0, 0], [0, 0], [1, 1]], width=8, seed=2)]
    chosen = select(draws, 3, pad_id=PAD)
    assert chosen.records == ["q1.1", "q1.0", "q1.2"]
    assert chosen.metrics["dynamic/groups_kept"] == 1 and chosen.metrics["dynamic/filled_groups"] == 2
    with pytest.raises(ValueError, match="fewer than the 7"):
        select(draws, 7, pad_id=PAD)


class _Config:
    def __init__(self, cap: int):
        self.train = ConfigDict({"dynamic_sampling_max_draws": cap})  # read as an attribute, as the config's


@pytest.mark.parametrize("cap", [1, 3])
def test_the_loop_draws_until_enough_mixed_groups_or_the_cap(cap):
    uniform = [draw([[0, 0], [1, 1]], width=8, seed=s) for s in range(5)]
    calls = []

    def next_draw(number):
        calls.append(number)
        return uniform[number]

    rollout_, rewards, records, metrics = dynamic_batch(uniform[0], next_draw, _Config(cap), pad_id=PAD)
    assert calls == list(range(1, cap)) and metrics["dynamic/draws"] == cap
    assert metrics["dynamic/filled_groups"] == 2 and rollout_.size == 4
    assert metrics["reward/mean"] == 0.5 and metrics["dynamic/prompts_drawn"] == 2 * cap

    mixed = [uniform[0], draw([[0, 1], [1, 1]], width=8, seed=8), draw([[1, 0], [0, 0]], width=16, seed=9)]
    calls.clear()
    rollout_, rewards, records, metrics = dynamic_batch(mixed[0], lambda n: calls.append(n) or mixed[n],
                                                        _Config(5), pad_id=PAD)
    assert calls == [1, 2] and metrics["dynamic/groups_kept"] == 2 and metrics["dynamic/filled_groups"] == 0
    assert list(records.values()) == ["q8.0", "q9.0"] and list(records) == [0, 1]
    assert metrics["reward/trained_mean"] == 0.5


def test_draw_metrics_count_uniform_groups_as_filled_without_dynamic_sampling():
    metrics = draw_metrics([draw([[0, 0], [0, 1], [1, 1], [1, 0]], width=8)], 4)
    assert metrics["dynamic/mixed_frac"] == 0.5 and metrics["dynamic/filled_groups"] == 2


@pytest.fixture(scope="module")
def dynamic_job(tmp_path_factory, shared_dir):
    """Three RL steps of the tiny job with dynamic sampling, cap 3, and a seeded coin-flip reward (P = 0.3)."""
    from llds_jax.app.run import _setup
    from llds_jax.data.prompts import PromptIterator, load_questions
    from llds_jax.train.learner import Learner
    from llds_jax.train.loop import rl_loop
    from llds_jax.train.metrics import read_metrics

    config = tiny_loop_config(str(tmp_path_factory.mktemp("dyn")), str(shared_dir / "assets" / "qwen2_tokenizer"))
    config.train.update(dict(total_steps=3, warmup_sft_steps=0, profile_steps=(), loggers=(),
                             dynamic_sampling=True, dynamic_sampling_max_draws=3))
    config.monitor.enabled = False
    config.rollout.max_action_tokens = 8
    # Rows of 128, not the tiny job's 256: the prompt's last 64 tokens and the 8 + 32 + 8 response tokens fit,
    # and every rollout, log-prob pass and update computes the ~152k-word LM head at each position.
    config.rollout.max_prompt_tokens, config.rollout.max_context = 64, 128
    _, mesh, model, tokenizer, retriever, writer = _setup(config)
    learner = Learner.create(model, config, mesh)
    prompts = PromptIterator(load_questions(config.data.train), config.train.prompts_per_step, seed=0)
    rng = np.random.default_rng(0)
    trained_rewards = []
    real_update = Learner.update

    def recording_update(self, batch, *args, **kwargs):
        trained_rewards.append(np.asarray(batch.rewards))
        return real_update(self, batch, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Learner, "update", recording_update)
        rl_loop(learner, tokenizer, retriever, prompts, writer, config,
                reward_fn=lambda answers, golden: (rng.random(len(answers)) < 0.3).astype(np.float32))
    writer.close()
    rows = [r for r in read_metrics(config.workdir) if r["phase"] == "rl"]
    return dict(rows=rows, learner=learner, config=config, trained_rewards=trained_rewards, prompts=prompts)


@pytest.mark.integration
def test_a_tiny_job_logs_draws_within_the_cap_and_trains_the_kept_groups(dynamic_job):
    rows, config = dynamic_job["rows"], dynamic_job["config"]
    groups = config.train.prompts_per_step
    assert len(rows) == 3
    for row in rows:
        assert 1 <= row["dynamic/draws"] <= 3
        assert row["dynamic/prompts_drawn"] == groups * row["dynamic/draws"]
        assert row["dynamic/groups_kept"] + row["dynamic/filled_groups"] == groups
        if row["dynamic/draws"] < 3:  # stopped early: enough mixed groups
            assert row["dynamic/groups_kept"] == groups
        # the learner's own count of rows with A ≠ 0 is the kept (mixed) groups' rows
        assert row["advantage/nonzero_frac"] == pytest.approx(row["dynamic/groups_kept"] / groups, abs=1e-6)
    assert sum(row["dynamic/draws"] for row in rows) > 3, "no step drew a second batch: the test shows nothing"
    for rewards, row in zip(dynamic_job["trained_rewards"], rows, strict=True):
        assert rewards.shape == (groups * config.rollout.n_samples,)  # the same shape every step
        by_group = rewards.reshape(groups, config.rollout.n_samples)
        assert (np.ptp(by_group, axis=1) > 0).sum() == row["dynamic/groups_kept"]
    state = dynamic_job["prompts"].state_dict()  # the iterator advanced one prompt batch per draw
    assert state["epoch"] == 0 and state["position"] == groups * sum(row["dynamic/draws"] for row in rows)


@pytest.mark.integration
def test_a_tiny_job_with_dynamic_sampling_compiles_each_function_once(dynamic_job):
    counts = dynamic_job["learner"].compile_counts()
    assert counts["update"] == 1 and counts["policy_logprobs"] == 1, counts
