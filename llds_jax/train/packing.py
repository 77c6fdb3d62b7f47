"""Packed training rows: several trajectories per row, so the training passes compute tokens, not padding.

Why: every trajectory used to be padded to ``rollout.max_context`` (4,096 in the paper configs)
while Search-R1 trajectories average ≈ 690 tokens, so π_old, π_ref, the update and the Δ pass
ran the decoder on ≈ 6× the tokens that carry information. verl removes the padding with
variable-length flash attention and a per-GPU token budget; we keep static shapes instead:

* **Rows.** A packed row is ``width`` = the padded length wide (so any trajectory fits one row:
  nothing is ever cut). Trajectories are placed first-fit decreasing into the rows of *their own
  mini-batch* — the mini-batches are still the same trajectories in the same sequential order,
  the off-policy structure LLDS relies on; inside a mini-batch order is free (one update sums
  all its micro-batches). Each trajectory is a segment (ids 1, 2, … within its
  row, 0 = padding) whose positions restart at 0; attention never crosses segments
  (``AttentionMask.packed``). A row also holds at most ``scored`` action targets — the padded
  row's own bound (``batch.scored_positions_per_row``) — so the LM head of a packed row does no
  more work than a padded row's.
* **Micro-batches.** ``rows`` rows make a micro-batch (``train.micro_batch_tokens`` // width,
  rounded up to a multiple of the data-parallel shards; 0 = one row per shard, the finest split
  that keeps every device busy and the least rounding waste). A mini-batch takes as many
  micro-batches as its rows need. The buffer holds ``slots`` micro-batches — the worst case, one
  trajectory per row — and the jitted passes loop over the *used* ones with a dynamic trip
  count (``lax.fori_loop`` with traced bounds, i.e. a while loop): one program for any mix of
  lengths, and no compute on unused slots. Bucketed counts would compile one program per bucket
  and still compute the bucket's padding; a while loop costs neither (the update's gradient is
  taken inside the loop body, so nothing differentiates through the loop).
* **Two groupings.** Only the update needs the mini-batches: π_old, π_ref and the Δ pass take no
  gradient, so they read the same rows laid end to end as one group (``one_group``,
  ``PackingSizes.whole_batch``, ``TrainBatch.packed_passes``) and round to a micro-batch once a
  step instead of once a mini-batch. Same rows, so no second plan and no second set of numbers.
* **Layout.** Packed arrays are ``[slots, rows, width]`` with the rows axis sharded over the data
  axes, so indexing a micro-batch (axis 0) is local to every device. Per trajectory, ``slot``,
  ``row`` and ``score_start`` say where its action targets sit in the packed LM-head output
  (``[slots, rows, scored]``): entry ``score_start + k`` of its row is its k-th action target,
  exactly the k-th column of its own ``scored_positions`` view — the bridge that lets the RL
  maths keep reading per-trajectory ``[N, K]`` arrays (every per-row reduction stays a
  per-trajectory one; see ``train.packed_step``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.models.logprobs import scored_positions
from llds_jax.parallel.rules import ShardingRules, current_rules


@dataclasses.dataclass(frozen=True)
class PackingSizes:
    """Static shapes of a packed batch (one compile per run)."""

    width: int  # tokens per packed row: the padded length
    rows: int  # rows per micro-batch (a multiple of the data-parallel shards)
    scored: int  # action targets per row the LM head computes
    mini_batches: int
    mini_batch_size: int

    @property
    def slots_per_mini_batch(self) -> int:
        """Micro-batches a mini-batch can need: one trajectory per row at worst."""
        return -(-self.mini_batch_size // self.rows)

    @property
    def slots(self) -> int:
        return self.mini_batches * self.slots_per_mini_batch

    @property
    def micro_batch_tokens(self) -> int:
        return self.rows * self.width

    def whole_batch(self) -> PackingSizes:
        """These shapes with the step as one group: the no-grad passes' (π_old, π_ref, Δ; ``one_group``)."""
        return dataclasses.replace(self, mini_batches=1, mini_batch_size=self.mini_batches * self.mini_batch_size)


