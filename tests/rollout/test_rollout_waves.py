"""Waves (the engine's turn-synchronous policy): a rollout decoded 2, 4 or all rows at a time gives
the same batch, bit for bit.

The policy is a real tiny Qwen2-shaped model over a 12-word vocabulary whose words are the
protocol's tags and a few query words, so that plain random sampling (T = 1, top-p 0.95)
writes searches (answered by the real BM25 retriever), answers, invalid actions and the
Search-R1 cut — every path of the loop — within three turns. Ten trajectories, so waves
of 4 are 4 + 4 + 2 (the last padded with inert rows) and waves of 2 are five.

What must be identical is everything the trainer receives: ids, every mask, the sampler's
log-probs, answers, counts. It is identical because a trajectory samples with
``fold_in(key, trajectory index)`` counted per token it drew, and its cache layout
does not depend on its wave-mates (``sampling/slots.py``); the last test shows that
a per-wave slot index as the key breaks it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llds_jax.models.testing import tiny_model
from llds_jax.rollout import default_config, run_rollouts
from llds_jax.sampling import slots as slots_module

pytestmark = pytest.mark.unit

WORDS = ("[PAD]", "[UNK]", "<|im_end|>", "<search>", "</search>", "<answer>", "</answer>",
         "▁paris", "▁nobel", "▁physics", "▁france", "▁capital")
QUESTIONS = ("who got the first nobel prize in physics", "what is the capital of france", "paris",
             "who was the first person to win the nobel prize of physics and in which year did it happen in europe",
             "capital of the world")
ARRAY_FIELDS = ("input_ids", "attention_mask", "prompt_mask", "action_mask", "feedback_mask", "action_index",
                "answer_mask", "sampler_logprobs", "prompt_lengths", "lengths", "group_ids", "turns", "searches",
                "search_actions_written", "valid_actions", "finished", "truncated")
LIST_FIELDS = ("answers", "action_texts", "response_texts", "action_feedback")


def tag_vocabulary_tokenizer() -> PreTrainedTokenizerFast:
    """A real word-level HF tokenizer: tags and five words are tokens, everything else is [UNK]."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="<|im_end|>")


def wave_config(max_concurrent_rows: int, **overrides):
    cfg = default_config()
    cfg.update(dict(n_samples=2, max_turns=3, max_action_tokens=16, max_obs_tokens=400, max_context=1024,
                    temperature=1.0, top_p=0.95, max_concurrent_rows=max_concurrent_rows, prefill_chunk=128))
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def tokenizer():
    return tag_vocabulary_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0, vocab_size=len(WORDS))


@pytest.fixture(scope="module")
def rollouts(model, tokenizer, bm25):
    """Wave size -> batch; 0 derives the wave from memory (all ten rows on this host)."""
    return {waves: run_rollouts(model, tokenizer, QUESTIONS, bm25, wave_config(waves), key=jax.random.key(7))
            for waves in (0, 4, 2)}


def differences(a, b) -> list[str]:
    """Every field where two batches differ, with the first differing entry."""
    out = []
    for name in ARRAY_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x.shape != y.shape:
            out.append(f"{name}: shapes {x.shape} vs {y.shape}")
        elif not np.array_equal(x, y):
            where = tuple(int(i) for i in np.argwhere(x != y)[0])
            out.append(f"{name}: {int((x != y).sum())} entries differ, first at {where}: {x[where]!r} vs {y[where]!r}")
    for name in LIST_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        rows = [i for i, (u, v) in enumerate(zip(x, y)) if u != v]
        if rows:
            out.append(f"{name}: rows {rows} differ, first {x[rows[0]]!r} vs {y[rows[0]]!r}")
    return out


