"""Per-step metrics: ``<workdir>/metrics.jsonl``, the ``train.loggers`` backends, and one console line.

``metrics.jsonl`` is the contract with ``llds_jax.diagnostics.report``: one JSON object per
line, flat ``/``-separated keys (every one listed in ``llds_jax.diagnostics.keys.TABLE``), plus
``step`` and ``phase`` (``sft``/``rl``/``eval``). Values are plain floats; NaN/inf are written
as ``null`` so the file stays strict JSON (a non-finite loss is itself reported by the
``update/skipped`` counter). The file is appended to, so a resumed run continues it.

The other backends (TensorBoard, W&B, MLflow: ``llds_jax.train.loggers``) receive the same rows.
On several hosts only process 0 writes (the metrics it is given are already combined over
hosts, ``llds_jax.train.loop.combine_over_hosts``); the others' writers are silent.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from llds_jax.diagnostics import keys
from llds_jax.train.loggers import open_loggers

# (key, short label, format) shown on the console, in this order, when present.
CONSOLE_KEYS = (
    (keys.LOSS_TOTAL, "loss", ".4f"),
    (keys.REWARD_MEAN, "reward", ".3f"),
    (keys.LLDS_VALUE, "llds", ".2e"),
    (keys.SEARCHES, "search", ".2f"),
    (keys.VALID_ACTION_RATE, "valid", ".2f"),
    (keys.POLICY_ENTROPY, "ent", ".3f"),
    (keys.GRAD_NORM, "gnorm", ".3f"),
    (keys.OPTIM_LR, "lr", ".1e"),
    ("time/rollout_s", "t_roll", ".1f"),
    ("time/logprobs_s", "t_lp", ".1f"),
    ("time/update_s", "t_upd", ".1f"),
    (keys.STEP_SECONDS, "t_step", ".1f"),
)


def to_float(value: Any) -> float | None:
    value = float(np.asarray(value))
    return value if math.isfinite(value) else None


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def console_line(step: int, phase: str, metrics: Mapping[str, float | None]) -> str:
    parts = [f"[{phase} {step:>4d}]"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label}={format(metrics[key], fmt)}")
    return " ".join(parts)


class MetricsWriter:
    """Writes every step to JSONL (always), the named logger backends and a console callback."""

    def __init__(self, workdir: str | Path, console=print, enabled: bool | None = None, loggers=(), settings=None):
        """``enabled=None``: write only on process 0 of a multi-host run (always on one host).

        ``loggers``: backend names (``loggers.effective_loggers(config.train)``, the one switch); ()
        = metrics.jsonl alone. ``settings``: what the backends read (``config.train``: W&B mode, MLflow URI).
        """
        if enabled is None:
            from llds_jax.parallel.distributed import is_main_process

            enabled = is_main_process()
        self.enabled = enabled
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1) if enabled else None
        self._console = console if enabled else None
        self._loggers = open_loggers(loggers, self.workdir, settings or {}) if enabled else []

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config, once, to every backend (``config.json`` in the workdir is the file's own copy)."""
        for logger in self._loggers:
            logger.log_config(config)

    def write(self, step: int, metrics: Mapping[str, Any], phase: str = "rl") -> dict[str, float | None]:
        flat = {k: to_float(v) for k, v in flatten(metrics).items()}
        record = {"step": int(step), "phase": phase, "wall_time": time.time(), **flat}
        if self._file is None:
            return flat
        self._file.write(json.dumps(record) + "\n")
        for logger in self._loggers:
            logger.log(int(step), phase, flat)
        if self._console is not None:
            self._console(console_line(int(step), phase, flat))
        return flat

    def rows_before(self, step: int, phase: str = "rl") -> list[dict]:
        """This workdir's recorded ``phase`` rows of the steps before ``step`` (what a resumed monitor replays).

        The last row of a step wins (a killed run may have logged steps past its checkpoint; those
        are redone and excluded here); [] when nothing is recorded yet.
        """
        from llds_jax.diagnostics.report import read_rows

        if not self.path.is_file():
            return []
        return [row for row in read_rows(self.path, phase) if row["step"] < step]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for logger in self._loggers:
            logger.close()
        self._loggers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
