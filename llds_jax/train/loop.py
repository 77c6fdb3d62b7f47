"""The rollout → score → update loop of GRPO + LLDS training (SPEC §1).

One iteration: take ``train.prompts_per_step`` questions, roll out ``rollout.n_samples``
trajectories each with the *current* params (the sampler reads the learner's arrays directly:
same rules table, no resharding), score EM on the last ``<answer>``, group by prompt, then let
the :class:`~llds_jax.train.learner.Learner` run π_old / π_ref / the sequential mini-batch
updates. Everything measured is written through :class:`~llds_jax.train.metrics.MetricsWriter`
with the keys the diagnostics contract names (``llds_jax/diagnostics/__init__.py``).

Several hosts (``jax.process_count() > 1``): every host draws the same prompt batch (same
iterator, same seed) and rolls out only its share — the prompts whose trajectory rows are the
learner's ``host_rows()``, so each GRPO group lives on one host and group ids stay global —
with its own sampling key and a host-local copy of the policy (``Learner.sampler_policy``).
The update then assembles the global batch. Logged metrics are combined over hosts
(:func:`combine_over_hosts`: means, extrema, summed rollout throughput) so every host sees the
same numbers (the monitor decides alike everywhere); only process 0 writes them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from llds_jax.data.lengths import row_lengths
from llds_jax.data.prompts import PromptIterator
from llds_jax.diagnostics import DeathSpiralMonitor, MonitorConfig, keys, step_diagnostics
from llds_jax.diagnostics.from_rollout import response_batch_from_sums
from llds_jax.diagnostics.monitor import Action
from llds_jax.parallel import distributed
from llds_jax.rollout.batch_ops import concatenate
from llds_jax.rollout.multi_turn import pad_token_id, run_rollouts
from llds_jax.rollout.reward import em_rewards
from llds_jax.train.batch import TrainBatch
from llds_jax.train.dynamic_sampling import Draw, draw_metrics, mixed_groups, select
from llds_jax.train.learner import Learner
from llds_jax.train.metrics import MetricsWriter
from llds_jax.train.profiling import StepProfiler
from llds_jax.train.utilisation import computed_rows, device_count, step_utilisation


def rollout_metrics(rollout, rewards: np.ndarray) -> dict[str, float]:
    """Reward, the rollout's own ``stats()`` (under its names) and the rollout's timings."""
    timings = rollout.timings
    return {
        keys.REWARD_MEAN: float(rewards.mean()), "reward/max": float(rewards.max()),
        "reward/group_solved_frac": float(np.mean([rewards[rollout.group_ids == g].max() > 0
                                                   for g in np.unique(rollout.group_ids)])),
        **rollout.stats(),
        "time/rollout_s": float(timings.get("total_s", 0.0)),
        "time/retrieval_s": float(timings.get("retrieval_s", 0.0)),
        "time/decode_s": float(timings.get("decode_s", 0.0)),
        "time/prefill_s": float(timings.get("prefill_s", 0.0) + timings.get("append_s", 0.0)),
        "throughput/rollout_tokens_per_s": float(rollout.action_mask.sum() / max(timings.get("total_s", 0.0), 1e-9)),
    }


def write_samples(workdir, step: int, records, rollout, rewards: np.ndarray, count: int) -> None:
    """Append the first ``count`` trajectories' text, answer and reward to ``<workdir>/samples.jsonl``.

    Metrics say *that* reward is 0; these lines say *why* (no tag, wrong span, copied question).
    ``lengths`` (prompt, action and feedback tokens) let ``--mode=plan`` predict a step from a run
    (``plan.length_source=<workdir>``).
    """
    if count <= 0:
        return
    import json

    with open(workdir / "samples.jsonl", "a") as handle:
        for row in range(min(count, len(rewards))):
            record = records[int(rollout.group_ids[row])]
            handle.write(json.dumps({"step": step, "question": record.question,
                                     "golden_answers": list(record.golden_answers), "answer": rollout.answers[row],
                                     "reward": float(rewards[row]), "response": rollout.response_texts[row],
                                     "lengths": row_lengths(rollout.prompt_lengths[row], rollout.action_index[row],
                                                            rollout.feedback_mask[row],
                                                            rollout.action_feedback[row])}) + "\n")


def host_prompt_share(learner: Learner, num_prompts: int, n_samples: int) -> slice:
    """The prompts of a step whose ``n_samples`` trajectories each are this host's batch rows."""
    rows = learner.host_rows()
    if rows.start % n_samples or rows.stop % n_samples:
        raise ValueError(f"process {jax.process_index()} feeds trajectory rows {rows.start}:{rows.stop}, which "
                         f"split a group of rollout.n_samples={n_samples}: make train.prompts_per_step="
                         f"{num_prompts} a multiple of the number of processes ({jax.process_count()})")
    return slice(rows.start // n_samples, rows.stop // n_samples)


def combine_over_hosts(metrics: dict[str, float]) -> dict[str, float]:
    """One step's host metrics combined over processes (identity on one host; a collective otherwise).

    Each key as its ``hosts`` column in ``diagnostics.keys.TABLE`` says: per-row means (reward,
    rollout stats, diagnostics) are averaged — exact, since hosts hold equal row counts —
    extrema take the extremum, ``time/*`` the slowest host, counts and rollout throughput the
    sum; device metrics of the update are already global. Means of host-local ratios whose
    denominators differ per host (e.g. ``diag/ll_correct/all``: over each host's correct
    responses) are approximate.
    """
    if jax.process_count() == 1:
        return metrics
    return distributed.reduce_over_hosts(metrics, keys.host_reduction)


def rl_loop(learner: Learner, tokenizer, retriever, prompts: PromptIterator, writer: MetricsWriter, config, *,
            start_step: int = 0, on_step_end: Callable[[int, dict, dict], Any] | None = None,
            monitor: DeathSpiralMonitor | None = None,
            reward_fn: Callable[[list, list], np.ndarray] | None = None) -> list[dict[str, float]]:
    """Run RL steps ``start_step .. train.total_steps - 1``; returns the per-step metric dicts.

    ``on_step_end(step, metrics, per_mini_batch)`` runs after a step is logged (checkpointing,
    the non-finite streak); ``per_mini_batch`` holds the update's per-mini-batch numpy arrays
    (``update/skipped``: 1.0 where that mini-batch's update was non-finite and skipped), in
    update order. Returning ``"stop"`` ends the loop early (preemption, non-finite streak).
    ``reward_fn(answers, golden_answers_per_row) -> [N] float32`` scores each trajectory's own last
    answer; default ``rollout.reward.em_rewards`` (the one EM, also eval's).
    """
    history = []
    base_key = jax.random.key(config.seed)
    slots = int(config.rollout.max_turns) + 1
    multi_host = jax.process_count() > 1
    bar = tqdm(range(start_step, config.train.total_steps), desc="rl", unit="step", dynamic_ncols=True,
               initial=start_step, total=config.train.total_steps, disable=not distributed.is_main_process())
    profiler = StepProfiler(config.train.profile_steps, writer.workdir)  # train.profile_steps
    for step in bar:
        profiler.begin(step)
        started = time.perf_counter()
        key = jax.random.fold_in(base_key, step)
        if multi_host:  # hosts sample different prompts: independent noise per host
            key = jax.random.fold_in(key, jax.process_index())
        policy = learner.sampler_policy()
        draw = functools.partial(draw_prompts, prompts, learner, policy, tokenizer, retriever, config, key,
                                 reward_fn or em_rewards)
        first = draw(0)
        if config.train.dynamic_sampling:
            rollout, rewards, records, metrics = dynamic_batch(first, draw, config, pad_id=pad_token_id(tokenizer))
        else:
            rollout, rewards = first.rollout, first.rewards
            records = dict(enumerate(first.records, start=int(rollout.group_ids[0])))
            metrics = {**rollout_metrics(rollout, rewards), **draw_metrics([first], len(first.records)),
                       "reward/trained_mean": float(rewards.mean()), "data/epoch": float(first.epoch)}
        host_batch = TrainBatch.from_rollout(rollout, rewards, length=learner.seq_len,
                                             ma_search_count=config.rl.ma_search_count,
                                             with_sampler_logp=config.rl.rollout_correction != "none")
        update_metrics, extra = learner.update(learner.upload(host_batch))
        metrics.update(update_metrics)
        metrics.update(step_utilisation(
            learner.model_config, config, metrics=metrics, rollout_timings=rollout.timings,
            computed=computed_rows(learner, extra["batch"], rollout.lengths), logprob_passes=extra["logprob_passes"],
            mesh_devices=learner.mesh.size, sampler_devices=device_count(policy[1]),
            weight_bytes=jax.tree.leaves(policy[1])[0].dtype.itemsize))
        with_delta = config.train.delta_diagnostics and step % config.train.delta_every == 0
        sums, gap_metrics = learner.step_reductions(extra["batch"], rollout.sampler_logprobs, slots,  # on device
                                                    with_delta=with_delta, advantages=extra["advantages"])
        metrics.update(gap_metrics)
        diag_batch = response_batch_from_sums(rollout, advantage=extra["advantages"], reward=rewards, sums=sums)
        metrics.update(step_diagnostics(diag_batch))
        profiler.end(step)
        metrics[keys.STEP_SECONDS] = time.perf_counter() - started
        metrics = combine_over_hosts(metrics)
        if monitor is not None:
            report = monitor.update(step, metrics)
            metrics.update(report.as_metrics())
            if report.action is Action.STOP:
                tqdm.write(f"death-spiral monitor: STOP at step {step} ({report})")
            elif report.action is Action.RAISE_LAMBDA:  # every host decides alike: same metrics
                learner.set_llds_coef(report.llds_lambda)
                tqdm.write(f"death-spiral monitor: step {step}: {report.message}; the next update uses "
                           f"λ = {report.llds_lambda:g}")
        writer.write(step, metrics, phase="rl")
        if distributed.is_main_process():
            write_samples(writer.workdir, step, records, rollout, rewards, config.train.samples_per_step)
        bar.set_postfix(reward=f"{metrics[keys.REWARD_MEAN]:.3f}", llds=f"{metrics[keys.LLDS_VALUE]:.2e}",
                        search=f"{metrics[keys.SEARCHES]:.2f}")
        history.append(metrics)
        stop = on_step_end(step, metrics, extra["per_mini_batch"]) if on_step_end is not None else None
        if stop == "stop" or (monitor is not None and report.action is Action.STOP):
            break
    bar.close()
    profiler.close()
    return history


def draw_prompts(prompts: PromptIterator, learner: Learner, policy, tokenizer, retriever, config, key,
                 reward_fn: Callable[[list, list], np.ndarray], number: int) -> Draw:
    """The next prompt batch (this host's share) rolled out with ``policy`` and scored.

    ``number`` > 0: the step's extra draws under dynamic sampling, each with its own sampling key.
    """
    batch = next(prompts)
    share = host_prompt_share(learner, len(batch.records), config.rollout.n_samples)
    rollout = run_rollouts(policy, tokenizer, [r.question for r in batch.records[share]], retriever, config.rollout,
                           key=jax.random.fold_in(key, number) if number else key,
                           group_ids=list(range(share.start, share.stop)))
    golden = [batch.records[g].golden_answers for g in rollout.group_ids]
    return Draw(rollout, reward_fn(rollout.answers, golden), batch.records[share], batch.epoch)


def dynamic_batch(first: Draw, draw: Callable[[int], Draw], config, *, pad_id: int):
    """``train.dynamic_sampling``: draw until ``prompts_per_step`` mixed groups (or the cap); train on those.

    Returns the trained rollout (this host's share of groups, group ids as without dynamic
    sampling), its rewards, the records by group id and the step's host metrics: reward and
    rollout statistics over *every* trajectory drawn (the policy's own reward, not the filtered
    batch's), the ``dynamic/*`` counts, ``reward/trained_mean`` over the trained batch.
    Several hosts draw in step (a collective per draw) so the prompt iterators stay aligned.
    """
    share = len(first.records)
    draws = [first]
    cap = int(config.train.dynamic_sampling_max_draws)
    while len(draws) < cap and _any_host(sum(mixed_groups(d.rewards, d.rollout.group_ids).sum() for d in draws)
                                         < share):
        draws.append(draw(len(draws)))
    first_group = int(first.rollout.group_ids[0])
    chosen = select(draws, share, pad_id=pad_id, first_group=first_group)
    offset = int(first.rollout.group_ids.max()) + 1  # draws reuse group ids: keep them apart for the metrics
    every = concatenate([dataclasses.replace(d.rollout, group_ids=d.rollout.group_ids + i * offset)
                         for i, d in enumerate(draws)], pad_id=pad_id)
    metrics = rollout_metrics(every, np.concatenate([d.rewards for d in draws]))
    metrics.update(chosen.metrics)
    metrics["reward/trained_mean"] = float(chosen.rewards.mean())
    metrics["data/epoch"] = float(draws[-1].epoch)
    return chosen.rollout, chosen.rewards, dict(enumerate(chosen.records, start=first_group)), metrics


def _any_host(flag: bool) -> bool:
    """``flag`` or-ed over processes (a collective on several hosts)."""
    if jax.process_count() == 1:
        return bool(flag)
    return distributed.reduce_over_hosts({"flag": float(flag)}, lambda _: "max")["flag"] > 0


def make_monitor(config, llds_lambda: float | None = None,
                 history: Iterable[Mapping[str, Any]] = ()) -> DeathSpiralMonitor | None:
    """The configured monitor, or None; restored from ``history`` when the run resumes.

    ``llds_lambda`` is the λ in force (a resumed run's may have been raised); ``history`` the
    recorded RL rows of the steps before the resumed one (``MetricsWriter.rows_before``),
    replayed through :meth:`DeathSpiralMonitor.warm_up` so the windows and the phase are what an
    uninterrupted run would have. On several hosts process 0's rows are replayed on every host
    (a collective), so every host's monitor decides alike even if only process 0 can read them.
    """
    section = config.monitor
    if not section.enabled:
        return None
    settings = {k: v for k, v in section.to_dict().items() if k != "enabled"}
    llds_lambda = config.rl.llds_coef if llds_lambda is None else llds_lambda
    monitor = DeathSpiralMonitor(MonitorConfig.from_mapping(settings), llds_lambda=llds_lambda)
    rows = [{k: row.get(k) for k in ("step", *monitor.reads)} for row in history]
    if jax.process_count() > 1:
        rows = distributed.allgather_json(rows)[0]
    monitor.warm_up(rows)
    return monitor
