"""Build a :class:`ResponseBatch` from the rollout batch and the token arrays of a training step.

The trainer holds, per step, the ``RolloutBatch`` (``llds_jax.rollout.trajectory``), the
advantages, π_old log-probs of every token (computed once before the updates) and,
optionally, π_new log-probs (one extra no-grad forward after the updates). All token arrays
are token-aligned with ``rollout.input_ids`` (``llds_jax.train.batch``): position ``t`` holds
the value for the token *at* ``t``, as ``rollout.sampler_logprobs`` does; they may be wider
than the rollout (the trainer pads to a fixed length) and are cut to its width.

The trainer reduces its token arrays to per-action sums on device (:func:`action_sums`, inside
the learner's jitted ``step_reductions``) and hands them to :func:`response_batch_from_sums`: no
``[N, T]`` log-prob array reaches the host. :func:`response_batch_from_rollout` does the same from
host arrays (tests, offline replays) with :func:`per_action_sums_np`.

First-action correctness needs "the documents the first search retrieved". The rollout
keeps the feedback token ids rather than document ids, and identical retrievals give
identical feedback ids (same docs, same order, same cut), so the whole first feedback
block serves as one document identity. Only a first action whose search was executed has
one (the rollout records the feedback's kind): the paper's statistic is about the *first* action.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.diagnostics.step_metrics import LOGODDS_CLIP, ResponseBatch, token_logodds

# The per-action sums a ResponseBatch holds, by the key action_sums returns them under.
SUM_FIELDS = {"old_logp": "old_logp_per_action", "tokens": "tokens_per_action",
              "logodds": "logodds_per_action", "delta_logp": "delta_logp_per_action"}


def per_action_sums_np(token_values: np.ndarray, action_index: np.ndarray, num_actions: int) -> np.ndarray:
    """``[N, A]`` sums of ``token_values`` over each action's tokens (actions ≥ A are dropped)."""
    values = np.asarray(token_values, np.float64)
    index = np.asarray(action_index)
    return np.stack([np.where(index == k, values, 0.0).sum(axis=1) for k in range(num_actions)], axis=1)


def per_action_sums(token_values: jax.Array, action_index: jax.Array, num_actions: int) -> jax.Array:
    """:func:`per_action_sums_np` traced (fp32): ``[N, A]`` from ``[N, T]``, without a matmul (TPU's
    default matmul precision would round the values to bf16)."""
    hit = action_index[..., None] == jnp.arange(num_actions)
    return jnp.sum(jnp.where(hit, token_values[..., None].astype(jnp.float32), 0.0), axis=1)


def action_sums(old_logp: jax.Array, action_index: jax.Array, action_mask: jax.Array, num_actions: int,
                new_logp: jax.Array | None = None) -> dict[str, jax.Array]:
    """The per-action sums :func:`response_batch_from_rollout` builds on the host, traced over the
    trainer's token-aligned ``[N, T]`` arrays (padding columns carry ``action_mask`` 0)."""
    mask = action_mask > 0
    old = jnp.where(mask, old_logp.astype(jnp.float32), 0.0)
    logp = jnp.minimum(old, 0.0)
    logodds = jnp.clip(logp - jnp.log(-jnp.expm1(logp)), -LOGODDS_CLIP, LOGODDS_CLIP)  # token_logodds, traced
    out = {"old_logp": per_action_sums(old, action_index, num_actions),
           "tokens": per_action_sums(mask, action_index, num_actions),
           "logodds": per_action_sums(jnp.where(mask, logodds, 0.0), action_index, num_actions)}
    if new_logp is not None:
        new = jnp.where(mask, new_logp.astype(jnp.float32), 0.0)
        out["delta_logp"] = per_action_sums(new - old, action_index, num_actions)
    return out


def first_search_feedback(rollout) -> list[tuple[tuple[int, ...]] | None]:
    """Per row, the first search's feedback ids as a one-element document-identity tuple, or None.

    A row has one when the feedback recorded after its first action is search results
    (``rollout.action_feedback``: kinds recorded by the rollout, no text re-parsed); that
    feedback is the row's first feedback block.
    """
    keys: list[tuple[tuple[int, ...]] | None] = []
    for row in range(rollout.size):
        kinds = rollout.action_feedback[row]
        feedback = np.flatnonzero(rollout.feedback_mask[row])
        if not kinds or kinds[0] != "search" or feedback.size == 0:
            keys.append(None)
            continue
        breaks = np.flatnonzero(np.diff(feedback) > 1)
        end = feedback[breaks[0]] + 1 if breaks.size else feedback[-1] + 1
        keys.append((tuple(int(i) for i in rollout.input_ids[row, feedback[0]:end]),))
    return keys


def first_action_ids(rollout) -> list[tuple[int, ...]]:
    """Per row, the token ids the model wrote in its first action (action index 0, loss-mask 1)."""
    index = np.asarray(rollout.action_index)
    mask = np.asarray(rollout.action_mask, bool)
    ids = np.asarray(rollout.input_ids)
    return [tuple(int(t) for t in ids[row, mask[row] & (index[row] == 0)]) for row in range(mask.shape[0])]


def response_batch_from_rollout(
    rollout,
    *,
    advantage: Sequence[float] | np.ndarray,
    reward: Sequence[float] | np.ndarray,
    old_logprobs: np.ndarray,
    num_action_slots: int,
    new_logprobs: np.ndarray | None = None,
) -> ResponseBatch:
    """Everything :func:`step_diagnostics` needs, from arrays the trainer already has.

    ``num_action_slots`` is fixed per run (``rollout.max_turns + 1``) so every step
    reports the same metric keys; actions beyond it are dropped from per-action sums.
    """
    index = np.asarray(rollout.action_index)
    mask = np.asarray(rollout.action_mask, bool)
    width = mask.shape[1]  # the trainer's arrays are padded to its fixed length: extra columns are padding
    old = np.where(mask, np.asarray(old_logprobs, np.float64)[:, :width], 0.0)
    logodds = np.where(mask, token_logodds(old), 0.0)
    delta = None
    if new_logprobs is not None:
        new = np.where(mask, np.asarray(new_logprobs, np.float64)[:, :width], 0.0)
        delta = per_action_sums_np(new - old, index, num_action_slots)
    return ResponseBatch(
        advantage=np.asarray(advantage, np.float64),
        reward=np.asarray(reward, np.float64),
        old_logp_per_action=per_action_sums_np(old, index, num_action_slots),
        tokens_per_action=per_action_sums_np(mask, index, num_action_slots),
        delta_logp_per_action=delta,
        group_id=np.asarray(rollout.group_ids),
        first_search_docs=first_search_feedback(rollout),
        logodds_per_action=per_action_sums_np(logodds, index, num_action_slots),
        first_action_ids=first_action_ids(rollout),
    )


def response_batch_from_sums(rollout, *, advantage: Sequence[float] | np.ndarray, reward: Sequence[float] | np.ndarray,
                             sums: Mapping[str, np.ndarray]) -> ResponseBatch:
    """:func:`response_batch_from_rollout` from the per-action sums of :func:`action_sums` (this host's rows)."""
    fields = {SUM_FIELDS[key]: np.asarray(value, np.float64) for key, value in sums.items()}
    return ResponseBatch(
        advantage=np.asarray(advantage, np.float64),
        reward=np.asarray(reward, np.float64),
        delta_logp_per_action=fields.pop("delta_logp_per_action", None),
        group_id=np.asarray(rollout.group_ids),
        first_search_docs=first_search_feedback(rollout),
        first_action_ids=first_action_ids(rollout),
        **fields,
    )
