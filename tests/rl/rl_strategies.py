"""Hypothesis strategy for rollout-shaped objective inputs of one fixed shape (jit once)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from llds_jax import rl

BATCH, LENGTH = 6, 16


@st.composite
def rollouts(draw, *, single_action: bool = False, same_policy: bool = False):
    """(logp, old_logp, ref_logp, entropy, advantages [B], masks) with actions split by feedback."""
    action_mask = np.zeros((BATCH, LENGTH), np.float32)
    answer_mask = np.zeros((BATCH, LENGTH), np.float32)
    action_index = np.full((BATCH, LENGTH), -1, np.int32)
    for b in range(BATCH):
        t = draw(st.integers(0, 2))
        n_actions = 1 if single_action else draw(st.integers(1, 3))
        last = None
        for a in range(n_actions):
            run = draw(st.integers(1, 4))
            if t + run > LENGTH:
                break
            action_mask[b, t : t + run] = 1
            action_index[b, t : t + run] = a
            last = (t, run)
            t += run + draw(st.integers(1, 3))
        if last is not None and draw(st.booleans()):
            start, run = last
            answer_mask[b, start + run - draw(st.integers(1, run)) : start + run] = 1
    row_weight = np.asarray(draw(st.lists(st.booleans(), min_size=BATCH, max_size=BATCH)), np.float32)
    row_weight[0] = 1.0
    advantages = np.asarray(
        draw(st.lists(st.sampled_from([-1.2, -0.5, 0.0, 0.5, 1.2]), min_size=BATCH, max_size=BATCH)),
        np.float32,
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    old_logp = (-2.0 * np.abs(rng.normal(size=(BATCH, LENGTH)))).astype(np.float32)
    drift = 0.0 if same_policy else 0.3
    logp = (old_logp + drift * rng.normal(size=(BATCH, LENGTH))).astype(np.float32)
    ref_logp = (old_logp + 0.5 * rng.normal(size=(BATCH, LENGTH))).astype(np.float32)
    entropy = (3.0 * np.abs(rng.normal(size=(BATCH, LENGTH)))).astype(np.float32)
    masks = rl.LossMasks(
        action_mask=jnp.asarray(action_mask),
        answer_mask=jnp.asarray(answer_mask),
        action_index=jnp.asarray(action_index),
        row_weight=jnp.asarray(row_weight),
        num_searches=jnp.asarray(rng.integers(0, 4, size=BATCH).astype(np.float32)),
    )
    return (
        jnp.asarray(logp),
        jnp.asarray(old_logp),
        jnp.asarray(ref_logp),
        jnp.asarray(entropy),
        jnp.asarray(advantages),
        masks,
    )
