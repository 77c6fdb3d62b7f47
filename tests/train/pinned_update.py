"""The pinned update numbers (``pinned_update.json``): how they are computed, and how to write them again.

``test_batch_record`` holds the update, the advantages, the log-prob passes and the SFT step to the
numbers in ``pinned_update.json``. When a change is *meant* to move them, record them again from
the repository root and commit the JSON with the change that moved them:

    PYTHONPATH=$PWD python tests/train/pinned_update.py --write

Only the quantities the update computes are pinned (:data:`PINNED_PREFIXES`): the loss terms,
LLDS, KL, ratio, gradient, entropy, lr and Δlog-prob metrics. A metric added to or dropped from the
update's dictionary leaves the file valid; a pinned metric that disappears fails the test by name.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # as tests/conftest.py
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_helpers import synthetic_rollout, tiny_train_config  # noqa: E402

from llds_jax.models.testing import tiny_model  # noqa: E402
from llds_jax.parallel.mesh import make_mesh  # noqa: E402
from llds_jax.parallel.placement import shard_model  # noqa: E402
from llds_jax.train.batch import TrainBatch  # noqa: E402
from llds_jax.train.learner import Learner  # noqa: E402

PATH = Path(__file__).with_name("pinned_update.json")
PINNED_PREFIXES = ("loss/", "llds/", "kl/", "ratio/", "grad/", "policy/", "optim/", "delta_logp/")
SFT_METRICS = ("sft/loss", "grad/norm_preclip", "optim/lr")
HOW = ("tests/train/pinned_update.py: tiny_train_config(), tiny_model('qwen2'), mesh (1, 1, 1); Learner.update on "
       "synthetic_rollout(seed=step) for steps 0, 1; SFTStep (sft.batch_size 4, max_seq_len 32, warmup_steps 2) on "
       "synthetic_rollout(seed=step, n=4) for steps 0..2")


def pinned_metric(name: str) -> bool:
    return name.startswith(PINNED_PREFIXES)


def learner(mesh_shape=(1, 1, 1), packing: bool = False) -> Learner:
    """``packing=False``: the padded path, which the pinned numbers are computed on."""
    config = tiny_train_config(packing=packing)
    config.mesh.shape = mesh_shape
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2"), mesh)
    return Learner.create(model, config, mesh)


def two_steps(run: Learner) -> list[tuple[dict, dict]]:
    """Two updates on fixed synthetic rollouts; each step's extras gain ``logp_now`` (π after the update)."""
    steps = []
    for step in range(2):
        metrics, extra = run.update(TrainBatch.from_arrays(synthetic_rollout(seed=step), length=run.seq_len))
        extra["logp_now"] = run.logprobs_now(extra["batch"])
        steps.append((metrics, extra))
    return steps


def sft_step():
    from llds_jax.train.sft import SFTStep  # noqa: PLC0415

    config = tiny_train_config()
    config.sft.update(dict(batch_size=4, max_seq_len=32, warmup_steps=2))
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2"), mesh)
    return SFTStep(model, config, mesh)


def sft_inputs(step: int) -> dict[str, np.ndarray]:
    arrays = synthetic_rollout(seed=step, n=4)
    return {k: arrays[k] for k in ("input_ids", "attention_mask", "action_mask")}


def update_record(steps: list[tuple[dict, dict]]) -> list[dict]:
    """The pinned part of :func:`two_steps`' output, as ``pinned_update.json["update"]`` holds it."""
    return [{"per_mini_batch": {k: np.asarray(v, np.float64).tolist()
                                for k, v in sorted(extra["per_mini_batch"].items()) if pinned_metric(k)},
             "advantages": np.asarray(extra["advantages"], np.float64).tolist(),
             "old_logp_row_sums": extra["old_logp"].sum(axis=1, dtype=np.float64).tolist(),
             "logp_now_row_sums": extra["logp_now"].sum(axis=1, dtype=np.float64).tolist()}
            for _, extra in steps]


def record() -> dict:
    """Compute every pinned number afresh (what ``--write`` stores)."""
    sft = sft_step()
    sft_metrics = [sft(sft_inputs(step)) for step in range(3)]
    return {"how": HOW, "update": update_record(two_steps(learner())),
            "sft": [{k: float(metrics[k]) for k in SFT_METRICS} for metrics in sft_metrics]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PATH.name} (default: print the JSON)")
    args = parser.parse_args()
    out = record()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    out["recorded_at"] = head.stdout.strip() or "unknown"  # provenance only: the test never reads it
    text = json.dumps(out, indent=1) + "\n"
    if args.write:
        PATH.write_text(text)
        print(f"wrote {PATH}")
    else:
        print(text)


if __name__ == "__main__":
    main()
