"""The continuous policy gives the waves policy's trajectories whatever its schedule.

Same tiny policy, tokenizer, questions and real BM25 retriever as the waves test
(``test_rollout_waves.py``), so every path of the protocol runs: searches, answers, invalid
actions, the Search-R1 cut and the last search-disabled turn. Trajectory ``i`` samples with
``fold_in(key, i)`` counted per drawn token and owns its cache row, so its ids, masks and
sampler log-probs must be bit-identical across slot counts {1, 3, all}, a retriever with
random delays, and the turn-synchronous waves (the same engine and paged cache under its other
policy). The one measured exception is preemption by
recompute: a resumed trajectory's history is re-prefilled, whose keys and values round
differently from the one-token decode that first wrote them: ids and masks stay identical,
a few action log-probs move by 1 ulp (the test allows 2).
"""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest

from llds_jax.models.testing import tiny_model
from llds_jax.rollout import run_rollouts
from llds_jax.sampling import slots as slots_module
from tests.rollout.test_rollout_waves import (
    ARRAY_FIELDS,
    QUESTIONS,
    WORDS,
    differences,
    tag_vocabulary_tokenizer,
    wave_config,
)

pytestmark = pytest.mark.unit

KEY = 7


@pytest.fixture(scope="module")
def tokenizer():
    return tag_vocabulary_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0, vocab_size=len(WORDS))


@pytest.fixture(scope="module")
def waves(model, tokenizer, bm25):
    return run_rollouts(model, tokenizer, QUESTIONS, bm25, wave_config(0), key=jax.random.key(KEY))


def engine(model, tokenizer, retriever, slots: int, **overrides):
    config = wave_config(slots, engine="continuous", **overrides)
    return run_rollouts(model, tokenizer, QUESTIONS, retriever, config, key=jax.random.key(KEY))


@pytest.mark.parametrize("slots", [1, 3, 0])
def test_continuous_matches_the_waves_bit_for_bit_at_any_slot_count(model, tokenizer, bm25, waves, slots):
    batch = engine(model, tokenizer, bm25, slots)
    assert differences(waves, batch) == []
    assert batch.timings["slots"] == (slots or 10) and batch.timings["preemptions"] == 0  # derived: every trajectory
    # the decode counters (MBU, tokens/s) mean the same under either schedule: the same tokens at the same contexts
    for counter in ("decode_tokens", "decode_key_reads"):
        assert batch.timings[counter] == waves.timings[counter] > 0, counter
    assert 0 < batch.timings["decode_steps"] <= batch.timings["decode_tokens"]
    assert batch.searches.sum() > 0 and batch.finished.any() and (batch.turns == 4).any()  # every path ran


@pytest.mark.parametrize("slots, rows_per_device, busy", [(0, [3] * 4, [3, 3, 2, 2]), (3, [2] * 4, [1] * 4)])
def test_four_local_devices_each_hold_rows_and_sample_the_same_trajectories(model, tokenizer, bm25, waves, slots,
                                                                             rows_per_device, busy):
    """Rows split over 4 of the 8 simulated CPU devices (weights replicated device to device):
    every device holds rows, and the batch is the one-device waves', bit for bit. 3 slots
    round up to 4 (one per device), allocated as 2 rows per device (``slots.MIN_ROWS``); derived
    slots (``kv_plan.engine_sizing``) are the 10 trajectories rounded up to 12, which decode 3, 3, 2
    and 2 at once (slots are dealt round-robin)."""
    batch = engine(model, tokenizer, bm25, slots, sampler_devices=4)
    assert batch.timings["sampler_devices"] == 4 and batch.timings["rows_per_device"] == rows_per_device
    assert batch.timings["busy_rows_per_device"] == busy  # the most rows each device decoded in one call
    assert differences(waves, batch) == []


class DelayedRetriever:
    """The real retriever behind random sleeps; records how many decode calls ran during each search."""

    def __init__(self, inner, decode_calls):
        self.inner, self.decode_calls = inner, decode_calls
        self.rng = random.Random(0)
        self.overlaps: list[int] = []

    def search(self, queries, topk):
        before = self.decode_calls[0]
        time.sleep(self.rng.uniform(0.05, 0.4))
        results = self.inner.search(queries, topk)
        self.overlaps.append(self.decode_calls[0] - before)
        return results


def test_random_retrieval_delays_change_nothing_and_decoding_goes_on_meanwhile(model, tokenizer, bm25, waves,
                                                                                 monkeypatch):
    decode_calls = [0]
    original = slots_module.SlotSession.decode

    def counted(self, steps):
        decode_calls[0] += 1
        return original(self, steps)

    monkeypatch.setattr(slots_module.SlotSession, "decode", counted)
    retriever = DelayedRetriever(bm25, decode_calls)
    assert threading.current_thread() is threading.main_thread()
    batch = engine(model, tokenizer, retriever, 3, segment_tokens=3)
    assert differences(waves, batch) == []
    assert max(retriever.overlaps) > 0, f"no decode call ran while a search was out: {retriever.overlaps}"


def test_preemption_by_recompute_keeps_every_trajectory_and_its_ids(model, tokenizer, bm25, waves):
    """A pool of 9 128-token blocks (one trajectory's 1,024-token cap plus one) for 10 slots forces
    preemptions by real block exhaustion in the paged cache; nothing is dropped."""
    batch = engine(model, tokenizer, bm25, 0, kv_blocks=9)
    assert batch.timings["preemptions"] > 0 and batch.timings["peak_kv_blocks"] <= 9
    exact = [name for name in ARRAY_FIELDS if name != "sampler_logprobs"]
    assert [d for d in differences(waves, batch) if d.split(":")[0] in exact] == []
    assert batch.answers == waves.answers and batch.action_texts == waves.action_texts
    got, want = batch.sampler_logprobs, waves.sampler_logprobs
    differing = int((got != want).sum())
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    # a re-prefilled key rounds differently from the decoded one: 1 ulp measured on XLA:CPU, every token the same
    assert ulps.max() <= 2, (differing, int(ulps.max()))


def test_scripted_policies_keep_the_turn_loop(tokenizer, bm25):
    """The engine needs a model; a scripted :class:`Policy` runs the host turn loop whatever the setting."""
    from llds_jax.rollout.action_stop import action_stop_table
    from llds_jax.rollout.scripted_policy import ScriptedPolicy
    from llds_jax.sampling import vocab_bytes

    turns = [tokenizer.encode("<answer> paris </answer>", add_special_tokens=False)]
    policy = ScriptedPolicy([turns] * 4, action_stop_table(vocab_bytes(tokenizer)))
    batch = run_rollouts(policy, tokenizer, QUESTIONS[:2], bm25, wave_config(0, engine="continuous"))
    assert batch.timings["waves"] == 1 and "slots" not in batch.timings and batch.size == 4
