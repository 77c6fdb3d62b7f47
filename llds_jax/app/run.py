"""Entry points ``--mode=train`` and ``--mode=sft``: wire config → model → retriever → loops → checkpoint → eval.

``train_main`` runs, in order: config validation (every section, ``llds_jax.config.validate``) and
the batch arithmetic table; model and tokenizer on the mesh (``models.loading``); the retriever
(``retrieval.build_retriever``, with the ``retrieval.max_doc_tokens`` cut eval also gets); resume from ``<workdir>/checkpoints`` if
there is one (which skips the warm-up: the checkpoint already holds the warmed-up policy and
its reference); otherwise ``train.warmup_sft_steps`` of format warm-up; the RL loop with
checkpoints every ``train.save_every`` steps and on SIGTERM; a final checkpoint, an HF export,
a short evaluation, and a summary.

After ``train.max_nonfinite_updates`` skipped (non-finite) optimizer updates in a row the run
stops: it checkpoints the state (the last finite one — a skipped update changes nothing but
the counters) with the message under ``extra["stopped"]``, writes the message into
``summary.json`` (``"stopped"``), skips export and eval, and raises ``NonFiniteStop`` — a
``SystemExit``, so the command exits with status 1 and prints the message.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import numpy as np

from llds_jax.config import batch_arithmetic, validate, validate_sections
from llds_jax.parallel import distributed

log = logging.getLogger(__name__)


def load_policy_and_retriever(config, mesh):
    """(model on ``mesh``, tokenizer, retriever) as train and sft build them; the retriever comes from
    the same factory and ``retrieval`` section as ``--mode=eval``'s, so both see the same documents.
    ``retrieval.method="mesh"`` shards its index over this same ``mesh`` (``retrieval.mesh_axis``: over
    those axes only), beside the model's weights."""
    from llds_jax.models.loading import load_model_and_tokenizer
    from llds_jax.retrieval.factory import build_retriever

    model, tokenizer = load_model_and_tokenizer(config.model, mesh)
    return model, tokenizer, build_retriever(config.retrieval, tokenizer, mesh=mesh)


def _setup(config):
    from absl import logging as absl_logging

    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.run import check_fits_before_training, plan_as_json
    from llds_jax.train.loggers import effective_loggers
    from llds_jax.train.metrics import MetricsWriter

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save step at INFO
    validate(config)
    print(batch_arithmetic(config), flush=True)
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if distributed.is_main_process():
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=1) + "\n")
    mesh = make_mesh(tuple(config.mesh.shape))
    plan = check_fits_before_training(config, mesh.devices.flat)
    if plan is not None:
        print("plan: every phase fits the devices' memory", flush=True)
        if distributed.is_main_process():  # what the run was checked against, beside its metrics
            (workdir / "plan.json").write_text(json.dumps(plan_as_json(plan), indent=1) + "\n")
    clock = time.perf_counter()
    model, tokenizer, retriever = load_policy_and_retriever(config, mesh)
    print(f"model {config.model.source} ({model.config.num_layers} layers, vocab {model.config.vocab_size}) and "
          f"{config.retrieval.method} retriever ready in {time.perf_counter() - clock:.1f}s on mesh "
          f"{dict(mesh.shape)}", flush=True)
    writer = MetricsWriter(workdir, console=None, loggers=effective_loggers(config.train), settings=config.train)
    writer.log_config(config.to_dict())
    return workdir, mesh, model, tokenizer, retriever, writer


def sft_main(config) -> None:
    """``--mode=sft``: the warm-up alone, exported as an HF directory."""
    run_sft_only(config)


def train_main(config) -> None:
    """``--mode=train``; see :func:`train`."""
    train(config)


def run_sft_only(config) -> Path:
    """The format warm-up alone (``sft.steps``), exported as an HF directory; returns its path."""
    from llds_jax.data.prompts import load_questions
    from llds_jax.models import save_pretrained
    from llds_jax.train.sft import run_sft

    config.train.warmup_sft_steps = max(1, config.sft.steps)
    workdir, mesh, model, tokenizer, retriever, writer = _setup(config)
    records = load_questions(config.sft.data)
    model, history = run_sft(model, tokenizer, retriever, config, mesh, writer, steps=config.sft.steps,
                             records=records)
    out = workdir / "sft_model"
    save_pretrained(model, out)
    tokenizer.save_pretrained(str(out))
    writer.close()
    print(f"SFT: loss {history[0]['sft/loss']:.3f} → {history[-1]['sft/loss']:.3f} over {len(history)} steps; "
          f"model written to {out}")
    return out


