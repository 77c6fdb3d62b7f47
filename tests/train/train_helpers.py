"""Helpers for the trainer tests: a tiny-model config and rollout-shaped arrays."""

from __future__ import annotations

import numpy as np

from llds_jax.train.config import base_config

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


