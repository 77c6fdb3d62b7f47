"""Predicted beside measured: the step-time model replayed on a recorded device run.

A device check (``launch/device_check.sh``) writes ``device_check.json``: the phases its training job
measured (median of the steps after the first, which compiles), the chip, the job's config overrides
and every trajectory's lengths (``prompt``, ``actions``, ``feedback``) as the run sampled them. This
module predicts that same step — same config, same trajectories, same chip — with the *current*
model (``plan.step_time.predict_step_time``), so a recorded run keeps checking the model after the
model changes (``replay``; the device check's dry-run test pins replay = the check's own prediction).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from llds_jax.data.lengths import TrajectoryLengths

REPO = Path(__file__).resolve().parents[2]
# (row label, metrics.jsonl key, step-time key): the phases a device check measures and the model predicts.
PHASES = (
    ("rollout (all)", "time/rollout_s", "rollout"),
    ("  decode", "time/decode_s", "rollout_decode"),
    ("  prefill + appends", "time/prefill_s", "rollout_prefill"),
    ("  retrieval", "time/retrieval_s", "rollout_retrieval"),
    ("logprobs (π_old, π_ref)", "time/logprobs_s", "logprobs"),
    ("update", "time/update_s", "update"),
    ("Δ forward", "time/delta_logprobs_s", "delta"),
    ("whole step", "time/step_s", "total"),
)


def load_config(path: str, variant: str = "", overrides: dict | None = None):
    """``path``'s ``get_config(variant)`` with dotted ``overrides`` (``{"rollout.engine": "continuous"}``) set."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant) if variant else module.get_config()
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        section = config
        for name in parents:
            section = section[name]
        current = section[leaf]
        if isinstance(value, str) and not isinstance(current, str):  # a command line's text, typed as the field
            value = value in ("True", "true", "1") if isinstance(current, bool) else type(current)(value)
        section[leaf] = value
    return config


def overrides_from_flags(flags: list[str]) -> dict[str, str]:
    """``--config.a.b=v`` command-line flags as ``{"a.b": "v"}`` (what a replay sets again)."""
    out = {}
    for flag in flags:
        if flag.startswith("--config.") and "=" in flag:
            dotted, value = flag[len("--config."):].split("=", 1)
            out[dotted] = value
    return out


def lengths_json(lengths: list[TrajectoryLengths]) -> list[dict]:
    """Trajectories as JSON records (the run's own draw, so a replay predicts the same step)."""
    return [{k: v for k, v in dataclasses.asdict(t).items() if v is not None} for t in lengths]


def lengths_from_json(records: list[dict]) -> list[TrajectoryLengths]:
    return [TrajectoryLengths(int(r["prompt"]), tuple(r["actions"]), tuple(r["feedback"]),
                              None if r.get("searched") is None else tuple(r["searched"])) for r in records]


def predict_run(config, lengths: list[TrajectoryLengths], hardware: str, label: str, cpu_peak: dict | None = None):
    """The step-time model for one device's run of ``config`` on ``hardware`` (a ``flops.PEAKS`` row;
    anything else: a CPU, at ``cpu_peak`` — ``{"flops", "bytes_per_s", "source"}`` as the run measured
    it — or this one's), from the run's own trajectories, with the job's packed rows when it packs
    (one device: one data shard) and the chip's memory for the engine's paged plan."""
    from llds_jax.models.loading import decoder_config  # noqa: PLC0415
    from llds_jax.plan.config import HARDWARE  # noqa: PLC0415
    from llds_jax.plan.step_time import predict_step_time  # noqa: PLC0415
    from llds_jax.train.batch import padded_length  # noqa: PLC0415
    from llds_jax.train.packing import packing_sizes  # noqa: PLC0415
    from llds_jax.train.step_settings import StepSizes  # noqa: PLC0415
    from llds_jax.utils import flops  # noqa: PLC0415

    platform = "gpu" if hardware in ("H100", "H200") else "cpu"
    model_cfg = decoder_config(config.model, platform)
    if hardware in flops.PEAKS:
        name, peak_flops, bandwidth = flops.PEAKS[hardware]
        peak = flops.Peak(peak_flops, bandwidth, name)
    elif cpu_peak:
        peak = flops.Peak(float(cpu_peak["flops"]), float(cpu_peak["bytes_per_s"]), str(cpu_peak["source"]))
    else:
        peak = flops.cpu_peak()
    trajectories = int(config.train.prompts_per_step) * int(config.rollout.n_samples)
    length, scored = padded_length(config), StepSizes.from_config(config).scored_positions
    packing = packing_sizes(config, length, scored, 1) if config.train.packing else None
    return predict_step_time(
        config, model_cfg, platform=platform, peak=peak, devices=1, hosts=1,
        rows_per_wave=trajectories, train_rows=trajectories, train_length=length, scored_per_row=scored,
        state_bytes=16 * flops.parameters(model_cfg), lengths=lengths, length_label=label, packing=packing,
        device_bytes=HARDWARE[hardware][1] if hardware in HARDWARE else None,
        hardware=hardware if hardware in HARDWARE else "")


def ratios(measured: dict, predicted: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    """(phase, measured s, predicted s, measured / predicted) for every phase of :data:`PHASES`."""
    rows = []
    for label, key, step_key in PHASES:
        m, p = measured.get(key), predicted.get(step_key)
        rows.append((label, m, p, m / p if m is not None and p else None))
    return rows


def replay(path: str | Path, overrides: dict | None = None) -> dict:
    """A stored ``device_check.json`` predicted again by today's model: ``{"device", "commit", "rows"}``
    (``overrides``: fields to set besides the run's own, e.g. a tokenizer a tiny model is sized by)."""
    run = json.loads(Path(path).read_text())
    record = run["replay"]
    config = load_config(record["config"], record.get("variant", ""), {**record.get("overrides", {}), **(overrides or {})})
    step = predict_run(config, lengths_from_json(record["lengths"]), record["hardware"],
                       f"the run's own samples ({len(record['lengths'])} trajectories, stored)", record.get("cpu_peak"))
    return {"device": run.get("device"), "commit": run.get("commit"),
            "rows": ratios(run["measured"]["median_after_first"], step.seconds)}


def format_replay(result: dict) -> str:
    def fmt(x):
        return "—" if x is None else f"{x:.2f}"

    lines = [f"{result['device']} at {result['commit']}: measured vs today's model",
             f"  {'phase':<26}{'measured s':>12}{'predicted s':>13}{'ratio':>8}"]
    lines += [f"  {label:<26}{fmt(m):>12}{fmt(p):>13}{fmt(r):>8}" for label, m, p, r in result["rows"]]
    return "\n".join(lines)
