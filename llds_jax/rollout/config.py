"""The ``rollout`` config section and the terminator ids a policy stops on."""

from __future__ import annotations

import ml_collections

# Chat-turn terminators and end-of-text markers of the supported families; those present in
# a tokenizer's vocabulary stop an action in addition to its eos token.
TERMINATOR_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def default_config() -> ml_collections.ConfigDict:
    """Search-R1 reference limits (SPEC §2) and training-time sampling (T=1, top-p 0.95)."""
    return ml_collections.ConfigDict(dict(
        max_turns=3,               # searches allowed before the last, search-disabled turn (2 for NQ-only)
        max_action_tokens=500,     # per-action cap (reference max_response_length per turn)
        max_obs_tokens=500,        # feedback cut (reference max_obs_length)
        max_prompt_tokens=2048,    # prompt keeps its last tokens (reference max_start_length)
        max_context=4096,          # prompt + all actions + all feedback
        topk=3,                    # passages per search
        n_samples=5,               # trajectories per question (the GRPO group size)
        temperature=1.0,           # 0 = greedy
        top_p=0.95,
        top_k=0,                   # 0 = off
        stop_token_ids=(),         # () = the tokenizer's eos plus TERMINATOR_TOKENS it knows
        pad_to_multiple=128,       # the returned arrays' L is a multiple of this (fewer trainer recompiles)
        # Memory (llds_jax/rollout/kv_plan.py): under the waves policy trajectories are decoded in waves of
        # at most max_concurrent_rows rows; results are the same whatever the wave size.
        max_concurrent_rows=0,     # 0 = derive from memory_fraction x device memory, weights and KV bytes per row
        memory_fraction=0.9,       # share of a device's memory the rollout may fill (vLLM's gpu_memory_utilization)
        cpu_memory_bytes=0,        # a CPU device's memory when deriving (0 = /proc/meminfo MemTotal / local devices)
        prefill_chunk=512,         # prompts are prefilled at most this many tokens at a time (0 = whole prompt)
        # The engine's scheduling policy (llds_jax/rollout/engine.py; one engine, one paged KV cache, one
        # decode program): "waves" = turn-synchronous waves (the CPU default: 10 % faster on the default
        # job's rollout, docs/performance.md); "continuous" = slots that each advance their own trajectory,
        # retrieval on a host thread, no turn barrier. Both give the same trajectories (tests/rollout/test_engine.py).
        engine="waves",
        segment_tokens=8,          # continuous: decode steps per device call before the host looks at the slots
        sampler_devices=0,         # continuous: local devices that hold rows (0 = one, -1 = all; weights replicated)
        kv_block_tokens=128,       # tokens per paged-KV block (128 = the attention's key block: same bits)
        kv_blocks=0,               # continuous: each sampler device's pool in blocks (0 = rollout/kv_plan.engine_sizing)
        slot_tokens=512,           # engine memory plan: the expected length a slot is sized for (rollout/kv_plan.py)
        prefill_rows=16,           # engine memory plan: rows one append call holds workspace for
    ))


ENGINES = ("waves", "continuous")


def terminator_ids(tokenizer, configured=()) -> tuple[int, ...]:
    """``configured`` when given, else the eos id plus every known terminator in the vocabulary."""
    if configured:
        return tuple(int(i) for i in configured)
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[t] for t in TERMINATOR_TOKENS if t in vocab)
    return tuple(dict.fromkeys(ids))
