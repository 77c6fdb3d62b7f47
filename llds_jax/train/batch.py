"""One batch record from rollout to update to diagnostics: :class:`TrainBatch`.

Alignment — the one convention. Every ``[N, T]`` array of a ``TrainBatch`` (ids, masks, and
the π_old / π_ref log-probs) is *token-aligned*, exactly as ``RolloutBatch`` and the
diagnostics are: position ``t`` holds the value for the token *at* ``t``; a log-prob at ``t``
is ``log π(x_t | x_<t)`` and position 0, which nothing predicts, holds 0. The objective
(``llds_jax.rl.objective``) works on next-token *targets* ``[N, T-1]`` (entry ``t`` scores
token ``t+1``), which is what a forward pass produces (``hidden[:, :-1]`` predicts
``ids[:, 1:]``). The two conversions live here and nowhere else: :func:`next_token_targets`
(token → target alignment, applied to every token array the loss reads) and
:func:`token_aligned` (target → token alignment, applied once to the no-grad forward's
output, so π_old, π_ref and the Δ pass come back token-aligned).

Lifetime of one step's batch:

1. host — :meth:`TrainBatch.from_rollout` (or :meth:`TrainBatch.from_arrays`): this host's
   rows, cast to the trainer's dtypes and right-padded to the fixed length (one compile per
   run). Rewards, group ids and the row weights (1 real row, 0 padding: also the validity of
   a row for the advantage statistics) are fields.
2. device — ``Learner.upload``, once per step: the global, row-sharded batch.
3. π_old and π_ref fill ``old_logp`` / ``ref_logp``; the update computes the advantages from
   ``rewards`` / ``group_ids`` / ``row_weight`` inside its jit (over the global batch, so
   several hosts need no gather) and returns them; the Δ-log-prob pass reads the same arrays.
4. :meth:`TrainBatch.abstract` — the same record as ``ShapeDtypeStruct`` s with the batch
   shardings: the learner's jit shardings and the memory planner's compile arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.parallel.rules import ShardingRules, current_rules
from llds_jax.train.packing import PackedRows, PackingSizes

# Right-padding value of each field (padding columns: no token, no mask, no action).
_TOKEN_FIELDS = {"input_ids": (np.int32, 0), "attention_mask": (bool, False), "action_mask": (np.float32, 0.0),
                 "answer_mask": (np.float32, 0.0), "action_index": (np.int32, -1)}
_ROW_FIELDS = {"num_searches": np.float32, "row_weight": np.float32, "rewards": np.float32, "group_ids": np.int32}


class TrainBatch(NamedTuple):
    """One rollout batch as the update sees it; every array has N = trajectories rows, all token-aligned.

    ``old_logp`` / ``ref_logp`` are filled on device before the update (``ref_logp`` stays
    None when ``rl.kl_coef == 0``).
    """

    input_ids: Any  # int32 [N, T], right-padded
    attention_mask: Any  # bool [N, T]: real tokens (prompt, actions, feedback)
    action_mask: Any  # float32 [N, T]: 1 on model-written tokens that are trained
    answer_mask: Any  # float32 [N, T]: 1 on the last <answer>…</answer> span
    action_index: Any  # int32 [N, T]: which action a token belongs to, -1 elsewhere
    num_searches: Any  # float32 [N]: the count adaptive LLDS-MA reads (rl.ma_search_count)
    row_weight: Any  # float32 [N]: 1 real trajectory, 0 padding row (excluded from advantage statistics)
    rewards: Any  # float32 [N]: the trajectory's scalar reward
    group_ids: Any  # int32 [N]: GRPO group (prompt) id, global across hosts
    old_logp: Any = None  # float32 [N, T]: log π_old(x_t | x_<t), 0 at t = 0
    ref_logp: Any = None  # float32 [N, T]: log π_ref(x_t | x_<t), 0 at t = 0
    # The same trajectories packed several to a row (``train.packing``), grouped by mini-batch: what the
    # update reads; the [N, T] arrays above stay the per-trajectory view the objective and diagnostics read.
    packed: PackedRows | None = None
    # float32 [N, T]: the sampler's own log π(x_t | x_<t) on action tokens, carried only when
    # rl.rollout_correction needs it (None otherwise: the default batch is unchanged).
    sampler_logp: Any = None
    # The same rows as one group (``packing.one_group``): what the no-grad passes (π_old, π_ref, Δ)
    # read, rounded to a micro-batch once a step rather than once a mini-batch.
    packed_passes: PackedRows | None = None

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], *, length: int) -> TrainBatch:
        """Host record from rollout-shaped numpy arrays (the keys of the fields; ``row_weight`` optional).

        Token arrays are right-padded to ``length`` columns; a wider array, a missing key or a
        row count that differs between fields fails naming the field.
        """
        missing = [k for k in (*_TOKEN_FIELDS, *_ROW_FIELDS) if k != "row_weight" and k not in arrays]
        if missing:
            raise ValueError(f"rollout arrays lack {missing}; a TrainBatch needs {sorted((*_TOKEN_FIELDS, *_ROW_FIELDS))}")
        rows = len(arrays["input_ids"])
        out = {}
        for name, (dtype, pad) in _TOKEN_FIELDS.items():
            out[name] = _pad_columns(name, np.asarray(arrays[name]).astype(dtype), length, pad)
        for name, dtype in _ROW_FIELDS.items():
            value = arrays.get(name, np.ones(rows)) if name == "row_weight" else arrays[name]
            if name == "group_ids" and len(value) and np.max(np.abs(np.asarray(value, np.int64))) > np.iinfo(np.int32).max:
                raise ValueError(f"group_ids up to {np.max(np.abs(value))} do not fit int32; use dense prompt ids")
            out[name] = np.asarray(value).astype(dtype)
        if arrays.get("sampler_logp") is not None:
            out["sampler_logp"] = _pad_columns("sampler_logp", np.asarray(arrays["sampler_logp"], np.float32),
                                               length, 0.0)
        for name, value in out.items():
            if len(value) != rows:
                raise ValueError(f"rollout field {name!r} has {len(value)} rows, input_ids has {rows}")
        return cls(**out)

    @classmethod
    def from_rollout(cls, rollout, rewards, *, length: int, ma_search_count: str = "batch_written",
                     with_sampler_logp: bool = False) -> TrainBatch:
        """Host record of a ``RolloutBatch`` (this host's rows) and its rewards.

        ``num_searches`` is the count adaptive LLDS-MA reads: ``batch_written`` (the official
        ``valid_search_mean``: every action that parsed as a search) or the searches executed.
        ``with_sampler_logp`` carries ``rollout.sampler_logprobs`` (``rl.rollout_correction``).
        """
        searches = rollout.search_actions_written if ma_search_count == "batch_written" else rollout.searches
        return cls.from_arrays(dict(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                                    action_mask=rollout.action_mask, answer_mask=rollout.answer_mask,
                                    action_index=rollout.action_index, num_searches=searches, rewards=rewards,
                                    group_ids=rollout.group_ids,
                                    sampler_logp=rollout.sampler_logprobs if with_sampler_logp else None),
                               length=length)

    @classmethod
    def abstract(cls, n: int, length: int, *, with_ref: bool, mesh=None, rules: ShardingRules | None = None,
                 packing: PackingSizes | None = None, with_sampler: bool = False) -> TrainBatch:
        """``ShapeDtypeStruct`` s of a device batch with π_old (and π_ref) filled; shardings when ``mesh`` is given.

        ``packing``: with the packed rows of those shapes (``train.packing``); ``with_sampler``: with the
        sampler's log-probs (``rl.rollout_correction``)."""
        def leaf(shape, dtype):
            sharding = None if mesh is None else batch_sharding(mesh, rules, len(shape), shape)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        def rows_of(sizes: PackingSizes | None):
            if sizes is None:
                return None
            packed = PackedRows.abstract(sizes, n)
            if mesh is None:
                return packed
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                packed, packed.shardings(mesh, rules))

        tok, row = (n, length), (n,)
        return cls(leaf(tok, jnp.int32), leaf(tok, jnp.bool_), leaf(tok, jnp.float32), leaf(tok, jnp.float32),
                   leaf(tok, jnp.int32), leaf(row, jnp.float32), leaf(row, jnp.float32), leaf(row, jnp.float32),
                   leaf(row, jnp.int32), leaf(tok, jnp.float32), leaf(tok, jnp.float32) if with_ref else None,
                   packed=rows_of(packing), sampler_logp=leaf(tok, jnp.float32) if with_sampler else None,
                   packed_passes=rows_of(packing and packing.whole_batch()))

    def shardings(self, mesh, rules: ShardingRules) -> TrainBatch:
        """The row sharding of every field of this (abstract or concrete) batch (packed rows: ``PackedRows.shardings``)."""
        rows = jax.tree.map(lambda x: batch_sharding(mesh, rules, x.ndim, x.shape), self.unpacked())
        packed = lambda p: None if p is None else p.shardings(mesh, rules)
        return rows._replace(packed=packed(self.packed), packed_passes=packed(self.packed_passes))

    def unpacked(self) -> TrainBatch:
        """The per-trajectory fields only (every leaf [N, ...]): the packed rows dropped."""
        return self._replace(packed=None, packed_passes=None)

    @property
    def logprob_inputs(self) -> tuple:
        """A log-prob pass's arguments after the params: (input_ids, attention_mask, action_mask), or
        (the passes' packed rows, action_mask) for a packed batch (the action mask picks the positions it scores)."""
        if self.packed_passes is not None:
            return self.packed_passes, self.action_mask
        return self.input_ids, self.attention_mask, self.action_mask

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def padded_length(config) -> int:
    """The trainer's fixed row length: ``rollout.max_context`` rounded up to ``rollout.pad_to_multiple``."""
    multiple = max(1, int(config.rollout.pad_to_multiple))
    return -(-int(config.rollout.max_context) // multiple) * multiple


def scored_positions_per_row(config, length: int, section: str = "train") -> int:
    """How many next-token positions per row a loss's log-prob pass computes (static: one compile).

    ``<section>.max_action_tokens_per_row`` if set; else, for ``train``, the rollout's bound on a
    trajectory's action tokens, (``max_turns`` + 1) actions × ``max_action_tokens``, and for
    ``sft`` every position (hand-built ``SFTExample`` masks are not held to the rollout's caps). Never
    more than the ``length - 1`` targets a row has, which means every position.
    """
    explicit = int(config[section].max_action_tokens_per_row or 0)
    if explicit:
        bound = explicit
    elif section == "train":
        bound = (int(config.rollout.max_turns) + 1) * int(config.rollout.max_action_tokens)
    else:
        bound = length - 1
    return max(1, min(bound, length - 1))


def check_action_tokens(action_mask: np.ndarray, bound: int, knob: str) -> None:
    """Fail, naming the row, when a token-aligned ``action_mask`` row has more than ``bound`` action targets.

    The log-prob pass keeps ``bound`` positions per row (``models.logprobs.scored_positions``)
    and would silently drop the rest.
    """
    counts = (np.asarray(action_mask)[:, 1:] > 0).sum(axis=1)
    if counts.size and counts.max() > bound:
        row = int(counts.argmax())
        raise ValueError(f"row {row} has {int(counts[row])} action tokens, more than the {bound} positions the loss "
                         f"scores per row: raise {knob}")


def batch_sharding(mesh, rules: ShardingRules | None, ndim: int, shape=None):
    """Rows over the data-parallel axes of ``rules`` (``"batch"``), everything else replicated."""
    logical = ("batch",) + (None,) * (ndim - 1)
    return (rules or current_rules()).sharding(logical, mesh, shape)


def next_token_targets(token_array):
    """``[N, T]`` token-aligned → ``[N, T-1]`` target-aligned (entry t is about token t+1): the objective's view."""
    return token_array[:, 1:]


def token_aligned(target_array):
    """``[N, T-1]`` target-aligned → ``[N, T]`` token-aligned, 0 at position 0 (no prediction there)."""
    return jnp.pad(target_array, ((0, 0), (1, 0)))


def _pad_columns(name: str, array: np.ndarray, length: int, value) -> np.ndarray:
    if array.ndim != 2:
        raise ValueError(f"rollout field {name!r} has shape {array.shape}; expected [rows, tokens]")
    if array.shape[1] > length:
        raise ValueError(f"rollout field {name!r} is {array.shape[1]} tokens long, more than the trainer's fixed "
                         f"length {length} (rollout.max_context rounded to rollout.pad_to_multiple)")
    return np.pad(array, ((0, 0), (0, length - array.shape[1])), constant_values=value)
