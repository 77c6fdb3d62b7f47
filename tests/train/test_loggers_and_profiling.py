"""train.loggers (one writer, several backends: the same keys and values as metrics.jsonl) and train.profile_steps.

W&B and MLflow are optional extras (``llds-jax[wandb]``, ``[mlflow]``), not in the ``test`` extra
(wandb's wheel alone is 20 MB, MLflow pulls OpenTelemetry and a web stack): their round trips run
for real where the package is importable and are skipped, saying so, where it is not.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from llds_jax.config import base_config
from llds_jax.train.loggers import backend_key, effective_loggers
from llds_jax.train.metrics import MetricsWriter, read_metrics
from llds_jax.train.profiling import StepProfiler, normalise_steps, trace_dir

pytestmark = pytest.mark.unit

ROWS = [  # (step, phase, metrics): rl and sft share step numbers and the key time/step_s
    (0, "sft", {"sft/loss": 2.5, "time/step_s": 0.25}),
    (0, "rl", {"reward/mean": 0.125, "loss/total": -0.5, "time/step_s": 1.5, "diag/ll_correct/all": float("nan")}),
    (1, "rl", {"reward/mean": 0.375, "loss/total": -0.25, "time/step_s": 1.25, "diag/ll_correct/all": -3.0}),
]
CONFIG = {"rl": {"llds_coef": 0.1, "advantage_estimator": "grpo"}, "train": {"loggers": ["mlflow"]}}


def jsonl_history(rows) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl rows as {backend key: [(step, value)]}, nulls left out (as every backend does)."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "phase", "wall_time") and value is not None:
                expected.setdefault(backend_key(row["phase"], key), []).append((row["step"], value))
    return expected


def write_rows(workdir: Path, loggers, settings=None) -> dict[str, list[tuple[int, float]]]:
    """Write ROWS through one MetricsWriter; return metrics.jsonl as :func:`jsonl_history`."""
    with MetricsWriter(workdir, console=None, loggers=loggers, settings=settings or {}, enabled=True) as writer:
        writer.log_config(CONFIG)
        for step, phase, metrics in ROWS:
            writer.write(step, metrics, phase=phase)
    return jsonl_history(read_metrics(workdir))


def mlflow_history(workdir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """The first MLflow run under ``<workdir>/mlruns``: {key: [(step, value)]} and its config.json artifact."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(workdir / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("llds_jax").experiment_id], order_by=["start_time ASC"])
    run = runs[0]
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    config = Path(client.download_artifacts(run.info.run_id, "config.json", str(workdir / "mlflow_download")))
    return history, json.loads(config.read_text())


def test_effective_loggers_read_the_one_switch_and_command_line_strings():
    train = base_config().train
    assert effective_loggers(train) == ("tensorboard",)
    train.loggers = ()
    assert effective_loggers(train) == ()
    flags = ml_collections.ConfigDict({"loggers": ("tensorboard,mlflow", "jsonl")})
    assert effective_loggers(flags) == ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match="comet"):
        effective_loggers(ml_collections.ConfigDict({"loggers": ("comet",)}))


def test_a_missing_backend_names_its_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name.startswith("mlflow"):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ImportError, match=r"llds-jax\[mlflow\]"):
        MetricsWriter(tmp_path, console=None, loggers=("mlflow",), enabled=True)


def test_mlflow_file_store_holds_the_jsonl_keys_and_values_and_the_config(tmp_path):
    pytest.importorskip("mlflow", reason="MLflow is the optional extra llds-jax[mlflow]")

    expected = write_rows(tmp_path, ("mlflow",))
    history, config = mlflow_history(tmp_path)
    assert history == {key: sorted(points) for key, points in expected.items()}
    assert config == CONFIG


def wandb_records(path: Path):
    """The records of a W&B transaction log (``run-*.wandb``: a 7-byte ``:W&B`` header, then LevelDB's
    log format — 32 KiB blocks of chunks with a 7-byte crc/length/type header), as raw protobuf bytes."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind in (3, 4):  # middle, last
            pending += chunk
        if kind in (1, 4):
            yield pending


@pytest.mark.integration
def test_wandb_offline_run_holds_the_jsonl_keys_and_values_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is the optional extra llds-jax[wandb]")
    monkeypatch.setenv("WANDB_SILENT", "true")
    expected = write_rows(tmp_path, ("wandb",), {"wandb_mode": "offline", "wandb_project": "test"})
    history, config = wandb_history(tmp_path)
    assert history == expected
    assert {k: config[k] for k in CONFIG} == CONFIG


def wandb_history(workdir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """The first offline W&B run under ``<workdir>/wandb``: {key: [(step, value)]} and its config."""
    from wandb.proto import wandb_internal_pb2

    log = sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb"))[0]
    history: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for data in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "config":
            config.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.config.update})
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        if not any(not key.startswith("_") for key in row):
            continue  # W&B's own bookkeeping row (_step, _runtime, _timestamp only)
        phase = next(key.split("/")[0] for key in row if key.endswith("/step"))
        for key, value in row.items():
            if not key.startswith("_") and not key.endswith("/step"):
                history.setdefault(key, []).append((row[f"{phase}/step"], value))
    return history, config


def test_profile_of_the_chosen_step_only(tmp_path):
    profiler = StepProfiler((1,), tmp_path)
    double = jax.jit(lambda x: (x * 2).sum())
    for step in range(3):
        profiler.begin(step)
        double(jnp.arange(8.0) + step).block_until_ready()
        profiler.end(step)
    assert list(trace_dir(tmp_path, 1).rglob("*.xplane.pb")), "no trace of step 1"
    assert not trace_dir(tmp_path, 0).exists() and not trace_dir(tmp_path, 2).exists()


@pytest.mark.parametrize("value, steps", [((), set()), ((1,), {1}), ((1, 2), {1, 2}), (1, {1}), ("1,2", {1, 2})])
def test_profile_steps_from_the_command_line_forms(value, steps):
    assert normalise_steps(value) == steps

