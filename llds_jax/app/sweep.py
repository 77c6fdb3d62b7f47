"""``--mode=sweep``: expand a grid of config overrides into runs, validate each, print or launch them.

A sweep config has the usual sections (ignored here) plus::

    sweep.base_config = "configs/qwen3b.py"            # the config file every run starts from
    sweep.grid = (("rl.llds_coef", (0.0, 0.01, 0.1)),   # (dotted override, values) pairs
                  ("rl.llds_gate", ("action", "response")))
    sweep.workdir_root = "runs/sweep_llds"              # run i writes <root>/<name of its overrides>
    sweep.arms = (("grpo", (("rl.llds_coef", 0.0),)),   # optional: named override sets, each crossed
                  ("tis", (("rl.rollout_correction", "tis"),)))  # with the grid; run dir <arm>+<grid name>
    sweep.launch = False                                # True: run them one after another here
    sweep.num_devices = 0                               # validate for this many devices (0 = this host's)

Every grid point is resolved and validated with ``llds_jax.config.validate`` (every section,
including ``rl`` and ``retrieval``) *before* any run starts, so a bad combination (sizes that do
not divide, an unknown ``rl.llds_gate``) fails naming the run and the field, and
``python -m llds_jax.main --mode=sweep`` exits 2 (tested in ``tests/test_cli_modes.py``). Printed
commands are plain ``python -m llds_jax.main`` lines: paste them into a cluster's job script
(one run per job) or let ``launch=True`` run them sequentially on this machine.
"""

from __future__ import annotations

import importlib.util
import itertools
import shlex
import subprocess
import sys
from pathlib import Path

from llds_jax.config import TrainConfigError, validate


def expand_grid(grid) -> list[dict]:
    """Cartesian product of ``(key, values)`` pairs, in order (last key varies fastest).

    Pairs rather than a dict: ConfigDict refuses dotted keys.
    """
    grid = dict(grid)
    if not grid:
        return [{}]
    keys = list(grid)
    for key in keys:
        values = grid[key]
        if isinstance(values, str) or not hasattr(values, "__iter__") or not list(values):
            raise TrainConfigError(f"sweep.grid[{key!r}]={values!r} must be a non-empty list of values")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(list(grid[k]) for k in keys))]


def run_name(overrides: dict) -> str:
    """``llds_coef=0.1+seed=2``: '+', not ',', so run directories can be listed in ``report.compare``."""
    return "+".join(f"{key.split('.')[-1]}={value}" for key, value in overrides.items()) or "base"


def load_config_file(path: str):
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"sweep.base_config={path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"sweep_base_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def resolve_run(base_config_path: str, overrides: dict, workdir: str, num_devices: int | None = None):
    """The run's full config; fails naming the run when an override path does not exist or validation fails."""
    config = load_config_file(base_config_path)
    for key, value in {**overrides, "workdir": workdir}.items():
        parent, _, leaf = key.rpartition(".")
        section = config
        for part in filter(None, parent.split(".")):
            if part not in section:
                raise TrainConfigError(f"sweep run {run_name(overrides)!r}: no config section {part!r} in {key!r}")
            section = section[part]
        if leaf not in section:
            raise TrainConfigError(f"sweep run {run_name(overrides)!r}: unknown config field {key!r}")
        section[leaf] = value
    try:
        validate(config, num_devices)
    except (TrainConfigError, ValueError) as err:
        raise TrainConfigError(f"sweep run {run_name(overrides)!r}: {err}") from err
    return config


def command(base_config_path: str, overrides: dict, workdir: str, mode: str = "train") -> list[str]:
    args = [sys.executable, "-m", "llds_jax.main", f"--mode={mode}", f"--config={base_config_path}"]
    args += [f"--config.{key}={_flag_value(value)}" for key, value in overrides.items()]
    args.append(f"--config.workdir={workdir}")
    return args


def _flag_value(value) -> str:
    if isinstance(value, tuple | list):
        return "(" + ",".join(_flag_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def plan(config) -> list[tuple[str, list[str]]]:
    section = config.sweep
    runs = []
    arms = section.get("arms") or (("", ()),)  # arms: methods that differ in several fields at once
    for arm, arm_overrides in arms:
        for point in expand_grid(section.grid):
            overrides = {**dict(arm_overrides), **point}
            name = "+".join(filter(None, (arm, point and run_name(point)))) or "base"  # an arm alone: its name
            workdir = str(Path(section.workdir_root) / name)
            resolve_run(section.base_config, overrides, workdir, section.get("num_devices") or None)
            runs.append((name, command(section.base_config, overrides, workdir)))
    return runs


def sweep_main(config) -> None:
    run_sweep(config)


def run_sweep(config) -> list[tuple[str, list[str]]]:
    if "sweep" not in config:
        raise TrainConfigError("--mode=sweep needs a config with a `sweep` section (see configs/sweep_llds.py)")
    runs = plan(config)
    print(f"sweep over {config.sweep.base_config}: {len(runs)} runs, all configs valid")
    for name, args in runs:
        print(f"  [{name}]\n    {shlex.join(args)}")
    if not config.sweep.launch:
        print("(print only: set --config.sweep.launch=True to run them one after another here)")
        return runs
    for index, (name, args) in enumerate(runs, start=1):
        print(f"=== sweep run {index}/{len(runs)}: {name}", flush=True)
        result = subprocess.run(args, check=False)
        if result.returncode != 0:
            raise SystemExit(f"sweep run {name!r} failed with exit code {result.returncode}")
    return runs
