"""Command-line entry point: ``python -m llds_jax.main --config=configs/x.py --mode=train``.

Each mode lives in the package that owns it; this file only parses flags and
dispatches, importing the mode lazily so ``--mode=serve`` never imports the trainer.

Exit status, for scripts and launchers that chain commands: 0 on success, whatever a mode
returns to its Python callers (a path, a summary) is *not* passed to ``sys.exit`` (absl
would print it and exit 1); 2 with one ``error:`` line for input the user can fix (a bad
config value, a missing or malformed file); 1 with a traceback for anything else. A mode
that ends a run on purpose with a status of its own (the non-finite streak) raises
``SystemExit`` itself.
"""

from __future__ import annotations

import importlib
import sys

from absl import app, flags
from ml_collections import config_flags

from llds_jax.errors import InputError

MODES = {
    "train": "llds_jax.app.run:train_main",
    "sft": "llds_jax.app.run:sft_main",
    "eval": "llds_jax.eval.run:eval_main",
    "serve": "llds_jax.retrieval.cli:serve_main",
    "index": "llds_jax.retrieval.cli:index_main",
    "report": "llds_jax.diagnostics.report:report_main",
    "plan": "llds_jax.plan.run:plan_main",
    "sweep": "llds_jax.app.sweep:sweep_main",
    "probe": "llds_jax.lab.probe:probe_main",  # per-sample LLD probe on a run's checkpoints (issue 43)
    "replay": "llds_jax.rollout.feedback_replay:replay_main",  # a run's searches asked of another retriever
}

EXIT_USER_ERROR = 2

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_smoke.py", "ml_collections config file.")
_MODE = flags.DEFINE_enum("mode", "train", sorted(MODES), "What to run.")


def resolve_mode(name: str):
    module_name, func_name = MODES[name].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
    try:
        config = _CONFIG.value
        if "lab" in config:  # the death-spiral lab builds its world, tokenizer and policy first
            from llds_jax.lab.prepare import prepare

            config = prepare(config)
        resolve_mode(_MODE.value)(config)
    except (InputError, FileNotFoundError) as error:
        print(f"error: --mode={_MODE.value}: {error}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    app.run(main)
