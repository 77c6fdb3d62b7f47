"""``run_rollouts``: the turn-synchronous, batched Search-R1 loop.

Every turn, all active trajectories decode one action together; all search queries of
the turn go to the retriever in one batched call; each row's feedback ids are appended to
its live KV cache (no re-prefill); rows that answered, ran out of turns or hit the
context cap drop out (frozen in the decode loop, no feedback). Turns follow the
reference's ``run_llm_loop``:

* turns ``0 .. max_turns-1``: a search runs and its results come back as feedback; an
  invalid action gets the invalid-action message; an answer ends the trajectory;
* one last turn with search disabled: whatever the action is, the trajectory ends there
  (a search written in it is counted as a valid action and in ``search_actions_written``,
  but not executed).

An action stops where its parse is decided (``action_stop.py``) and is parsed as the
reference parses it; when the reference's cut keeps fewer tokens than were sampled (an
``</answer>`` that did not decide the action, with no ``</search>`` after it), the record
and the policy's cache keep only the sampled ids up to the cut.

Caps: an action has at most ``max_action_tokens`` tokens and never more than the context
has room for; feedback is cut to ``max_obs_tokens`` and to the room left; the prompt
keeps its last ``max_prompt_tokens``. A trajectory with no room left ends, ``truncated``.

A model's rollout runs on the one engine (``engine.py``: slots over a paged KV cache), under
the policy ``rollout.engine`` names: ``"waves"`` runs the loop above turn-synchronously, in
*waves* of at most ``max_concurrent_rows`` rows (derived from the device's memory by default,
``kv_plan.py``); ``"continuous"`` lets each slot run its own turns. Trajectory ``i`` samples
with ``fold_in(key, i)`` whatever slot or wave it lands in, so the batch — ids, masks, sampler
log-probs, answers, searches — does not depend on the policy or the wave size.

A scripted :class:`Policy` (no model, no cache: protocol tests, the retrieval outage test)
runs the loop above on the host as written, in the same waves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np
from flax import nnx

from llds_jax.rollout import protocol
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.config import terminator_ids
from llds_jax.rollout.engine import ModelPolicy, count_decode_work, run_engine
from llds_jax.rollout.kv_plan import engine_sizing, wave_plan
from llds_jax.rollout.trajectory import RolloutBatch, Trajectory, collate
from llds_jax.rollout.turns import apply_action, cut_feedback
from llds_jax.sampling import placement
from llds_jax.sampling.decode_loop import SamplingParams
from llds_jax.sampling.slots import SampledAction
from llds_jax.sampling.token_bytes import vocab_bytes


class Policy(Protocol):
    """What the host turn loop needs from a scripted policy (``scripted_policy.ScriptedPolicy``)."""

    def start(self, prompts: Sequence[Sequence[int]], *, trajectory_ids: Sequence[int] | None = None,
              batch: int | None = None) -> None: ...

    def act(self, active: np.ndarray, budgets: np.ndarray) -> list[SampledAction | None]: ...

    def observe(self, chunks: Sequence[Sequence[int]]) -> None: ...

    def cut_last_actions(self, kept_tokens: Sequence[int | None]) -> None: ...


def _is_model(policy) -> bool:
    return isinstance(policy, nnx.Module) or (isinstance(policy, tuple) and len(policy) == 2)


def make_policy(model, tokenizer, config, *, key: jax.Array) -> ModelPolicy:
    """What the engine samples ``model`` (``Decoder`` or ``(graphdef, params)``) with, under ``config``'s knobs."""
    graphdef, params = nnx.split(model) if isinstance(model, nnx.Module) else model
    vocab_size = nnx.merge(graphdef, params).config.vocab_size
    sampling = SamplingParams.create(
        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
        stop_token_ids=terminator_ids(tokenizer, config.stop_token_ids),
        stop_table=action_stop_table(vocab_bytes(tokenizer, vocab_size)).transitions)
    if int(config.prefill_chunk) < 0:
        raise ValueError(f"rollout.prefill_chunk={config.prefill_chunk}: expected 0 (whole prompt) or a token count")
    return ModelPolicy(graphdef, params, sampling, key, pad_id=pad_token_id(tokenizer),
                       prefill_chunk=int(config.prefill_chunk))


def _vocab_size(policy) -> int | None:
    """The model's logit count when the policy has one: sampled ids may reach past the tokenizer
    (padded vocabulary rows), and every id, sampled or tokenised, needs an entry in the byte table."""
    config = getattr(policy, "config", None)
    return getattr(config, "vocab_size", None)


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


