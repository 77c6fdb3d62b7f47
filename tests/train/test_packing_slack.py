"""The packer's second plan (``train.packing._minimum_slack``): used only where it saves a micro-batch.

First-fit decreasing leaves gaps when lengths cluster (a Search-R1 trajectory is a prompt plus ≈ 500-token
search results); the minimum-slack plan fills each row by an exact subset sum. Both keep every trajectory
whole in its own mini-batch, within both bounds of a row, so the step computes the same numbers (packing
changes only which tokens share a row: ``test_packing.py``'s packed = padded).
"""

from __future__ import annotations

import numpy as np
import pytest

from llds_jax.train.packing import (
    PackingSizes,
    _first_fit_decreasing,
    computed_tokens,
    pack,
    place,
    plan_rows,
)

pytestmark = pytest.mark.unit


def _sizes(width=10, rows=1, scored=9, minis=1, mini=6):
    return PackingSizes(width=width, rows=rows, scored=scored, mini_batches=minis, mini_batch_size=mini)


def _check_rows(plan, lengths, targets, sizes):
    """Every trajectory in one row of its own mini-batch, none overlapping, both bounds held."""
    for mini in range(sizes.mini_batches):
        members = np.arange(mini * sizes.mini_batch_size, (mini + 1) * sizes.mini_batch_size)
        assert set(plan.row[members].tolist()) == set(range(int(plan.rows_per_mini[mini])))
        for r in range(int(plan.rows_per_mini[mini])):
            held = members[plan.row[members] == r]
            order = held[np.argsort(plan.offset[held])]
            ends = plan.offset[order] + lengths[order]
            assert (plan.offset[order][1:] >= ends[:-1]).all() and ends[-1] <= sizes.width
            assert targets[held].sum() <= sizes.scored
            assert (plan.score_start[order] == np.concatenate([[0], np.cumsum(targets[order])[:-1]])).all()


def test_minimum_slack_packs_what_first_fit_decreasing_leaves_a_row_short_of():
    lengths, targets = np.array([5, 4, 4, 3, 2, 2]), np.ones(6, np.int64)
    # first-fit decreasing: {5, 4}, {4, 3, 2}, {2}: 3 rows; the rows the sum 20 allows: {5, 3, 2}, {4, 4, 2}
    assert len(_first_fit_decreasing(np.arange(6), lengths, targets, _sizes())) == 3
    plan = plan_rows(lengths, targets, _sizes())
    assert plan.rows_per_mini.tolist() == [2] and plan.slots_per_mini.tolist() == [2]
    assert plan.row.tolist() == [0, 1, 1, 0, 0, 1]
    assert plan.offset.tolist() == [0, 0, 4, 5, 8, 8]
    _check_rows(plan, lengths, targets, _sizes())


def test_first_fits_rows_stay_where_the_other_plan_saves_no_micro_batch():
    lengths, targets = np.array([5, 4, 4, 3, 2, 2]), np.ones(6, np.int64)
    # 4 rows a micro-batch: 3 rows or 2 both compute one micro-batch, so first-fit's rows stay, row for row
    plan = plan_rows(lengths, targets, _sizes(rows=4))
    assert plan.rows_per_mini.tolist() == [3] and plan.slots_per_mini.tolist() == [1]
    assert plan.row.tolist() == [0, 0, 1, 1, 1, 2]


def test_a_subset_over_the_scored_bound_drops_its_most_action_heavy_members():
    lengths, targets = np.array([5, 4, 4, 3, 2, 2]), np.array([1, 1, 1, 4, 4, 1])
    sizes = _sizes(scored=6)
    plan = plan_rows(lengths, targets, sizes)
    _check_rows(plan, lengths, targets, sizes)


