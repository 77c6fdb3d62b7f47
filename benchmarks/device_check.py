"""The one-GPU check: parity, a paper-shaped training job, and the plan's prediction, in one table.

    bash launch/device_check.sh --out OUT --tokenizer DIR [--plan-json FILE]   # on the GPU, ≈ 9 min
    bash launch/device_check.sh --dry-run                                      # CPU, tiny: the test suite

The parts, each in its own process so one failing leaves the others' numbers (and so the GPU is
held by one process at a time); this orchestrating process never starts a JAX backend:

1. ``parity`` — a random Qwen2.5-0.5B-shaped transformers model (fp32, TF32 off) against our
   decoder loaded from its safetensors, float32 and bfloat16, every attention kernel that resolves
   on the platform (blockwise, cuDNN for bf16 on GPU): max |Δ| of the logits and of the targets'
   log-probs on a left- and right-padded batch.
2. ``train`` — ``python -m llds_jax.main --config=configs/device_check.py`` (Qwen2.5-0.5B shapes,
   random weights, 64 prompts × 5, the paper's caps): per-phase seconds, MFU/MBU and the devices'
   peak memory from its ``metrics.jsonl``.
3. ``decode`` — one decode step of the rollout at the job's shape (``benchmarks/device_decode_step.py``:
   the slot engine with the backend's decode kernel and with the XLA key-block loop; the waves run
   this same engine, ``rollout.engine="waves"``), ms a step against its bytes bound, with a profile
   of the top kernels; its logits at a trained model's spread (the top-p sampler's two-read path) and,
   ``paged_kernel_flat_logits``, at the random init's (its full-row fallback on every row).
4. ``passes`` (``--with-passes``) — π_old + π_ref, the update and the Δ forward alone on a
   rollout-shaped batch, timed after their compile (the steady state the step's first, compiling
   step hides).
5. ``predict`` — ``plan.step_time.predict_step_time`` for the same job on the same chip, from the
   lengths the run itself sampled (its ``samples.jsonl``), and the planned memory per phase (the
   run's own ``plan.json``, or ``--plan-json``: ``--mode=plan --config.plan.gpu=h100`` compiled
   ahead of time, which saves the GPU minutes of compiling it there).

Writes ``OUT/device_check.json`` and ``OUT/device_check.md`` (the table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- 1. parity
def _padded_batch(batch: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), bool)
    for row in range(batch):  # even rows left-padded, odd rows right-padded, by different amounts
        pad = (row + 1) * length // (2 * batch + 2)
        if row % 2:
            mask[row, length - pad:] = False
        else:
            mask[row, :pad] = False
    return ids, mask


def run_parity(out: Path, dry_run: bool) -> dict:
    """Our decoder against transformers' on one random checkpoint; returns (and writes) the diffs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from llds_jax.models import from_pretrained
    from llds_jax.models.attention import resolve_backend
    from llds_jax.models.loading import KNOWN_MODELS

    fields = dict(KNOWN_MODELS["Qwen2.5-0.5B"])
    if dry_run:
        fields.update(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128)
    batch, length = (2, 32) if dry_run else (4, 256)
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(**{k: v for k, v in fields.items() if k != "model_type"},
                                         torch_dtype="float32")
    hf_model = transformers.Qwen2ForCausalLM(hf_config).eval()
    checkpoint = out / "parity_checkpoint"
    hf_model.save_pretrained(checkpoint)
    ids, mask = _padded_batch(batch, length, fields["vocab_size"])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model = hf_model.to(device)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device),
                          attention_mask=torch.as_tensor(mask, dtype=torch.long, device=device),
                          position_ids=torch.as_tensor(np.maximum(np.cumsum(mask, 1) - 1, 0), device=device)).logits
        reference = logits.float().cpu().numpy()
    del hf_model, logits
    if device == "cuda":
        torch.cuda.empty_cache()
    real = mask[:, :-1] & mask[:, 1:]  # next-token targets that are real tokens after real tokens

    def target_logprobs(x):
        x = x - x.max(-1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]

    ref_logp = target_logprobs(reference.astype(np.float64))
    platform = jax.default_backend()
    rows = []
    for dtype in ("float32", "bfloat16"):
        kernels = ["xla_blockwise"] + (["cudnn"] if platform == "gpu" and resolve_backend("auto", platform) == "cudnn"
                                       and dtype == "bfloat16" else [])
        for kernel in kernels:
            model = from_pretrained(checkpoint, dtype=dtype, attention=kernel)
            graphdef, state = nnx.split(model)
            forward = jax.jit(lambda s, i, m, g=graphdef: nnx.merge(g, s)(i, m).astype(jnp.float32))
            with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
                ours = np.asarray(forward(state, jnp.asarray(ids), jnp.asarray(mask)))
            logit_diff = float(np.max(np.abs(np.where(mask[..., None], ours - reference, 0.0))))
            logp_diff = float(np.max(np.abs(np.where(real, target_logprobs(ours.astype(np.float64)) - ref_logp, 0.0))))
            rows.append({"dtype": dtype, "kernel": kernel, "max_abs_logit_diff": logit_diff,
                         "max_abs_logprob_diff": logp_diff, "logit_scale": float(np.abs(reference).max())})
            del model, state
    result = {"platform": platform, "device": str(jax.devices()[0].device_kind), "batch": [batch, length],
              "model": "Qwen2.5-0.5B shapes, random" if not dry_run else "tiny Qwen2, random", "rows": rows}
    (out / "parity.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# ------------------------------------------------------------------- 1b. training passes alone
def job_config(dry_run: bool, tokenizer: str):
    """``configs/device_check.py`` (its ``dry_run`` variant) with the tokenizer set."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check_config", REPO / "configs" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("dry_run" if dry_run else "")
    config.model.tokenizer = tokenizer
    return config


def rollout_shaped_lengths(config, length: int, dry_run: bool):
    """One trajectory as a random policy's rollout makes it at ``config``'s caps: every action runs to its
    cap, an invalid-action message (40 tokens) after each but the last, all cut at ``length``."""
    from llds_jax.data.lengths import TrajectoryLengths

    rollout = config.rollout
    prompt, action, feedback = 150 if not dry_run else 40, int(rollout.max_action_tokens), 40 if not dry_run else 8
    actions, messages, position = [], [], prompt
    for k in range(int(rollout.max_turns) + 1):
        if position >= length:
            break
        end = min(position + action, length)
        actions.append(end - position)
        position = min(end + (feedback if k < int(rollout.max_turns) else 0), length)
        if position > end:
            messages.append(position - end)
    return TrajectoryLengths(prompt, tuple(actions), tuple(messages), (False,) * len(messages))


def rollout_shaped_arrays(config, length: int, dry_run: bool) -> tuple[dict, int]:
    """The batch of ``rollout_shaped_lengths`` trajectories: host arrays and the real tokens per row."""
    import numpy as np

    rows, shape = int(config.train.prompts_per_step) * int(config.rollout.n_samples), \
        rollout_shaped_lengths(config, length, dry_run)
    rng = np.random.default_rng(0)
    arrays = {name: np.zeros((rows, length), dtype) for name, dtype in
              (("attention_mask", bool), ("action_mask", np.float32), ("answer_mask", np.float32))}
    arrays["input_ids"] = rng.integers(3, 1000, (rows, length)).astype(np.int32)
    arrays["action_index"] = np.full((rows, length), -1, np.int32)
    arrays["attention_mask"][:, :shape.total] = True
    position = shape.prompt
    for k, action in enumerate(shape.actions):
        arrays["action_mask"][:, position:position + action] = 1
        arrays["action_index"][:, position:position + action] = k
        position += action + (shape.feedback[k] if k < len(shape.feedback) else 0)
    arrays.update(num_searches=np.zeros(rows, np.float32), rewards=(rng.random(rows) < 0.3).astype(np.float32),
                  group_ids=np.repeat(np.arange(rows // int(config.rollout.n_samples)), int(config.rollout.n_samples)))
    return arrays, shape.total


def passes_config(dry_run: bool, tokenizer: str, model: str = "", prompts: int = 0, rows: int = 0):
    """The job's config, or (``--passes-model``) the same passes at another model's shapes: ``model`` a
    ``model.source`` (``random:Qwen2.5-3B``: qwen3b's GEMM widths, the second shape a matmul efficiency
    fitted at the job's is checked on), ``prompts`` per step (rows = prompts × n_samples in one
    mini-batch, so a wide model's passes fit a device call) and ``rows`` per packed micro-batch (0: the
    job's ``train.micro_batch_tokens``). One device computes what one device of the target's mesh does when ``rows`` is the target's
    rows a micro-batch a data shard: qwen3b on 8×H100 packs 16 rows a micro-batch over 8 shards, 2 a device,
    so ``rows=2`` measures the GEMM shapes (8,192 tokens × d) whose efficiency its prediction rests on, where
    16 rows a device would time GEMMs 8× as tall (and plan 86.6 GB: more than an H100; 2 rows plan 69.9)."""
    config = job_config(dry_run, tokenizer)
    if model:
        config.model.source = model
        config.model.random_logit_std = 0.0  # no sampling here
    if prompts:
        config.train.prompts_per_step = prompts
        trajectories = prompts * int(config.rollout.n_samples)
        config.train.mini_batch_size = trajectories
        config.train.logprob_batch_size = math.gcd(int(config.train.logprob_batch_size), trajectories)
        config.train.samples_per_step = min(int(config.train.samples_per_step), trajectories)
    if rows:
        from llds_jax.train.batch import padded_length

        config.train.micro_batch_tokens = rows * padded_length(config)
    return config


def job_learner(config):
    """The job's learner on its own mesh: the model of ``config.model`` (random weights here) placed once."""
    from llds_jax.models.loading import load_model_and_tokenizer
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.learner import Learner

    mesh = make_mesh(tuple(config.mesh.shape))
    model, _ = load_model_and_tokenizer(config.model, mesh)
    return Learner.create(model, config, mesh)


def run_passes(out: Path, tokenizer: str, dry_run: bool, repeats: int | None = None, model: str = "",
               prompts: int = 0, rows: int = 0) -> dict:
    """π_old + π_ref, the update and the Δ forward of the job, timed after their compile: the median
    of ``repeats`` calls (default 2; 1 in the dry run, which pins the wiring, not the timings), beside
    the step-time model's prediction of the same passes on this chip (``plan.measured.predict_run`` on
    the batch's own lengths). ``model`` / ``prompts`` / ``rows``: :func:`passes_config`.

    The batch is ``rollout_shaped_arrays``: the step's training passes without the rollout's compile
    and decode in front of them.
    """
    import jax

    from llds_jax.plan.measured import predict_run
    from llds_jax.train.batch import TrainBatch
    from llds_jax.train.utilisation import peak_memory_bytes

    repeats = repeats or (1 if dry_run else 2)
    config = passes_config(dry_run, tokenizer, model, prompts, rows)
    learner = job_learner(config)
    length = learner.seq_len
    arrays, position = rollout_shaped_arrays(config, length, dry_run)
    hardware = _gpu_hardware()
    shape = rollout_shaped_lengths(config, length, dry_run)
    predicted = predict_run(config, [shape] * len(arrays["rewards"]), hardware, "the passes' rollout-shaped batch")
    predicted = {k: predicted.seconds[k] for k in ("logprobs", "update", "delta")}
    rows = len(arrays["rewards"])
    batch = learner.upload(TrainBatch.from_arrays(arrays, length=length))
    timings = []
    for _ in range(repeats + 1):  # the first compiles (and skips π_ref: it equals π_old then)
        metrics, extra = learner.update(batch)
        clock = time.perf_counter()
        jax.block_until_ready(learner.logprobs_now(extra["batch"]))
        timings.append({"logprobs_s": metrics["time/logprobs_s"], "update_s": metrics["time/update_s"],
                        "delta_s": time.perf_counter() - clock, "logprob_passes": extra["logprob_passes"]})
    steady = {key: statistics.median(t[key] for t in timings[1:]) for key in ("logprobs_s", "update_s", "delta_s")}
    result = {"model": str(config.model.source), "rows": rows, "rows_per_micro_batch": learner.packing.rows,
              "length": length, "tokens_per_row": position,
              "first": timings[0], "steady": steady, "predicted": predicted, "hardware": hardware or "this CPU",
              "repeats": repeats, "peak_memory_bytes": peak_memory_bytes(), "device": str(jax.devices()[0].device_kind)}
    (out / "passes.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# -------------------------------------------------------------------------------- 2. train
def run_decode(out: Path, tokenizer: str, dry_run: bool) -> dict:
    """``benchmarks/device_decode_step.py`` at the job's shape; its JSON becomes ``decode.json``."""
    command = [sys.executable, str(REPO / "benchmarks" / "device_decode_step.py"), f"--out={out / 'decode'}",
               f"--tokenizer={tokenizer}", "--profile", "--trace-dir=/tmp/device_check_traces",
               # the dry run pins the wiring on one variant (the CPU compiles each path's programs anew)
               "--variants=" + ("paged_kernel" if dry_run else "paged_kernel,paged_kernel@8,paged_kernel_split_k,paged_xla,paged_kernel_flat_logits"),
               *(["--dry-run"] if dry_run else [])]
    subprocess.run(command, cwd=REPO, check=True)
    result = json.loads((out / "decode" / "decode_step.json").read_text())
    (out / "decode.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_train(out: Path, tokenizer: str, dry_run: bool, timeout: float, extra: list[str]) -> dict:
    """The training job as a real process; returns its exit code, seconds and log tail."""
    workdir = out / "run"
    config = "configs/device_check.py" + (":dry_run" if dry_run else "")
    command = [sys.executable, "-m", "llds_jax.main", "--mode=train", f"--config={config}",
               f"--config.workdir={workdir}", f"--config.model.tokenizer={tokenizer}",
               "--config.plan.check_before_train=never", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("JAX_PLATFORMS", None) if not dry_run else env.update(JAX_PLATFORMS="cpu")
    started = time.perf_counter()
    with open(out / "train.log", "w") as log:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    tail = (out / "train.log").read_text(errors="replace")[-3000:]
    return {"command": " ".join(command), "exit": code, "seconds": time.perf_counter() - started, "log_tail": tail}


def measured_phases(workdir: Path) -> dict:
    """Per-phase seconds of the run: the median over its steps after the first (which compiles), and step 0."""
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl") if '"phase": "rl"' in line]
    if not rows:
        raise RuntimeError(f"{workdir}/metrics.jsonl has no RL step")
    later = rows[1:] or rows
    keys = {key for row in rows for key in row}
    median = {key: statistics.median(float(r[key]) for r in later if r.get(key) is not None)
              for key in keys if key.startswith(("time/", "throughput/", "memory/", "logprob_gap/"))
              and any(r.get(key) is not None for r in later)}
    return {"steps": len(rows), "median_after_first": median,
            "first_step": {k: v for k, v in rows[0].items() if k.startswith("time/")}}


# ------------------------------------------------------------------------------ 3. predict
def predict(config, workdir: Path, hardware: str, plan_json: str, dry_run: bool, extra: list[str]) -> dict:
    """The step-time model for the job's config on ``hardware`` (``plan.measured.predict_run``), from the
    run's own sampled lengths when it ran (else Search-R1 3B's reference lengths); the planned memory;
    and the record a later model replays (``plan.measured.replay``): config, overrides,
    chip and every trajectory's lengths."""
    from llds_jax.data.lengths import reference_lengths, run_lengths
    from llds_jax.plan.measured import lengths_json, overrides_from_flags, predict_run

    ran = (workdir / "samples.jsonl").exists()
    lengths = run_lengths(workdir) if ran else reference_lengths()
    label = f"the run's own samples ({workdir}/samples.jsonl)" if ran else "Search-R1 3B reference lengths (bundled)"
    from llds_jax.utils import flops

    cpu_peak = None
    if hardware not in flops.PEAKS:  # measured here: kept, so a replay predicts with the same CPU
        peak = flops.cpu_peak()
        cpu_peak = {"flops": peak.flops, "bytes_per_s": peak.bytes_per_s, "source": peak.source}
    step = predict_run(config, lengths, hardware, label, cpu_peak)
    planned = None
    source = Path(plan_json) if plan_json else workdir / "plan.json"
    if source.exists():
        plan = json.loads(source.read_text())
        planned = {"source": str(source), "compiler": plan.get("compiler"), "peak_bytes": plan.get("peak_bytes"),
                   "phases": {k: v["peak_bytes"] for k, v in plan.get("phases", {}).items()}}
    replay = {"config": "configs/device_check.py", "variant": "dry_run" if dry_run else "",
              "overrides": overrides_from_flags(extra),  # the tokenizer is this machine's path: not replayed
              "hardware": hardware, "cpu_peak": cpu_peak, "lengths": lengths_json(lengths)}
    return {"step_time": step.as_json(), "planned_memory": planned}, replay


# -------------------------------------------------------------------------------- the table
def _fmt(value, digits=2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
    lines = [f"# Device check — {result.get('device', '?')}", "",
             f"commit {result.get('commit', '?')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    parity = result.get("parity") or {}
    if parity.get("rows"):
        lines += [f"## Parity vs transformers ({parity['model']}, batch {parity['batch']})", "",
                  "| dtype | kernel | max Δ logit | max Δ target log-prob | max logit |", "|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['kernel']} | {r['max_abs_logit_diff']:.2e} | {r['max_abs_logprob_diff']:.2e} "
                  f"| {r['logit_scale']:.2f} |" for r in parity["rows"]]
        lines.append("")
    elif "parity_error" in result:
        lines += ["## Parity: FAILED", "", "```", result["parity_error"][-1500:], "```", ""]
    decode = result.get("decode")
    if decode:
        head = decode["header"]
        lines += [f"## One decode step ({head['model']}, {head['rows']} rows, mean live context "
                  f"{head['mean_live_tokens']} tokens; bytes bound {head['bytes_bound_ms']} ms at the measured "
                  f"{head['copy_bandwidth_GBps']} GB/s)", "",
                  "| path | ms a step | × bytes bound | device busy / wall | top kernels (share of device time) |",
                  "|---|---|---|---|---|"]
        for r in decode["results"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | error: {r['error'][:100]} | | | |")
                continue
            profile = r.get("profile") or {}
            busy = profile.get("device_busy_us")
            wall = r["ms_per_step"] * 1e3 * int(r["variant"].partition("@")[2] or head["steps_per_call"])
            top = "; ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in (profile.get("top") or [])[:3])
            lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['ms_per_step'] / head['bytes_bound_ms']:.2f} "
                         f"| {_fmt(busy and busy / wall)} | {top or profile.get('note', '')} |")
        lines.append("")
    elif "decode_error" in result:
        lines += ["## Decode step: FAILED", "", "```", result["decode_error"][-1500:], "```", ""]
    passes = result.get("passes")
    if passes:
        lines += [f"## Training passes after their compile ({passes['model']}, {passes['rows']} rows x "
                  f"{passes['length']} tokens, {passes['tokens_per_row']} real per row, "
                  f"{passes['rows_per_micro_batch']} to a micro-batch; median of {passes['repeats']})",
                  "", "| pass | seconds | predicted s | measured / predicted | first call (compiles) s |",
                  "|---|---|---|---|---|"]
        for name, key, phase in (("π_old + π_ref", "logprobs_s", "logprobs"), ("update", "update_s", "update"),
                                 ("Δ forward", "delta_s", "delta")):
            measured, predicted = passes["steady"][key], passes["predicted"][phase]
            lines.append(f"| {name} | {measured:.2f} | {_fmt(predicted)} | {_fmt(predicted and measured / predicted)} "
                         f"| {passes['first'][key]:.2f} |")
        lines += ["", f"peak device memory of the passes: {passes['peak_memory_bytes'] / 1e9:.2f} GB", ""]
    elif "passes_error" in result:
        lines += ["## Training passes: FAILED", "", "```", result["passes_error"][-1500:], "```", ""]
    measured = (result.get("measured") or {}).get("median_after_first", {})
    predicted = ((result.get("predicted") or {}).get("step_time") or {}).get("step_time_s", {})
    if measured or predicted:
        lines += ["## One RL step: measured (median of the steps after the first) vs predicted", "",
                  "| phase | measured s | predicted s | measured / predicted |", "|---|---|---|---|"]
        from llds_jax.plan.measured import ratios

        lines += [f"| {row} | {_fmt(m)} | {_fmt(p)} | {_fmt(ratio)} |" for row, m, p, ratio in ratios(measured, predicted)]
        lines += ["", "| utilisation | measured |", "|---|---|"]
        for key in ("throughput/update_mfu", "throughput/logprobs_mfu", "throughput/decode_mbu",
                    "throughput/decode_tokens_per_s", "logprob_gap/abs_mean", "logprob_gap/abs_max"):
            lines.append(f"| {key} | {_fmt(measured.get(key), 4)} |")
        planned = (result.get("predicted") or {}).get("planned_memory")
        peak = measured.get("memory/device_peak_bytes")
        lines += ["", f"memory: measured peak {_fmt(peak and peak / 1e9)} GB per device; planned peak "
                      f"{_fmt(planned and planned['peak_bytes'] and planned['peak_bytes'] / 1e9)} GB "
                      f"({(planned or {}).get('compiler', 'no plan')})", ""]
        assumptions = ((result.get("predicted") or {}).get("step_time") or {}).get("assumptions", {})
        lines += [f"- {k}: {v}" for k, v in assumptions.items()]
    train = result.get("train") or {}
    lines += ["", f"train: exit {train.get('exit')}, {_fmt(train.get('seconds'), 0)} s; `{train.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/device_check_out")
    parser.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU (the test suite)")
    parser.add_argument("--part", choices=("all", "parity", "passes", "decode"), default="all")
    parser.add_argument("--plan-json", default="", help="a --mode=plan JSON of the same job (planned memory)")
    parser.add_argument("--hardware", default="", help="PEAKS row of the chip (default: from nvidia-smi)")
    # On one H100 (2a07fdd) the job loads in ≈ 35 s, its first step takes ≈ 290 s (compiles included) and
    # the next ≈ 130 s: its 2 steps end by ≈ 455 s; with parity the check is ≈ 9 minutes, under one device
    # call's 10. Past this limit the table reports the steps that finished.
    parser.add_argument("--train-timeout", type=float, default=480.0)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: parity,decode,train")
    parser.add_argument("--with-passes", action="store_true",
                        help="also time the training passes alone after their compile (≈ 2 min more on an H100)")
    parser.add_argument("--passes-model", default="",
                        help="the passes at another model.source's shapes (random:Qwen2.5-3B: qwen3b's widths)")
    parser.add_argument("--passes-prompts", type=int, default=0, help="the passes' prompts per step (0: the job's)")
    parser.add_argument("--passes-rows", type=int, default=0,
                        help="the passes' rows per packed micro-batch (0: the job's; 2: a device's of qwen3b on 8xH100)")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "parity":
        run_parity(out, args.dry_run)
        return 0
    if args.part == "decode":
        run_decode(out, args.tokenizer, args.dry_run)
        return 0
    if args.part == "passes":
        run_passes(out, args.tokenizer, args.dry_run, model=args.passes_model, prompts=args.passes_prompts,
                   rows=args.passes_rows)
        return 0
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only orchestrates and does arithmetic
    if args.dry_run:  # the job as this CPU runs it: one device, whatever device count a caller forced
        os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                         os.environ.get("XLA_FLAGS", "")).strip()
        # The passes part and the training job compile the same update and π_old/π_ref programs: one
        # persistent compilation cache lets the job load them (the same executables) instead of compiling
        # them again. Not on the device, where the job's first (compiling) step is one of the measurements.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "jax_cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    hardware = args.hardware or _gpu_hardware()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    result = {"device": hardware or "CPU (dry run)", "commit": commit.strip() or "?"}
    skip = set(filter(None, args.skip.split(",")))
    for part in ("parity", "decode", "passes"):
        if part in skip or (part == "passes" and not args.with_passes):
            continue
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # torch shares the GPU in parity
        env.pop("JAX_PLATFORMS") if not args.dry_run else None
        try:
            proc = subprocess.run([sys.executable, __file__, f"--part={part}", f"--out={out}",
                                   f"--tokenizer={args.tokenizer}", *(["--dry-run"] if args.dry_run else []),
                                   f"--passes-model={args.passes_model}", f"--passes-prompts={args.passes_prompts}",
                                   f"--passes-rows={args.passes_rows}"],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=args.train_timeout)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as err:
            code, stdout, stderr = "timeout", str(err.stdout or ""), str(err.stderr or "")
        if code == 0:
            result[part] = json.loads((out / f"{part}.json").read_text())
        else:
            result[f"{part}_error"] = f"exit {code}\n" + stdout[-2000:] + stderr[-4000:]
        print(f"{part}:", json.dumps(result.get(part, "FAILED"))[:600], flush=True)
    if "train" not in skip:
        result["train"] = run_train(out, args.tokenizer, args.dry_run, args.train_timeout, extra)
        print(f"train: exit {result['train']['exit']} in {result['train']['seconds']:.0f}s", flush=True)
        if (out / "run" / "metrics.jsonl").exists():
            result["measured"] = measured_phases(out / "run")
    from llds_jax.plan.measured import load_config, overrides_from_flags

    config = load_config("configs/device_check.py", "dry_run" if args.dry_run else "",
                         {"model.tokenizer": args.tokenizer, **overrides_from_flags(extra)})
    result["predicted"], result["replay"] = predict(config, out / "run", hardware, args.plan_json, args.dry_run, extra)
    (out / "device_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = table(result)
    (out / "device_check.md").write_text(text)
    print(text, flush=True)
    failed = any(k.endswith("_error") for k in result) or (result.get("train") or {}).get("exit") not in (0, None)
    return 1 if failed else 0


def _gpu_hardware() -> str:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return "H200" if "H200" in name else "H100" if "H100" in name else ""


if __name__ == "__main__":
    sys.exit(main())