def packing_sizes(config, width: int, scored: int, data_parallel: int) -> PackingSizes:
    """The packed shapes of ``config`` on a mesh with ``data_parallel`` batch shards.

    ``train.micro_batch_tokens`` (0 = one ``width`` row per shard) sets the rows per micro-batch,
    rounded up to a multiple of the shards and never above what a mini-batch can fill.
    """
    t = config.train
    shards = max(1, int(data_parallel))
    budget = int(t.micro_batch_tokens or 0)
    rows = max(1, budget // width) if budget else shards
    rows = -(-rows // shards) * shards
    rows = min(rows, -(-int(t.mini_batch_size) // shards) * shards)
    trajectories = int(t.prompts_per_step) * int(config.rollout.n_samples)
    return PackingSizes(width=width, rows=rows, scored=max(1, min(scored, width - 1)),
                        mini_batches=trajectories // int(t.mini_batch_size), mini_batch_size=int(t.mini_batch_size))


class PackedRows(NamedTuple):
    """The packed view of a batch's token arrays (host numpy or device arrays)."""

    input_ids: Any  # int32 [S, P, W]
    segment_ids: Any  # int32 [S, P, W]: 1, 2, … per trajectory of a row; 0 padding
    score_positions: Any  # int32 [S, P, Kp]: target columns the LM head computes, row order
    slot: Any  # int32 [N]: the micro-batch slot holding each trajectory
    row: Any  # int32 [N]: its row within that micro-batch
    score_start: Any  # int32 [N]: index of its first action target among its row's score_positions
    mini_first: Any  # int32 [num_mini]: first slot of each mini-batch
    mini_count: Any  # int32 [num_mini]: slots each mini-batch uses (the loop's trip count)

    def shardings(self, mesh, rules: ShardingRules | None = None) -> PackedRows:
        """Rows of a micro-batch over the data axes; trajectories like the batch's rows; counts replicated."""
        rules = rules or current_rules()

        def spec(x, logical):
            return NamedSharding(mesh, rules.spec(logical, x.shape, mesh))

        packed = lambda x: spec(x, (None, "batch", None))
        per_traj = lambda x: spec(x, ("batch",))
        replicated = NamedSharding(mesh, PartitionSpec())
        return PackedRows(packed(self.input_ids), packed(self.segment_ids), packed(self.score_positions),
                          per_traj(self.slot), per_traj(self.row), per_traj(self.score_start), replicated, replicated)

    @classmethod
    def abstract(cls, sizes: PackingSizes, trajectories: int) -> PackedRows:
        s, p = sizes.slots, sizes.rows
        leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        return cls(leaf(s, p, sizes.width), leaf(s, p, sizes.width), leaf(s, p, sizes.scored),
                   leaf(trajectories), leaf(trajectories), leaf(trajectories),
                   leaf(sizes.mini_batches), leaf(sizes.mini_batches))


class RowPlan(NamedTuple):
    """Where first-fit puts each trajectory (host numbers, no token arrays)."""

    row: np.ndarray  # [N] row index within the trajectory's mini-batch
    offset: np.ndarray  # [N] first column in that row
    score_start: np.ndarray  # [N] action targets of the row before this trajectory's
    rows_per_mini: np.ndarray  # [num_mini] rows each mini-batch fills
    slots_per_mini: np.ndarray  # [num_mini] micro-batches each mini-batch needs


def plan_rows(lengths, action_targets, sizes: PackingSizes) -> RowPlan:
    """Each mini-batch's trajectories into rows of ``width`` tokens and ``scored`` action targets; none is
    split or cut. Order inside a mini-batch is free — its micro-batches' gradients are summed before its one
    update — so the rows are whatever packs tightest, two ways:

    * **first-fit decreasing** (``_first_fit_decreasing``): longest first (ties in batch order), each to the
      first row with room for both. It sorts, so it spreads the rows better over micro-batches than plain
      first-fit (the paper config on the reference lengths, 8 shards: 63 → 61 micro-batches, 1.17 → 1.13
      computed ÷ real tokens; ``bench_train_step.py --packing-report``);
    * **minimum row slack** (``_minimum_slack``, Gupta & Ho's MBS' heuristic for bin packing): each new row
      takes the longest trajectory left, then the subset of the rest that leaves the row the fewest empty
      tokens (an exact subset sum over token counts); Search-R1 trajectories are a prompt plus ≈ 500-token
      search results, lengths that first-fit leaves gaps between.

    A mini-batch computes whole micro-batches (``rows`` rows each), so the second plan replaces the first
    only where it needs fewer micro-batches (elsewhere first-fit's rows stay, row for row)."""
    lengths = np.asarray(lengths, np.int64)
    action_targets = np.asarray(action_targets, np.int64)
    n = len(lengths)
    if n != sizes.mini_batches * sizes.mini_batch_size:
        raise ValueError(f"{n} trajectories, the packed shapes expect {sizes.mini_batches} × {sizes.mini_batch_size}")
    if n and (lengths.max() > sizes.width or action_targets.max() > sizes.scored):
        j = int(np.argmax((lengths > sizes.width) | (action_targets > sizes.scored)))
        raise ValueError(f"trajectory {j} ({lengths[j]} tokens, {action_targets[j]} action targets) does not fit a "
                         f"packed row of {sizes.width} tokens and {sizes.scored} scored positions")
    row, offset, start = (np.zeros(n, np.int64) for _ in range(3))
    rows_per_mini = np.zeros(sizes.mini_batches, np.int64)
    for mini in range(sizes.mini_batches):
        members = np.arange(mini * sizes.mini_batch_size, (mini + 1) * sizes.mini_batch_size)
        rows = _first_fit_decreasing(members, lengths, action_targets, sizes)
        if -(-len(rows) // sizes.rows) > -(-int(lengths[members].sum()) // (sizes.width * sizes.rows)):
            tighter = _minimum_slack(members, lengths, action_targets, sizes)
            if -(-len(tighter) // sizes.rows) < -(-len(rows) // sizes.rows):
                rows = tighter
        for r, held in enumerate(rows):
            at = scored = 0
            for j in held:
                row[j], offset[j], start[j] = r, at, scored
                at += int(lengths[j])
                scored += int(action_targets[j])
        rows_per_mini[mini] = len(rows)
    slots = -(-rows_per_mini // sizes.rows)
    return RowPlan(row, offset, start, rows_per_mini, slots)


def _first_fit_decreasing(members, lengths, action_targets, sizes: PackingSizes) -> list[list[int]]:
    """Rows (each its trajectories, in column order): longest first, each to the first row with room."""
    rows: list[list[int]] = []
    used_tokens: list[int] = []
    used_scored: list[int] = []
    for j in members[np.argsort(-lengths[members], kind="stable")]:
        fits = [r for r, (tokens, scored) in enumerate(zip(used_tokens, used_scored, strict=True))
                if tokens + lengths[j] <= sizes.width and scored + action_targets[j] <= sizes.scored]
        r = fits[0] if fits else len(rows)
        if not fits:
            rows.append([])
            used_tokens.append(0)
            used_scored.append(0)
        rows[r].append(int(j))
        used_tokens[r] += int(lengths[j])
        used_scored[r] += int(action_targets[j])
    return rows


def _minimum_slack(members, lengths, action_targets, sizes: PackingSizes) -> list[list[int]]:
    """Rows by minimum slack: each opens with the longest trajectory left and takes the subset of the others
    that fills it closest to ``width`` tokens (subset sum as a bitset over token counts, walked back to the
    members); a subset over the ``scored`` bound drops its most action-heavy members until it fits."""
    left = [int(j) for j in members[np.argsort(-lengths[members], kind="stable")]]
    rows: list[list[int]] = []
    while left:
        first, rest = left[0], left[1:]
        room = sizes.width - int(lengths[first])
        mask = (1 << (room + 1)) - 1
        reachable, before = 1, []
        for j in rest:
            before.append(reachable)
            reachable = (reachable | (reachable << int(lengths[j]))) & mask
        total, chosen = reachable.bit_length() - 1, []
        for k in range(len(rest) - 1, -1, -1):  # take member k where the sum cannot be made without it
            if not (before[k] >> total) & 1:
                chosen.append(rest[k])
                total -= int(lengths[rest[k]])
        chosen.reverse()  # longest first, as they were listed
        chosen += [j for j in rest if lengths[j] == 0]  # empty trajectories take no room (the sum never needs them)
        while int(action_targets[[first, *chosen]].sum()) > sizes.scored:
            chosen.remove(max(chosen, key=lambda j: (int(action_targets[j]), j)))
        rows.append([first, *chosen])
        taken = set(rows[-1])
        left = [j for j in left if j not in taken]
    return rows


def trajectory_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Real tokens per right-padded row; fails on a row whose real tokens are not a prefix."""
    mask = np.asarray(attention_mask, bool)
    lengths = mask.sum(axis=1)
    prefix = np.arange(mask.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(mask, prefix):
        bad = int(np.argmax((mask != prefix).any(axis=1)))
        raise ValueError(f"row {bad} of the batch is not right-padded (real tokens after a pad): cannot pack it")
    return lengths


class Placement(NamedTuple):
    """Where each trajectory of a batch sits in the packed buffers (host numbers, from ``plan_rows``)."""

    slot: np.ndarray  # [N] micro-batch slot
    row: np.ndarray  # [N] row within that micro-batch
    offset: np.ndarray  # [N] first column in that row
    segment: np.ndarray  # [N] segment id within the row (1, 2, …)
    score_start: np.ndarray  # [N] index of its first action target among its row's scored positions
    mini_first: np.ndarray  # [num_mini] first slot of each mini-batch
    mini_count: np.ndarray  # [num_mini] slots each mini-batch uses


def one_group(plan: RowPlan, sizes: PackingSizes) -> RowPlan:
    """``plan``'s rows, every mini-batch's, end to end as one group (``sizes.whole_batch()``'s plan).

    Why: each mini-batch computes whole micro-batches, so the update rounds every mini-batch's rows up to
    a micro-batch — the paper config's mini-batch of 256 trajectories fills ≈ 47 rows of 4,096, 3
    micro-batches of 16 on 8 H100s but one of 64 rows on v5e:8x8, where a step's 10 mini-batches compute
    640 rows for ≈ 470 used. The no-grad passes have no mini-batch to respect: the same rows regrouped
    round once a step (v5e:8x8: 512 rows; 8 H100s: 480 either way). Only the grouping changes — each
    trajectory keeps its row-mates, offset and scored slots, so a pass computes the rows the update does.
    """
    first_row = np.concatenate([[0], np.cumsum(plan.rows_per_mini)[:-1]]).astype(np.int64)
    mini = np.arange(len(plan.row)) // sizes.mini_batch_size
    rows = int(plan.rows_per_mini.sum())
    return RowPlan(plan.row + first_row[mini], plan.offset, plan.score_start, np.array([rows], np.int64),
                   np.array([-(-rows // sizes.rows)], np.int64))


def place(plan: RowPlan, sizes: PackingSizes) -> Placement:
    """The slots, rows, offsets and segment ids of ``plan``: a mini-batch's rows fill its micro-batches in order."""
    first = np.concatenate([[0], np.cumsum(plan.slots_per_mini)[:-1]]).astype(np.int64)
    mini = np.arange(len(plan.row)) // sizes.mini_batch_size
    slot = first[mini] + plan.row // sizes.rows
    row = plan.row % sizes.rows
    segment = np.zeros(len(plan.row), np.int64)
    seen: dict[tuple[int, int], int] = {}
    for j in range(len(plan.row)):  # batch order within a row, as ``pack`` numbers them
        key = (int(slot[j]), int(row[j]))
        seen[key] = segment[j] = seen.get(key, 0) + 1
    as32 = lambda x: np.asarray(x, np.int32)
    return Placement(as32(slot), as32(row), as32(plan.offset), as32(segment), as32(plan.score_start),
                     as32(first), as32(plan.slots_per_mini))


def action_targets(action_mask: np.ndarray) -> np.ndarray:
    """Target-aligned action targets per row: column t scores token t + 1."""
    return np.asarray(action_mask)[:, 1:] > 0


def pack(input_ids: np.ndarray, attention_mask: np.ndarray, action_mask: np.ndarray,
         sizes: PackingSizes, plan: RowPlan | None = None) -> PackedRows:
    """Host packing of a right-padded, token-aligned batch ([N, T] numpy) into ``PackedRows``.

    ``plan``: rows already planned for these trajectories and ``sizes`` (e.g. ``one_group``'s); by
    default ``plan_rows``'."""
    input_ids = np.asarray(input_ids)
    lengths = trajectory_lengths(attention_mask)
    targets = action_targets(action_mask)
    where = place(plan_rows(lengths, targets.sum(axis=1), sizes) if plan is None else plan, sizes)
    s, p = sizes.slots, sizes.rows
    ids = np.zeros((s, p, sizes.width), np.int32)
    segments = np.zeros((s, p, sizes.width), np.int32)
    scores = np.zeros((s, p, sizes.scored), np.int32)
    for j, length in enumerate(lengths):
        at, off, start = (where.slot[j], where.row[j]), int(where.offset[j]), int(where.score_start[j])
        ids[at][off:off + length] = input_ids[j, :length]
        segments[at][off:off + length] = where.segment[j]
        columns = np.flatnonzero(targets[j])
        scores[at][start:start + len(columns)] = off + columns
    return PackedRows(ids, segments, scores, where.slot, where.row, where.score_start, where.mini_first,
                      where.mini_count)


def pack_both(input_ids: np.ndarray, attention_mask: np.ndarray, action_mask: np.ndarray,
              sizes: PackingSizes) -> tuple[PackedRows, PackedRows]:
    """(the update's rows, the no-grad passes' ``one_group`` of them) of a batch, from one ``plan_rows``."""
    plan = plan_rows(trajectory_lengths(attention_mask), action_targets(action_mask).sum(axis=1), sizes)
    return (pack(input_ids, attention_mask, action_mask, sizes, plan),
            pack(input_ids, attention_mask, action_mask, sizes.whole_batch(), one_group(plan, sizes)))


def computed_tokens(plan: RowPlan, sizes: PackingSizes) -> int:
    """Tokens the decoder stack computes for one pass over a packed batch: every row of every used micro-batch."""
    return int(plan.slots_per_mini.sum()) * sizes.rows * sizes.width


def data_parallel_size(mesh, rules: ShardingRules | None = None, rows: int | None = None) -> int:
    """Shards of the ``batch`` logical axis on ``mesh`` (the devices a micro-batch's rows split over)."""
    return (rules or current_rules()).shards("batch", mesh, rows)


def pack_on_device(input_ids, action_mask, lengths, where: Placement, sizes: PackingSizes) -> PackedRows:
    """``pack`` as one traced scatter, for a batch whose rows live on several hosts (jnp; jit it).

    Why: a host holds only its own trajectories' tokens while a packed micro-batch's rows span every
    host's devices, so no host can fill its rows alone. Every host computes the same ``where``
    (``place`` of ``plan_rows`` on the all-gathered lengths: the one-host plan, hence the one-host
    numbers) and the program writes each trajectory's real tokens, segment id and action-target
    columns to their packed places; XLA moves the tokens between devices. The token arrays are int32
    and a few tens of MB at the paper shapes, once per step. Same arrays as ``pack`` (tested).
    """
    n, t = input_ids.shape
    s, p, w, k = sizes.slots, sizes.rows, sizes.width, sizes.scored
    flat_row = where.slot * p + where.row  # [N] row index over all slots
    columns = jnp.arange(t, dtype=jnp.int32)[None, :]
    dest = jnp.where(columns < lengths[:, None], (flat_row * w + where.offset)[:, None] + columns, s * p * w)

    def scatter(values, size):
        return jnp.zeros(size, jnp.int32).at[dest.reshape(-1)].set(values.reshape(-1), mode="drop")

    ids = scatter(input_ids.astype(jnp.int32), s * p * w).reshape(s, p, w)
    segments = scatter(jnp.broadcast_to(where.segment[:, None], (n, t)), s * p * w).reshape(s, p, w)
    target_columns, valid = scored_positions(action_mask[:, 1:], k)  # target-aligned: column c scores token c + 1
    score_dest = jnp.where(valid, (flat_row * k + where.score_start)[:, None] + jnp.arange(k)[None, :], s * p * k)
    scores = jnp.zeros(s * p * k, jnp.int32).at[score_dest.reshape(-1)].set(
        (where.offset[:, None] + target_columns).reshape(-1), mode="drop").reshape(s, p, k)
    return PackedRows(ids, segments, scores, where.slot, where.row, where.score_start, where.mini_first,
                      where.mini_count)
