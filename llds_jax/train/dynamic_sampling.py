"""Dynamic sampling (DAPO §3.2; verl's ``algorithm.filter_groups``): train only on mixed groups.

A group whose rewards are all equal has GRPO advantage 0 on every row: it adds no policy
gradient, yet it dilutes the token-mean loss and every per-token statistic. With
``train.dynamic_sampling`` the loop rolls out ``train.prompts_per_step`` prompts at a time and
keeps only the mixed groups until it holds ``prompts_per_step`` of them, drawing at most
``train.dynamic_sampling_max_draws`` prompt batches per step (the first included).

The trained batch always has ``prompts_per_step × rollout.n_samples`` rows (one compile per
run): surplus mixed groups of the last draw are dropped (verl: ``batch[:traj_bsz]``). When the
cap is reached with too few mixed groups, verl raises (``max_num_gen_batches``); here the step
goes on and fills the missing groups with uniform groups drawn in this step, earliest first —
the zero-advantage groups plain GRPO trains on — and says so in ``dynamic/filled_groups``, so
a run whose policy stops producing mixed groups (a format collapse) is recorded, not killed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from llds_jax.rollout.batch_ops import concatenate, summed_timings, take_rows


class Draw(NamedTuple):
    """One rollout of a prompt batch: the batch, its per-row rewards and the prompts' records by group."""

    rollout: object  # RolloutBatch, question-major, groups contiguous
    rewards: np.ndarray  # [N] float32
    records: Sequence  # records[i]: the prompt of the draw's i-th group (in row order)
    epoch: int = 0  # the prompt iterator's epoch the batch came from


def group_rows(group_ids: np.ndarray) -> list[np.ndarray]:
    """Row indices of each group, groups in order of first appearance."""
    group_ids = np.asarray(group_ids)
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    order = np.argsort(first)
    return [np.flatnonzero(inverse == g) for g in order]


def mixed_groups(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """bool per group (order of first appearance): True where the group's rewards are not all equal.

    verl keeps ``std > 0``; equality is the same test without float round-off. (A group of one
    sample has no spread and is dropped here: its GRPO advantage is 0 too.)
    """
    rewards = np.asarray(rewards)
    return np.array([np.ptp(rewards[rows]) > 0 for rows in group_rows(group_ids)], bool)


class Selection(NamedTuple):
    rollout: object  # RolloutBatch of the trained groups, group ids renumbered first_group, first_group + 1, ...
    rewards: np.ndarray
    records: list  # records[i]: the prompt of trained group first_group + i
    metrics: dict[str, float]


def select(draws: Sequence[Draw], num_groups: int, *, pad_id: int, first_group: int = 0) -> Selection:
    """The ``num_groups`` groups to train on: mixed groups in draw order, then uniform ones if short.

    Raises when the draws hold fewer than ``num_groups`` groups in all (the cap is at least one
    full prompt batch, so a loop cannot get there).
    """
    kept, filler = [], []  # (draw index, rows, record)
    drawn_groups = 0
    for index, draw in enumerate(draws):
        groups = group_rows(draw.rollout.group_ids)
        drawn_groups += len(groups)
        for rows, mixed, record in zip(groups, mixed_groups(draw.rewards, draw.rollout.group_ids), draw.records,
                                       strict=True):
            (kept if mixed else filler).append((index, rows, record))
    if drawn_groups < num_groups:
        raise ValueError(f"dynamic sampling drew {drawn_groups} groups, fewer than the {num_groups} a step trains on")
    chosen = kept[:num_groups] + filler[:max(0, num_groups - len(kept))]
    parts, rewards, records = [], [], []
    for group, (index, rows, record) in enumerate(chosen):
        part = take_rows(draws[index].rollout, rows)
        parts.append(dataclasses.replace(part, group_ids=np.full(len(rows), first_group + group,
                                                                 part.group_ids.dtype)))
        rewards.append(np.asarray(draws[index].rewards)[rows])
        records.append(record)
    batch = concatenate(parts, pad_id=pad_id).with_timings(summed_timings([d.rollout for d in draws]))
    metrics = draw_metrics(draws, num_groups)
    return Selection(batch, np.concatenate(rewards).astype(np.float32), records, metrics)


def draw_metrics(draws: Sequence[Draw], num_groups: int) -> dict[str, float]:
    """The ``dynamic/*`` counts of a step that trains ``num_groups`` groups out of ``draws``.

    Logged with dynamic sampling off too (one draw; the uniform groups trained are then the
    "filled" ones): the share of mixed groups is the dilution GRPO trains under.
    """
    drawn = sum(len(group_rows(d.rollout.group_ids)) for d in draws)
    mixed = int(sum(mixed_groups(d.rewards, d.rollout.group_ids).sum() for d in draws))
    return {"dynamic/draws": float(len(draws)), "dynamic/prompts_drawn": float(drawn),
            "dynamic/mixed_groups_drawn": float(mixed), "dynamic/mixed_frac": mixed / drawn,
            "dynamic/groups_kept": float(min(mixed, num_groups)),
            "dynamic/filled_groups": float(max(0, num_groups - mixed))}
