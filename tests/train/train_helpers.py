"""Helpers for the trainer tests: a tiny-model config and rollout-shaped arrays."""

from __future__ import annotations

import importlib.util

import numpy as np

from llds_jax.config import base_config

N_PROMPTS, GROUP, SEQ = 4, 4, 32


def tiny_train_config(**train_overrides):
    c = base_config()
    c.model.source = "tiny:qwen2"
    c.model.logprob_chunk_size = 16
    c.mesh.shape = (1, 1, 1)
    t = c.train
    t.prompts_per_step, c.rollout.n_samples = N_PROMPTS, GROUP
    t.mini_batch_size, t.micro_batch_size, t.logprob_batch_size = 8, 8, 8
    t.total_steps, c.rollout.max_context = 10, SEQ
    for key, value in train_overrides.items():
        t[key] = value
    c.optim.lr = 1e-4
    c.optim.warmup_ratio = 0.0
    c.optim.lr_first_step_zero = False
    return c


def tiny_loop_config(workdir: str, tokenizer_dir: str):
    """The whole ``--mode=train`` path at toy size: tiny random model, real tokenizer, bundled corpus."""
    c = tiny_train_config()
    c.workdir = workdir
    c.model.tokenizer = tokenizer_dir
    c.mesh.shape = (2, 1, 1)  # data-parallel: the sampler reads params laid out for the update
    # 16 action tokens: the warm-up's bare "<answer> … </answer>" takes 9+ Qwen tokens (sft.fitted_action).
    c.rollout.update(dict(n_samples=2, max_turns=1, max_action_tokens=16, max_obs_tokens=32, max_prompt_tokens=224,
                          max_context=256, pad_to_multiple=128, top_p=1.0))  # top-p renormalises sampler logp
    t = c.train
    t.prompts_per_step, t.mini_batch_size, t.micro_batch_size, t.logprob_batch_size = 4, 4, 2, 8
    t.total_steps, t.warmup_sft_steps, t.save_every = 2, 2, 0
    c.sft.update(dict(batch_size=2, max_seq_len=384))
    c.retrieval.max_doc_tokens = 16
    c.eval.update(dict(data="bundled:nq_dev", limit=2, batch_size=2))
    c.monitor.enabled = True
    t.profile_steps = (1,)  # test_train_loop: a jax.profiler trace of step 1 of this job
    # The optional logger extras, where installed: test_train_loop compares them with metrics.jsonl.
    t.loggers = ("tensorboard", *(name for name in ("wandb", "mlflow") if importlib.util.find_spec(name)))
    return c


def synthetic_rollout(seed: int = 0, n: int = N_PROMPTS * GROUP, length: int = SEQ) -> dict[str, np.ndarray]:
    """Rollout-shaped arrays: prompt, action 0, masked feedback, action 1 (with an answer span), padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 256, (n, length)).astype(np.int32)
    attention = np.ones((n, length), bool)
    attention[:, 28:] = False
    action = np.zeros((n, length), np.float32)
    action[:, 8:14] = 1
    action[:, 20:27] = 1
    action_index = np.full((n, length), -1, np.int32)
    action_index[:, 8:14] = 0
    action_index[:, 20:27] = 1
    answer = np.zeros((n, length), np.float32)
    answer[:, 22:27] = 1
    rewards = (rng.random(n) < 0.5).astype(np.float32)
    return dict(input_ids=ids, attention_mask=attention, action_mask=action, action_index=action_index,
                answer_mask=answer, num_searches=np.ones(n, np.float32), rewards=rewards,
                group_ids=np.repeat(np.arange(n // GROUP), GROUP))




def mixed_rollout(seed: int = 0, n: int = N_PROMPTS * GROUP, length: int = 64) -> dict[str, np.ndarray]:
    """Rollout-shaped arrays of mixed lengths (12 … ``length`` real tokens, right-padded), so packing
    puts several trajectories in a row: prompt, action 0, masked feedback, action 1 ending in an answer."""
    rng = np.random.default_rng(seed)
    arrays = synthetic_rollout(seed, n, length)
    arrays["attention_mask"][:] = False
    arrays["action_mask"][:] = 0
    arrays["action_index"][:] = -1
    arrays["answer_mask"][:] = 0
    lengths = rng.integers(12, length + 1, n)
    lengths[rng.integers(n)] = length  # one full-length row: packed alone
    for j, total in enumerate(lengths):
        prompt = int(rng.integers(4, 8))
        first = int(rng.integers(1, max(2, (total - prompt) // 3)))
        feedback = int(rng.integers(1, max(2, (total - prompt - first) // 2)))
        second_start = prompt + first + feedback
        arrays["attention_mask"][j, :total] = True
        arrays["action_mask"][j, prompt:prompt + first] = 1
        arrays["action_index"][j, prompt:prompt + first] = 0
        if second_start < total:
            arrays["action_mask"][j, second_start:total] = 1
            arrays["action_index"][j, second_start:total] = 1
            arrays["answer_mask"][j, max(second_start, total - 3):total] = 1
        arrays["input_ids"][j, total:] = 0
    return arrays
