"""Where the sampler runs: its rows spread over every local device, each device a full policy copy.

Why data-parallel replicas and not the host's own tensor-parallel sub-mesh: a decode step is
bound by reading the weights and the KV cache, and every Search-R1 policy we train (0.5B-7B)
fits one chip's memory in its compute dtype with room for KV (``rollout/kv_plan.py``), so
replicas read weights at every chip's full bandwidth with no collective per token; a
tensor-parallel sampler would all-reduce every layer of every token. A model too large
for one chip would need the sub-mesh; that is not built.

Getting the weights there never goes through host memory. Within one process
``jax.device_put`` copies device to device. With several processes the trainer's params
span all hosts: a jitted identity with a replicated output sharding all-gathers them over
the interconnect (a collective: every host calls it together), and each host then wraps
its own devices' copies as one array on its local mesh.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.parallel.mesh import make_mesh

ROW_AXES = ("data", "fsdp")  # the mesh axes the logical "batch" axis maps to (parallel/rules.py)


def sampler_devices(requested: int) -> list[jax.Device]:
    """``rollout.sampler_devices``: -1 = every local device, n = the first n, 0 = auto: every local
    device when several processes share the job (the params are not this host's alone, so they
    are replicated to its devices anyway), else one (the learner's arrays as they are)."""
    local = jax.local_devices()
    if requested == 0:
        return local if jax.process_count() > 1 else local[:1]
    if requested < 0:
        return local
    if requested > len(local):
        raise ValueError(f"rollout.sampler_devices={requested}, but this process has {len(local)} local devices")
    return local[:requested]


def sampler_mesh(devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """A ``(data, fsdp, tensor) = (len(devices), 1, 1)`` mesh: rows split over ``data``, weights replicated."""
    return make_mesh((len(devices), 1, 1), list(devices))


def row_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(ROW_AXES))


def on_mesh(mesh: jax.sharding.Mesh | None):
    """The model's logical sharding constraints resolve against ``mesh`` (nothing to do without one)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def replicate_params(params, mesh: jax.sharding.Mesh):
    """``params`` fully replicated on every device of the (process-local) ``mesh``, device to device.

    Leaves already placed so are returned as they are. Leaves spread over other processes'
    devices are all-gathered on device first, in one program (every process must call this
    together).
    """
    target = NamedSharding(mesh, P())
    leaves, treedef = jax.tree.flatten(params)
    remote = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if remote:
        everywhere = tuple(NamedSharding(leaves[i].sharding.mesh, P()) for i in remote)
        gathered = _all_gather(everywhere)(*(leaves[i] for i in remote))
        for i, x in zip(remote, gathered):
            copies = {shard.device: shard.data for shard in x.addressable_shards}
            leaves[i] = jax.make_array_from_single_device_arrays(x.shape, target,
                                                                 [copies[d] for d in mesh.devices.flat])
    leaves = [jax.device_put(x, target) if isinstance(x, jax.Array) and x.sharding != target else x for x in leaves]
    return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=8)
def _all_gather(shardings: tuple[NamedSharding, ...]):
    """One jitted identity per set of output shardings (compiled once per run, not per step)."""
    return jax.jit(lambda *leaves: leaves, out_shardings=shardings)