def test_the_fixture_exercises_searches_answers_invalid_actions_and_different_cache_sizes(rollouts):
    batch = rollouts[0]
    assert [rollouts[w].timings["waves"] for w in (0, 4, 2)] == [1, 3, 5]
    assert batch.searches.sum() >= 2 and batch.finished.sum() >= 2, (batch.searches, batch.finished)
    assert (batch.valid_actions < batch.turns).any(), "no invalid action was written"
    # Some 2-row waves stay within four 128-token blocks while another holds more, so waves
    # read different block counts from each other and from the all-rows wave.
    pairs = batch.lengths.reshape(-1, 2).max(axis=1)
    assert pairs.max() > 512 and pairs.min() + 16 < 512, batch.lengths


@pytest.mark.parametrize("waves", [4, 2])
def test_trajectories_are_identical_whatever_the_wave_size(rollouts, waves):
    diff = differences(rollouts[0], rollouts[waves])
    assert not diff, f"waves of {waves} vs all rows at once:\n" + "\n".join(diff)


def test_chunked_prefill_gives_the_same_trajectories_to_fp32_rounding(model, tokenizer, bm25, rollouts):
    """Prompts (≈100-240 tokens here) prefilled 16 tokens at a time instead of 128, in waves of 4.

    A different chunk width is a different attention shape, so log-probs may differ in the
    last bits (not bit-identical, unlike the wave size); 16 fp32 ulps of the largest |log-prob|.
    """
    chunked = run_rollouts(model, tokenizer, QUESTIONS, bm25, wave_config(4, prefill_chunk=16),
                           key=jax.random.key(7))
    reference = rollouts[0]
    diff = [d for d in differences(reference, chunked) if not d.startswith("sampler_logprobs")]
    assert not diff, "prefill_chunk=16 vs 128:\n" + "\n".join(diff)
    bound = 16 * np.finfo(np.float32).eps * np.abs(reference.sampler_logprobs).max()
    worst = np.abs(chunked.sampler_logprobs - reference.sampler_logprobs).max()
    assert worst <= bound, f"max |Δ logp| {worst:.3g} > {bound:.3g}"


def test_waves_reuse_one_compiled_decode_program_for_a_short_last_wave(model, tokenizer, bm25, monkeypatch):
    """Every decode call of a 4-row-wave rollout of 10 and of 6 trajectories runs the session's 4 rows
    (the waves policy's slots), and the second rollout (waves 4 + 2) compiles no new decode program:
    the 2-row wave leaves two slots idle."""
    widths = []
    real = slots_module.decode_segment

    def spy(graphdef, params, layer_weights, state, *args, **kwargs):
        widths.append(state.tokens.shape[0])
        return real(graphdef, params, layer_weights, state, *args, **kwargs)

    spy._cache_size = real._cache_size
    monkeypatch.setattr(slots_module, "decode_segment", spy)
    cfg = wave_config(4, max_context=512, max_obs_tokens=64)
    run_rollouts(model, tokenizer, QUESTIONS, bm25, cfg, key=jax.random.key(1))
    compiled = real._cache_size()
    run_rollouts(model, tokenizer, QUESTIONS[:3], bm25, cfg, key=jax.random.key(2))
    assert set(widths) == {4}, f"decode rows seen: {sorted(set(widths))}"
    assert real._cache_size() == compiled, "a short last wave compiled a new decode program"


def test_a_wave_local_slot_index_as_the_key_would_change_the_trajectories(model, tokenizer, bm25, rollouts,
                                                                          monkeypatch):
    """The identity above is not vacuous: keyed by the slot a trajectory lands in, waves of 2 differ."""
    reset = slots_module.SlotSession.reset

    def reset_keyed_by_slot(self, slot, trajectory, drawn):
        return reset(self, slot, slot, drawn)

    monkeypatch.setattr(slots_module.SlotSession, "reset", reset_keyed_by_slot)
    wrong = run_rollouts(model, tokenizer, QUESTIONS, bm25, wave_config(2), key=jax.random.key(7))
    assert differences(rollouts[0], wrong), "slot-local keys gave the same batch: the identity test cannot fail"
