"""The trainer's real update step in two localhost processes (4 simulated CPU devices each).

Run by ``test_multihost.py`` with the ``JAX_*`` process variables set, exactly as the launch
scripts set them. Each process builds the same tiny Decoder and ``Learner`` on the global
(2, 4, 1) mesh and feeds only its own rows of the rollout batch (``host_batch_rows``); the
step is π_old, π_ref and the sequential mini-batch AdamW updates (``build_update_fns``).
Process 0 writes the per-mini-batch metrics and the updated params.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

from llds_jax.parallel import distributed
from llds_jax.train.learner import pad_columns
from llds_jax.train.step import TrainBatch
from tests.scale.test_resume_trainer_state import learner_on, rollout

MESH = (2, 4, 1)


def host_batch(learner) -> TrainBatch:
    """rollout(seed=0) as the padded numpy TrainBatch the learner uploads (π_old/π_ref still None)."""
    arrays = rollout(seed=0)
    advantages = learner.advantages(arrays["rewards"], arrays["group_ids"])
    length = learner.seq_len
    return TrainBatch(
        input_ids=pad_columns(arrays["input_ids"].astype(np.int32), length, 0),
        attention_mask=pad_columns(arrays["attention_mask"].astype(bool), length, False),
        action_mask=pad_columns(arrays["action_mask"].astype(np.float32), length, 0.0),
        answer_mask=pad_columns(arrays["answer_mask"].astype(np.float32), length, 0.0),
        action_index=pad_columns(arrays["action_index"].astype(np.int32), length, -1),
        num_searches=np.asarray(arrays["num_searches"], np.float32),
        row_weight=np.ones(len(advantages), np.float32), advantages=np.asarray(advantages, np.float32))


def run_update(learner, batch: TrainBatch):
    """One training step's update phase; (per-mini-batch metrics, params) as numpy on every host."""
    with jax.set_mesh(learner.mesh):
        old = learner.fns.policy_logprobs(learner.state.params, batch.input_ids, batch.attention_mask)
        ref = learner.fns.reference_logprobs(learner.state.ref_params, batch.input_ids, batch.attention_mask)
        state, per_mini = learner.fns.update(learner.state, batch._replace(old_logp=old, ref_logp=ref))
    return distributed.fetch_to_host(per_mini), distributed.fetch_to_host(jax.tree.leaves(state.params))


def main(out_dir: str) -> None:
    distributed.initialize()
    assert (jax.process_count(), jax.device_count()) == (2, 8)
    learner = learner_on(MESH)
    full = host_batch(learner)
    rows_total = full.input_ids.shape[0]
    shardings = learner.batch_shardings._replace(old_logp=None, ref_logp=None)
    rows = distributed.host_batch_rows(shardings.input_ids, rows_total)
    batch = distributed.global_batch_from_host_rows(jax.tree.map(lambda x: x[rows], full), shardings, rows_total)
    metrics, params = run_update(learner, batch)
    if distributed.is_main_process():
        np.savez(Path(out_dir) / "metrics.npz", **metrics)
        np.savez(Path(out_dir) / "params.npz", *params)
        (Path(out_dir) / "rows.txt").write_text(f"{rows.start} {rows.stop}")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
