"""One of two localhost processes (4 simulated CPU devices each) sampling with the continuous engine.

Run by ``test_multihost_rollout.py``. The policy's params are laid out as the trainer holds
them, sharded over all 8 devices of both processes. Each process then does what
``Learner.sampler_policy`` does with several hosts — replicas on every local device, device to
device, under a transfer guard that fails on any device-to-host copy — and rolls out its own
questions with the engine over its 4 devices, counting every byte the rollout fetches to the
host. Its batch must equal the same rollout on one local device. Each process writes a JSON
report.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.models.testing import tiny_model
from llds_jax.parallel import distributed
from llds_jax.parallel.mesh import make_mesh
from llds_jax.retrieval import Hit
from llds_jax.rollout import run_rollouts
from llds_jax.sampling import placement
from tests.rollout.test_rollout_waves import (
    QUESTIONS,
    WORDS,
    differences,
    tag_vocabulary_tokenizer,
    wave_config,
)


class WordRetriever:
    """Deterministic hits made of the query's own words (no index needed in a worker)."""

    def search(self, queries, topk):
        return [[Hit(id=f"{q}-{k}", contents=f'"{q}"\nparis capital france {k}', score=1.0) for k in range(topk)]
                for q in queries]


class FetchCounter:
    """Wraps ``jax.device_get`` and sums the bytes it brings to the host."""

    def __init__(self):
        self.bytes = 0
        self.original = jax.device_get

    def __call__(self, tree):
        out = self.original(tree)
        self.bytes += sum(np.asarray(x).nbytes for x in jax.tree.leaves(out))
        return out


def main(out_dir: str) -> None:
    distributed.initialize()
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    pid = jax.process_index()
    tokenizer = tag_vocabulary_tokenizer()
    graphdef, local_params = nnx.split(tiny_model("qwen2", seed=0, vocab_size=len(WORDS)))
    mesh = make_mesh((1, -1, 1))  # the trainer's layout: fsdp over both processes' devices

    def spread(x):
        host = np.asarray(x)
        spec = P("fsdp") if host.ndim and host.shape[0] % 8 == 0 else P()
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])

    params = jax.tree.map(spread, local_params)
    remote = sum(not x.is_fully_addressable for x in jax.tree.leaves(params))
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    devices = placement.sampler_devices(0)  # several processes: every local device
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        replica = placement.replicate_params(params, placement.sampler_mesh(devices))
    on_devices = sorted({d.id for x in jax.tree.leaves(replica) for d in x.devices()})

    questions = list(QUESTIONS[pid::2])
    counter = FetchCounter()
    jax.device_get = counter
    try:
        batch = run_rollouts((graphdef, replica), tokenizer, questions, WordRetriever(),
                             wave_config(0, engine="continuous"), key=jax.random.key(7))
    finally:
        jax.device_get = counter.original
    single = run_rollouts((graphdef, jax.device_put(local_params, devices[0])), tokenizer, questions, WordRetriever(),
                          wave_config(0, engine="continuous", sampler_devices=1), key=jax.random.key(7))
    report = dict(process=pid, remote_leaves=remote, param_bytes=param_bytes, replica_devices=on_devices,
                  local_devices=[d.id for d in devices], sampler_devices=batch.timings["sampler_devices"],
                  rows_per_device=batch.timings["rows_per_device"],
                  busy_rows_per_device=batch.timings["busy_rows_per_device"],
                  fetched_bytes=counter.bytes, decode_calls=batch.timings["decode_calls"],
                  differences=differences(single, batch), trajectories=batch.size,
                  searches=int(batch.searches.sum()))
    Path(out_dir, f"rollout_{pid}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
