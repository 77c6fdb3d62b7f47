"""The trainer's real update step in two localhost processes (4 simulated CPU devices each).

Run by ``test_multihost.py`` with the ``JAX_*`` process variables set, exactly as the launch
scripts set them. Each process builds the same tiny Decoder and ``Learner`` on the global
(2, 4, 1) mesh and calls ``Learner.update`` with only its own rows of the rollout batch
(``Learner.host_rows``): the learner assembles the global batch, computes advantages over the
global groups, runs π_old, π_ref and the sequential mini-batch AdamW updates, and hands back
this host's rows. The decoder passes read packed rows (``train.packing``): each host plans the
whole batch from the all-gathered lengths and a jitted scatter fills rows spanning both hosts.
Then ``Learner.logprobs_now`` (log π after the update) on the same rows.
Each process writes its rows' arrays (``host_<pid>.npz``); process 0 also writes the
per-mini-batch metrics and the updated params.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

from llds_jax.parallel import distributed
from llds_jax.train.batch import TrainBatch
from tests.scale.test_resume_trainer_state import learner_on, rollout

MESH = (2, 4, 1)


def main(out_dir: str) -> None:
    distributed.initialize()
    assert (jax.process_count(), jax.device_count()) == (2, 8)
    learner = learner_on(MESH)
    rows = learner.host_rows()
    local = {k: v[rows] for k, v in rollout(seed=0).items()}  # group ids stay global: rows are prompt-major
    _, extra = learner.update(TrainBatch.from_arrays(local, length=learner.seq_len))
    logp_now = learner.logprobs_now(extra["batch"])
    # The Δ pass over the responses with A ≠ 0 only: every other row's advantage zeroed, across both hosts.
    advantages = extra["advantages"].copy()
    advantages[::2] = 0.0
    sums, _ = learner.step_reductions(extra["batch"], np.zeros((len(advantages), 2), np.float32), 2,
                                      with_delta=True, advantages=advantages)
    params = distributed.fetch_to_host(jax.tree.leaves(learner.state.params))
    packed = extra["batch"].packed
    assert packed is not None and learner.packing is not None, "two hosts must pack too"
    mini_count = distributed.fetch_to_host(packed.mini_count)
    pass_count = distributed.fetch_to_host(extra["batch"].packed_passes.mini_count)
    out = Path(out_dir)
    np.savez(out / f"host_{jax.process_index()}.npz", rows=np.array([rows.start, rows.stop]),
             advantages=extra["advantages"], old_logp=extra["old_logp"], logp_now=logp_now,
             mini_count=mini_count, pass_count=pass_count, delta_sums=sums["delta_logp"], compiles=np.array(sorted(learner.compile_counts().values())))
    if distributed.is_main_process():
        np.savez(out / "metrics.npz", **extra["per_mini_batch"])
        np.savez(out / "params.npz", *params)
        (out / "rows.txt").write_text(f"{rows.start} {rows.stop}")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