@pytest.mark.parametrize("seed", range(4))
def test_clustered_lengths_keep_both_bounds_and_never_cost_a_micro_batch_more(seed):
    rng = np.random.default_rng(seed)
    sizes = _sizes(width=4096, rows=4, scored=2000, minis=3, mini=64)
    n = sizes.mini_batches * sizes.mini_batch_size
    lengths = np.clip(rng.normal(700, 120, n).round().astype(np.int64), 150, 1900)
    lengths[rng.choice(n, 4, replace=False)] = 0  # empty rows take no room
    targets = np.minimum(lengths, rng.integers(0, 500, n))
    plan = plan_rows(lengths, targets, sizes)
    _check_rows(plan, lengths, targets, sizes)
    for mini in range(sizes.mini_batches):
        members = np.arange(mini * sizes.mini_batch_size, (mini + 1) * sizes.mini_batch_size)
        first_fit = len(_first_fit_decreasing(members, lengths, targets, sizes))
        assert plan.slots_per_mini[mini] <= -(-first_fit // sizes.rows)


def test_the_reference_step_on_8_shards_computes_fewer_tokens_than_first_fit_alone():
    """The plan's own draw of the Search-R1 3B lengths (configs/qwen3b.py, 16-row micro-batches, 8 shards):
    first-fit decreasing alone needs 49 rows in 4 of 10 mini-batches (4 micro-batches each, 544 rows
    computed); with the minimum-slack plan every mini-batch fits 48 (480 rows)."""
    import importlib.util
    from pathlib import Path

    from llds_jax.data.lengths import load_lengths
    from llds_jax.plan.step_time import step_lengths
    from llds_jax.train.batch import padded_length, scored_positions_per_row
    from llds_jax.train.packing import one_group, packing_sizes

    path = Path(__file__).resolve().parents[2] / "configs" / "qwen3b.py"
    spec = importlib.util.spec_from_file_location("qwen3b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    width = padded_length(config)
    sizes = packing_sizes(config, width, scored_positions_per_row(config, width), data_parallel=8)
    drawn = step_lengths(config, load_lengths(""), 2560, seed=int(config.seed))
    lengths = np.array([t.total for t in drawn])
    targets = np.array([sum(t.actions) for t in drawn])
    plan = plan_rows(lengths, targets, sizes)
    first_fit = [len(_first_fit_decreasing(np.arange(m * 256, (m + 1) * 256), lengths, targets, sizes))
                 for m in range(10)]
    assert sum(-(-r // sizes.rows) for r in first_fit) * sizes.rows == 544
    assert computed_tokens(plan, sizes) == 480 * width
    _check_rows(plan, lengths, targets, sizes)
    # π_old, π_ref and Δ read the same 470 rows as one group: 480 computed here too, but 512 rather than
    # 640 where a micro-batch is one row on each of 64 shards (v5e:8x8), a mini-batch's ≈ 47 rows rounding to 64.
    assert int(plan.rows_per_mini.sum()) == 470
    assert computed_tokens(one_group(plan, sizes), sizes.whole_batch()) == 480 * width
    sizes = packing_sizes(config, width, scored_positions_per_row(config, width), data_parallel=64)
    plan = plan_rows(lengths, targets, sizes)
    assert (computed_tokens(plan, sizes), computed_tokens(one_group(plan, sizes), sizes.whole_batch())) == (
        640 * width, 512 * width)


def test_pack_lays_the_minimum_slack_rows_out_token_for_token():
    lengths = np.array([5, 4, 4, 3, 2, 2])
    ids = np.zeros((6, 10), np.int32)
    attention = np.arange(10)[None, :] < lengths[:, None]
    ids[attention] = np.arange(1, attention.sum() + 1)
    action = np.zeros((6, 10), np.float32)
    action[:, 1] = 1  # one action target each (column 0 scores token 1)
    sizes = _sizes()
    packed = pack(ids, attention, action, sizes)
    where = place(plan_rows(lengths, np.ones(6), sizes), sizes)
    for j, length in enumerate(lengths):
        at, off = (where.slot[j], where.row[j]), int(where.offset[j])
        assert packed.input_ids[at][off:off + length].tolist() == ids[j, :length].tolist()
        assert (packed.segment_ids[at][off:off + length] == where.segment[j]).all()
    assert packed.mini_count.tolist() == [2]
