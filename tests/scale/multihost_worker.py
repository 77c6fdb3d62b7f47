"""One of two localhost processes (4 simulated CPU devices each) joined by ``jax.distributed``.

Run by ``test_multihost.py`` with ``JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID``
set, exactly as ``launch/*.sh`` set them on real hosts. It trains the toy problem for two steps
on a global (2, 4) mesh, each host feeding only its own batch rows, saves a checkpoint from
both processes, and process 0 writes the losses, the host-summed metrics and the final params.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.parallel import distributed
from llds_jax.train.checkpoint import Checkpointer
from tests.scale import toy_train

STEPS = 2


def main(out_dir: str) -> None:
    setup = distributed.initialize()
    assert setup.source == "env", setup
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    mesh = toy_train.make_mesh((2, 4))
    data_sharding = NamedSharding(mesh, P(toy_train.MESH_AXES))
    rows = distributed.host_batch_rows(data_sharding, toy_train.BATCH)

    state = toy_train.init_state(0, mesh)
    step_fn = toy_train.jit_train_step(mesh)
    losses = []
    for step in range(STEPS):
        x, y = toy_train.batch(step)
        xg, yg = distributed.global_batch_from_host_rows((x[rows], y[rows]), data_sharding, toy_train.BATCH)
        state, loss = step_fn(state, xg, yg)
        losses.append(float(distributed.fetch_to_host(loss)))

    host_metrics = distributed.sum_over_hosts({"rows": rows.stop - rows.start, "hosts": 1.0,
                                               "big_count": 2**40 + jax.process_index()})
    with Checkpointer(Path(out_dir) / "run") as ckpt:
        ckpt.save(STEPS, state, {"rows_of_process_0": [rows.start, rows.stop]})
    params = distributed.fetch_to_host(state["params"])
    if distributed.is_main_process():
        np.savez(Path(out_dir) / "params.npz", **{k: np.asarray(v) for k, v in params.items()})
        (Path(out_dir) / "result.json").write_text(json.dumps(
            {"losses": losses, "host_metrics": host_metrics, "rows": [rows.start, rows.stop]}))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
