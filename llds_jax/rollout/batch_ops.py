"""Row selection and concatenation of :class:`~llds_jax.rollout.trajectory.RolloutBatch` records.

Dynamic sampling (``train.dynamic_sampling``, DAPO's ``filter_groups``) keeps the mixed groups
of several rollouts of one step and trains on them as one batch; these are the two operations
it needs, kept beside the record so every field is carried (a field added to ``RolloutBatch``
fails :func:`concatenate` loudly until it has a padding rule here, rather than being dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llds_jax.rollout.trajectory import RolloutBatch

# [N, L] fields and the value of their right-padding columns (``input_ids``' is the tokenizer's pad id).
_TOKEN_PADDING = {"attention_mask": False, "prompt_mask": False, "action_mask": False, "feedback_mask": False,
                  "action_index": -1, "answer_mask": False, "sampler_logprobs": 0.0}
_ROW_FIELDS = ("prompt_lengths", "lengths", "group_ids", "turns", "searches", "search_actions_written",
               "valid_actions", "finished", "truncated")
_LIST_FIELDS = ("response_texts", "action_texts", "answers", "action_feedback")


def _check_fields() -> None:
    known = {"input_ids", *_TOKEN_PADDING, *_ROW_FIELDS, *_LIST_FIELDS, "timings"}
    fields = {f.name for f in dataclasses.fields(RolloutBatch)}
    if fields != known:
        raise TypeError(f"RolloutBatch fields {sorted(fields ^ known)} have no rule in rollout/batch_ops.py")


def take_rows(batch: RolloutBatch, rows: Sequence[int]) -> RolloutBatch:
    """The rows ``rows`` of ``batch`` (in that order), every field; timings kept as they are."""
    _check_fields()
    index = np.asarray(rows, np.int64)
    arrays = {name: getattr(batch, name)[index] for name in ("input_ids", *_TOKEN_PADDING, *_ROW_FIELDS)}
    lists = {name: [getattr(batch, name)[i] for i in index] for name in _LIST_FIELDS}
    return RolloutBatch(**arrays, **lists, timings=dict(batch.timings))


def concatenate(batches: Sequence[RolloutBatch], *, pad_id: int) -> RolloutBatch:
    """One batch of the rows of ``batches`` in order; ``[N, L]`` fields right-padded to the widest ``L``.

    Each rollout pads to its own longest trajectory (a multiple of ``rollout.pad_to_multiple``),
    so widths differ; padding columns get the values the rollout itself writes there (``pad_id``
    for ids, no mask, action index -1, log-prob 0). ``timings`` are summed per phase: the
    seconds all the rollouts took.
    """
    _check_fields()
    if not batches:
        raise ValueError("concatenate needs at least one RolloutBatch")
    width = max(b.input_ids.shape[1] for b in batches)

    def padded(name, value):
        return np.concatenate([np.pad(getattr(b, name), ((0, 0), (0, width - b.input_ids.shape[1])),
                                      constant_values=value) for b in batches])

    arrays = {"input_ids": padded("input_ids", pad_id)}
    arrays.update({name: padded(name, value) for name, value in _TOKEN_PADDING.items()})
    arrays.update({name: np.concatenate([getattr(b, name) for b in batches]) for name in _ROW_FIELDS})
    lists = {name: [item for b in batches for item in getattr(b, name)] for name in _LIST_FIELDS}
    return RolloutBatch(**arrays, **lists, timings=summed_timings(batches))


# Engine counts that add up over several rollouts of a step (the rest describe one engine: its slots,
# pool, block size, peaks; their largest is kept).
SUMMED_COUNTS = frozenset({"decode_steps", "decode_tokens", "decode_key_reads", "decode_calls", "appends", "waves",
                           "retrieval_batches", "preemptions"})


def summed_timings(batches: Sequence[RolloutBatch]) -> dict:
    """``batches``' timings as one step's (several rollouts of it): seconds per phase (``*_s``) and the
    work counts (:data:`SUMMED_COUNTS`) summed; the engine's sizes and peaks (slots, pool, blocks) at
    their largest, per-device lists element by element."""
    timings: dict = {}
    for b in batches:
        for key, value in b.timings.items():
            if isinstance(value, (list, tuple)):
                old = timings.get(key, [])
                timings[key] = [max(x, y) for x, y in zip(old, value)] + list(value[len(old):]) + old[len(value):]
            elif key.endswith("_s") or key in SUMMED_COUNTS:
                timings[key] = timings.get(key, 0) + value
            else:
                timings[key] = max(timings.get(key, value), value)
    return timings