def train(config) -> dict:
    """(resume | warm-up) → GRPO + LLDS → checkpoint → export → eval; returns the run summary."""
    from llds_jax.app.run_control import NonFiniteStop, NonFiniteStreak, PreemptionGuard
    from llds_jax.data.prompts import PromptIterator, load_questions
    from llds_jax.train.checkpoint import Checkpointer, resume
    from llds_jax.train.learner import Learner
    from llds_jax.train.loop import make_monitor, rl_loop
    from llds_jax.train.sft import run_sft

    started = time.perf_counter()
    validate_sections(config)  # every section before anything else; device-count relations in _setup
    distributed.initialize(config)  # before anything touches devices: JAX fixes the device set at first use
    workdir, mesh, model, tokenizer, retriever, writer = _setup(config)
    records = load_questions(config.data.train, config.data.limit_per_source or None)
    prompts = PromptIterator(records, config.train.prompts_per_step, seed=config.seed, shuffle=config.data.shuffle)
    ckpt = Checkpointer(workdir.resolve(), keep=config.train.keep_checkpoints)  # Orbax: absolute path
    timings = {}

    start_step = 0
    if ckpt.latest_step() is not None and config.resume != "never":
        # The restore target is the learner's abstract state (shapes and shardings, no arrays): resume
        # holds the loaded model and the restored state, nothing more. The checkpoint holds the
        # warmed-up policy and its reference, so the warm-up is skipped.
        learner, restored = Learner.resume(model, config, mesh, ckpt)
        prompts.load_state_dict(restored.extra["data"])
        start_step = restored.step + 1
        print(f"resumed from step {restored.step}: warm-up skipped, data iterator at {prompts.state_dict()}")
    else:
        resume(ckpt, config.resume, None)  # "never" with checkpoints present fails here, naming them
        if config.train.warmup_sft_steps > 0:
            clock = time.perf_counter()
            sft_records = load_questions(config.sft.data)
            model, sft_history = run_sft(model, tokenizer, retriever, config, mesh, writer,
                                         steps=config.train.warmup_sft_steps, records=sft_records)
            timings["sft_s"] = time.perf_counter() - clock
            print(f"format warm-up: loss {sft_history[0]['sft/loss']:.3f} → {sft_history[-1]['sft/loss']:.3f} "
                  f"in {timings['sft_s']:.0f}s", flush=True)
        learner = Learner.create(model, config, mesh)  # π_ref = the (warmed-up) starting policy
    del model

    guard = PreemptionGuard().install()
    limit = int(config.train.max_nonfinite_updates)
    streak = NonFiniteStreak(limit) if limit else None
    stopped = []  # the non-finite streak's message, once it trips

    def on_step_end(step, metrics, per_mini_batch):
        # The skip flags are replicated device outputs, equal on every host: every host trips together.
        if streak is not None and streak.record(per_mini_batch["update/skipped"]):
            stopped.append(streak.message)
        stop = guard.should_stop(step) or bool(stopped)  # should_stop is a collective on several hosts: always ask
        last = step == config.train.total_steps - 1
        if stop or last or (config.train.save_every and (step + 1) % config.train.save_every == 0):
            extra = {"data": prompts.state_dict(), "config": config.to_dict()}
            if stopped:
                extra["stopped"] = stopped[0]
            clock = time.perf_counter()
            ckpt.save(step, learner.state, extra)
            timings["checkpoint_s"] = timings.get("checkpoint_s", 0.0) + time.perf_counter() - clock
        return "stop" if stop else None

    clock = time.perf_counter()
    try:
        history = rl_loop(learner, tokenizer, retriever, prompts, writer, config, start_step=start_step,
                          on_step_end=on_step_end,
                          monitor=make_monitor(config, learner.llds_coef, writer.rows_before(start_step)))
    finally:
        guard.uninstall()
    timings["rl_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    ckpt.wait()  # the last save's asynchronous writes: checkpoint_s is what the run waited for saves
    timings["checkpoint_s"] = timings.get("checkpoint_s", 0.0) + time.perf_counter() - clock
    compile_counts = learner.compile_counts()
    if stopped:
        ckpt.close()
        writer.close()
        timings["total_s"] = time.perf_counter() - started
        summary = _summary(history, None, timings, compile_counts, workdir)
        summary["stopped"] = stopped[0]
        _write_summary(workdir, summary)
        log.error("%s", stopped[0])
        print(f"{_summary_text(summary)}\n{stopped[0]}", flush=True)
        raise NonFiniteStop(stopped[0])
    if history and any(n > 1 for n in compile_counts.values()):  # π_ref's is 0 in a 1-step run
        raise RuntimeError(f"a jitted step function compiled more than once: {compile_counts}")
    final_step = start_step + len(history) - 1
    if config.train.export_hf and history:
        export = ckpt.export_hf(final_step, _policy_model(learner))
        if distributed.is_main_process():
            tokenizer.save_pretrained(str(export))
    ckpt.close()

    eval_summary = None
    # Every host all-gathers the params (a collective); process 0 alone evaluates and writes.
    policy = learner.sampler_policy() if config.eval.data else None
    if config.eval.data and distributed.is_main_process():
        clock = time.perf_counter()
        eval_summary = _evaluate(policy, tokenizer, retriever, config, workdir)
        timings["eval_s"] = time.perf_counter() - clock
        writer.write(final_step, {f"eval/{k}": v for k, v in eval_summary.items()}, phase="eval")
    writer.close()
    timings["total_s"] = time.perf_counter() - started
    summary = _summary(history, eval_summary, timings, compile_counts, workdir)
    _write_summary(workdir, summary)
    print(_summary_text(summary), flush=True)
    return summary


def _write_summary(workdir: Path, summary: dict) -> None:
    if distributed.is_main_process():
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _policy_model(learner):
    """The policy as a Decoder whose arrays this process can read (all-gathered on several hosts)."""
    from flax import nnx

    return nnx.merge(*learner.sampler_policy())


def _evaluate(policy, tokenizer, retriever, config, workdir: Path) -> dict[str, float]:
    from llds_jax.eval.run import evaluate, load_eval_datasets, write_results

    datasets = load_eval_datasets(config.eval.data, config.eval.limit)
    result = evaluate(policy, tokenizer, datasets, retriever, config.rollout, greedy=config.eval.greedy,
                      key=jax.random.key(config.seed + 7), batch_size=config.eval.batch_size)
    write_results(result, workdir / "eval", title=f"{config.model.source} after RL",
                  extra={"model": config.model.source, "limit_per_source": config.eval.limit})
    flat = {}
    for source, scores in result.summary.items():
        for key, value in scores.items():
            flat[f"{source}/{key}"] = value
    flat["decoding_greedy"] = float(config.eval.greedy)
    return flat


def _summary(history, eval_summary, timings, compile_counts, workdir) -> dict:
    def series(key):
        return [round(float(h[key]), 6) for h in history if h.get(key) is not None]

    return {
        "workdir": str(workdir), "rl_steps": len(history),
        "reward_per_step": series("reward/mean"), "llds_value_per_step": series("llds/value"),
        "searches_per_step": series("rollout/searches"), "step_seconds": series("time/step_s"),
        "rollout_seconds": series("time/rollout_s"), "update_seconds": series("time/update_s"),
        "skipped_updates": float(np.sum(series("update/skipped"))) if history else 0.0,
        "compile_counts": compile_counts, "eval": eval_summary, "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }


def _summary_text(summary: dict) -> str:
    lines = ["", "=" * 72, f"run summary ({summary['workdir']})"]
    for key, label in (("reward_per_step", "reward/mean per step"), ("llds_value_per_step", "LLDS value per step"),
                       ("searches_per_step", "searches / trajectory"), ("step_seconds", "step seconds")):
        lines.append(f"  {label:<24}: " + " ".join(f"{v:.3g}" for v in summary[key]))
    lines.append(f"  {'skipped updates':<24}: {summary['skipped_updates']:.0f}")
    lines.append(f"  {'jit compiles':<24}: {summary['compile_counts']}")
    if summary["eval"]:
        lines.append(f"  {'eval':<24}: " + ", ".join(f"{k}={v:.3f}" for k, v in summary["eval"].items()
                                                      if k.endswith("/em")))
    lines.append(f"  {'timings':<24}: " + ", ".join(f"{k}={v}" for k, v in summary["timings_s"].items()))
    lines.append("=" * 72)
    return "\n".join(lines)
