"""Randomised rollout-shaped batches for the RL tests (numpy, seeded).

Each row is: a few non-action tokens (end of prompt), then 1-3 actions separated by masked
feedback spans, the last action of some rows ending in an answer span, then padding. Some
rows are padding rows (row_weight 0). Groups of 4 include all-correct and all-wrong groups.
"""

from __future__ import annotations

import numpy as np


def rollout_batch(seed: int, batch: int = 8, length: int = 24, group: int = 4, drift: float = 0.3):
    rng = np.random.default_rng(seed)
    action_mask = np.zeros((batch, length), np.float32)
    answer_mask = np.zeros((batch, length), np.float32)
    action_index = np.full((batch, length), -1, np.int32)
    num_searches = np.zeros(batch, np.float32)
    for b in range(batch):
        t = int(rng.integers(0, 3))
        n_actions = int(rng.integers(1, 4))
        for a in range(n_actions):
            run = int(rng.integers(1, 5))
            if t + run > length:
                break
            action_mask[b, t : t + run] = 1
            action_index[b, t : t + run] = a
            last_run = (t, run)
            t += run + int(rng.integers(1, 4))
            num_searches[b] = a
        if rng.random() < 0.6:
            start, run = last_run
            k = int(rng.integers(1, run + 1))
            answer_mask[b, start + run - k : start + run] = 1
    row_weight = np.ones(batch, np.float32)
    row_weight[rng.random(batch) < 0.15] = 0.0
    row_weight[0] = 1.0
    n_groups = batch // group
    rewards = rng.integers(0, 2, size=batch).astype(np.float32)
    if n_groups >= 2:
        rewards[:group] = 1.0  # an all-correct group
        rewards[group : 2 * group] = 0.0  # an all-wrong group
    if n_groups >= 3:
        rewards[2 * group] = 1.0
        rewards[2 * group + 1] = 0.0  # a mixed group
    group_ids = np.repeat(np.arange(n_groups), group)
    old_logp = -np.abs(rng.normal(size=(batch, length))).astype(np.float32) * 2.0
    logp = (old_logp + drift * rng.normal(size=(batch, length))).astype(np.float32)
    ref_logp = (old_logp + 0.5 * rng.normal(size=(batch, length))).astype(np.float32)
    entropy = np.abs(rng.normal(size=(batch, length))).astype(np.float32) * 3.0
    return dict(
        logp=logp,
        old_logp=old_logp,
        ref_logp=ref_logp,
        entropy=entropy,
        rewards=rewards,
        group_ids=group_ids,
        action_mask=action_mask,
        answer_mask=answer_mask,
        action_index=action_index,
        row_weight=row_weight,
        num_searches=num_searches,
    )