def run_rollouts(policy, tokenizer, questions: Sequence[str], retriever, config, *, key: jax.Array | None = None,
                 group_ids: Sequence[int] | None = None) -> RolloutBatch:
    """Roll out ``config.n_samples`` trajectories per question; rows are question-major.

    ``policy``: a ``Decoder``, a ``(graphdef, params)`` pair (sampled with ``config``'s
    temperature / top-p / top-k and ``key``), or any :class:`Policy`. ``retriever``: any
    object with ``search(queries, topk) -> list[list[Hit]]``. ``group_ids[i]`` labels
    question ``i``'s group (default ``i``); row ``i * n_samples + j`` is its ``j``-th sample.
    The batch is the same under either ``rollout.engine`` policy and for any wave size.
    """
    if _is_model(policy):
        if key is None:
            raise ValueError("sampling from a model needs key=")
        policy = make_policy(policy, tokenizer, config, key=key)
    group_ids = list(range(len(questions))) if group_ids is None else list(group_ids)
    if len(group_ids) != len(questions):
        raise ValueError(f"{len(group_ids)} group ids for {len(questions)} questions")
    vocab = vocab_bytes(tokenizer, max(len(tokenizer), _vocab_size(policy) or 0))
    timings = dict(prefill_s=0.0, decode_s=0.0, append_s=0.0, retrieval_s=0.0, host_s=0.0, waves=0)
    started = time.perf_counter()

    trajectories = []
    for question, group in zip(questions, group_ids):
        prompt_ids = protocol.encode_prompt(tokenizer, question, config.max_prompt_tokens)
        trajectories.extend(Trajectory(prompt_ids=list(prompt_ids), group_id=group) for _ in range(config.n_samples))
    rows_per_wave, batch = wave_plan(config, len(trajectories), getattr(policy, "config", None))
    if isinstance(policy, ModelPolicy) and config.engine == "continuous":
        # slots and KV pool from the expected length (rollout/kv_plan.py), on every sampler device
        devices = len(placement.sampler_devices(int(config.sampler_devices)))
        slots, kv_blocks = engine_sizing(config, len(trajectories), policy.config, devices)
        timings.update(run_engine(policy, trajectories, vocab, tokenizer, retriever, config, timings, slots=slots,
                                  kv_blocks=kv_blocks))
    elif isinstance(policy, ModelPolicy):  # waves: each slot reserves a whole max_context of blocks
        timings.update(run_engine(policy, trajectories, vocab, tokenizer, retriever, config, timings,
                                  slots=rows_per_wave, waves=True))
    else:
        for first in range(0, len(trajectories), rows_per_wave):
            rows = list(range(first, min(first + rows_per_wave, len(trajectories))))
            _run_wave(policy, [trajectories[row] for row in rows], rows, batch, vocab, tokenizer, retriever, config,
                      timings)
            timings["waves"] += 1

    for traj in trajectories:
        traj.done = True
    batch = collate(trajectories, vocab, pad_id=pad_token_id(tokenizer), pad_to_multiple=config.pad_to_multiple)
    total = time.perf_counter() - started
    timings["host_s"] = total - sum(v for k, v in timings.items() if k.endswith("_s") and k != "host_s")
    timings["total_s"] = total
    return batch.with_timings(timings)


def _run_wave(policy, trajectories: list[Trajectory], trajectory_ids: list[int], batch: int, vocab, tokenizer,
              retriever, config, timings: dict) -> None:
    """The turn loop for one wave of rows (``trajectory_ids``: their rows in the whole rollout)."""
    clock = time.perf_counter()
    policy.start([t.prompt_ids for t in trajectories], trajectory_ids=trajectory_ids, batch=batch)
    timings["prefill_s"] += time.perf_counter() - clock

    for turn in range(config.max_turns + 1):
        search_allowed = turn < config.max_turns
        budgets = np.array([min(config.max_action_tokens, config.max_context - t.length) for t in trajectories])
        for traj, budget in zip(trajectories, budgets):
            if not traj.done and budget <= 0:
                traj.done = traj.truncated = True
        active = np.array([not t.done for t in trajectories])
        if not active.any():
            break
        clock = time.perf_counter()
        context = [t.length for t in trajectories]
        sampled = policy.act(active, budgets)
        timings["decode_s"] += time.perf_counter() - clock
        count_decode_work([0 if a is None else len(a.ids) for a in sampled], context, timings)

        searches, chunks, cuts = _record_actions(trajectories, sampled, vocab, tokenizer, config, search_allowed)
        if any(kept is not None for kept in cuts):
            policy.cut_last_actions(cuts)
        if searches:
            clock = time.perf_counter()
            feedback = protocol.batch_search_feedback(retriever, [q for _, q in searches], config.topk)
            timings["retrieval_s"] += time.perf_counter() - clock
            for (row, _), text in zip(searches, feedback):
                chunks[row] = cut_feedback(tokenizer, text, trajectories[row], config)
                trajectories[row].add_feedback(chunks[row], "search")
                trajectories[row].searches += 1
        clock = time.perf_counter()
        if search_allowed:
            policy.observe(chunks)
        timings["append_s"] += time.perf_counter() - clock


def _record_actions(trajectories: list[Trajectory], sampled: list[SampledAction | None], vocab, tokenizer, config,
                    search_allowed: bool) -> tuple[list[tuple[int, str]], list[list[int]], list[int | None]]:
    """Record this turn's actions and apply the protocol to each (:func:`apply_action`).

    Returns the turn's search requests ``(row, query)``, the feedback chunks so far (the
    invalid-action message where due; search results are filled in by the caller) and, per
    row, the token count its action was cut to (``None``: kept whole), for the policy.
    """
    searches: list[tuple[int, str]] = []
    chunks: list[list[int]] = [[] for _ in trajectories]
    cuts: list[int | None] = [None for _ in trajectories]
    for row, (traj, action) in enumerate(zip(trajectories, sampled)):
        if action is None:
            continue
        outcome = apply_action(traj, action, vocab, tokenizer, config, search_allowed)
        cuts[row], chunks[row] = outcome.cut, list(outcome.feedback)
        if outcome.query is not None:
            searches.append((row, outcome.query))
    return searches, chunks, cuts
