"""Where a step's metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``metrics.jsonl`` is always written (``MetricsWriter``): it is the contract the report and the
monitor read. ``train.loggers`` names any further backends (``"jsonl"`` may be listed too; it is
the file that is always there). Every backend receives exactly the rows the file gets, under the
key ``<phase>/<metrics.jsonl key>`` (the phase keeps ``rl`` and ``sft`` steps, which both start
at 0, apart: ``time/step_s`` is logged in both), with ``null`` values left out, and the run's
config once at the start. Peers' users already watch W&B (about ten of them) or MLflow; the
packages are optional extras (``pip install llds-jax[wandb]`` / ``[mlflow]``), imported only
when named, so a run that does not name them never needs them.

* ``tensorboard``: tensorboardX event files in ``<workdir>/tensorboard`` (on by default; leaving
  it out of ``train.loggers`` is the one way to turn it off).
* ``wandb``: ``wandb.init(mode=train.wandb_mode)``, offline by default (no account, no network;
  ``wandb sync <workdir>/wandb/offline-run-*`` uploads later); W&B's own step counter advances per
  row and ``<phase>/step`` carries ours.
* ``mlflow``: an ``MlflowClient`` on ``train.mlflow_tracking_uri``, by default the file store
  ``<workdir>/mlruns`` (``mlflow ui --backend-store-uri <workdir>/mlruns``); the config is the
  run's ``config.json`` artifact.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from llds_jax.rl.registry import Registry

LOGGERS: Registry = Registry("metrics logger")


class Logger(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log(self, step: int, phase: str, flat: Mapping[str, float | None]) -> None: ...

    def close(self) -> None: ...


def backend_key(phase: str, key: str) -> str:
    """The name a backend gives ``metrics.jsonl``'s ``key`` of a ``phase`` row (TensorBoard's tag too)."""
    return f"{phase}/{key}"


def _present(flat: Mapping[str, float | None]):
    return ((key, value) for key, value in flat.items() if value is not None)


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    def __init__(self, workdir: Path, settings: Mapping[str, Any]):
        from tensorboardX import SummaryWriter

        del settings
        self._writer = SummaryWriter(str(workdir / "tensorboard"))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, phase: str, flat: Mapping[str, float | None]) -> None:
        for key, value in _present(flat):
            self._writer.add_scalar(backend_key(phase, key), value, step)

    def close(self) -> None:
        self._writer.close()


@LOGGERS.register("wandb")
class WandbLogger:
    def __init__(self, workdir: Path, settings: Mapping[str, Any]):
        import wandb

        self._run = wandb.init(project=settings["wandb_project"], dir=str(workdir),
                               mode=settings["wandb_mode"], name=workdir.name, reinit=True)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log(self, step: int, phase: str, flat: Mapping[str, float | None]) -> None:
        row = {backend_key(phase, key): value for key, value in _present(flat)}
        self._run.log({**row, backend_key(phase, "step"): step})

    def close(self) -> None:
        self._run.finish()


@LOGGERS.register("mlflow")
class MlflowLogger:
    def __init__(self, workdir: Path, settings: Mapping[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = settings.get("mlflow_tracking_uri") or (workdir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked for it by name
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        name = settings.get("mlflow_experiment") or "llds_jax"
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        self._run_id = self._client.create_run(experiment_id, run_name=workdir.name).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._client.log_text(self._run_id, json.dumps(config, indent=1, default=str), "config.json")

    def log(self, step: int, phase: str, flat: Mapping[str, float | None]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(backend_key(phase, key), value, stamp, step) for key, value in _present(flat)]
        for start in range(0, len(metrics), 1000):  # MLflow's log_batch limit
            self._client.log_batch(self._run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def effective_loggers(train_config) -> tuple[str, ...]:
    """``train.loggers`` less ``"jsonl"`` (always written), each name checked against the registry."""
    names = train_config.loggers
    names = (names,) if isinstance(names, str) else tuple(names)
    # --config.train.loggers=tensorboard,mlflow arrives as the one string "tensorboard,mlflow".
    names = tuple(part.strip() for name in names for part in str(name).split(",") if part.strip())
    for name in names:
        if name != "jsonl" and name not in LOGGERS:
            raise ValueError(f"train.loggers names {name!r}; known: jsonl, {', '.join(LOGGERS.names())}")
    return tuple(dict.fromkeys(n for n in names if n != "jsonl"))


def open_loggers(names, workdir: Path, settings: Mapping[str, Any]) -> list[Logger]:
    """The named backends (each imports its package only here; a missing one fails naming its extra)."""
    out = []
    for name in names:
        try:
            out.append(LOGGERS.get(name)(workdir, settings))
        except ImportError as err:
            raise ImportError(f"train.loggers names {name!r}, which needs `pip install llds-jax[{name}]`: {err}") from err
    return out
