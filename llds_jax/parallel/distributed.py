"""Multi-host runs with plain ``jax.distributed`` (no Pathways): start-up, logging, data, metrics.

One Python process per host (TPU VM worker, SLURM task, or one process for a whole GPU node)
runs the same program. This module is what makes that program host-aware:

* ``initialize(config)`` joins the processes before any other JAX call. Where the settings
  come from, first match wins:
    1. ``config.distributed.{coordinator_address, num_processes, process_id}`` when set;
    2. ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID`` (what
       ``launch/*.sh`` export; the same names JAX itself reads);
    3. ``config.distributed.auto_detect`` or ``LLDS_DISTRIBUTED=auto`` (``launch/tpu_pod.sh``
       sets it: a TPU VM worker learns its peers from the metadata server, not from the
       environment), a SLURM allocation with more than one task, or a multi-worker Cloud TPU
       slice visible in the environment (``TPU_WORKER_HOSTNAMES``/``MEGASCALE_*``):
       ``jax.distributed.initialize()`` with no arguments, whose cluster detection derives
       everything from the scheduler;
    4. otherwise a single process, and nothing is initialised.
* ``is_main_process`` / ``main_process_only`` / ``quiet_non_main_processes``: only process 0
  logs, writes metrics and exports; the others stay quiet unless something is wrong.
* ``host_batch_rows(sharding, global_batch)``: the rows of the global batch whose devices
  live on this host. Each host samples trajectories and queries the retriever for exactly
  these rows; ``global_batch_from_host_rows`` then assembles the global array without any
  host ever holding the whole batch.
* ``fetch_to_host``: device metrics/params as numpy on every host (replicated ones for free).
* ``sum_over_hosts`` / ``gather_over_hosts`` / ``reduce_over_hosts``: host-side metrics (rollout
  counts, retriever latency) summed, stacked or combined per key across processes. Exact means
  come from summed numerators and counts when hosts hold different numbers of rows.
* ``gather_host_rows`` / ``local_rows``: a small per-row host array made global on every host
  (rewards for advantage statistics), and this host's rows of a row-sharded device array.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from llds_jax.errors import InputError

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_AUTO = "LLDS_DISTRIBUTED"
_TPU_POD_MARKERS = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "TPU_PROCESS_ADDRESSES")


class DistributedSetupError(InputError):
    """Inconsistent multi-host settings; the message names the field or variable and its value."""


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    """How this process joins the run. ``source`` says which rule of the module docstring applied."""

    source: str  # "config" | "env" | "auto" | "slurm" | "tpu_pod" | "single"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 300

    @property
    def multi_process(self) -> bool:
        return self.source != "single"


def default_distributed_config():
    """The ``distributed`` config section (unset = "", 0, -1, so each is overridable by flag)."""
    from ml_collections import ConfigDict  # noqa: PLC0415

    return ConfigDict({"coordinator_address": "", "num_processes": 0, "process_id": -1,
                       "auto_detect": False, "initialization_timeout": 300})


def _field(section: Any, name: str, default: Any = None) -> Any:
    # Defaults kept on purpose: ``initialize()`` runs with no config at all (multi-host workers,
    # tests/scale/multihost_rollout_worker.py) or a plain mapping, so the section may be absent.
    if section is None:
        return default
    if isinstance(section, Mapping):
        return section.get(name, default)
    return getattr(section, name, default)


def _int(value: Any, where: str) -> int:
    try:
        result = int(value)
    except (TypeError, ValueError) as err:
        raise DistributedSetupError(f"{where}={value!r} is not an integer") from err
    if isinstance(value, bool) or str(result) != str(value).strip():
        raise DistributedSetupError(f"{where}={value!r} is not an integer")
    return result


def detect_setup(config: Any = None, environ: Mapping[str, str] | None = None) -> ProcessSetup:
    """Decide how to join (pure: reads ``config.distributed`` and ``environ``, starts nothing)."""
    environ = os.environ if environ is None else environ
    section = _field(config, "distributed")
    timeout = _int(_field(section, "initialization_timeout", 300), "config.distributed.initialization_timeout")
    explicit = {k: _field(section, k) for k in ("coordinator_address", "num_processes", "process_id")}
    explicit["process_id"] = None if explicit["process_id"] == -1 else explicit["process_id"]
    explicit["num_processes"] = None if explicit["num_processes"] == 0 else explicit["num_processes"]
    if any(v not in (None, "") for v in explicit.values()):
        missing = [k for k, v in explicit.items() if v in (None, "")]
        if missing:
            raise DistributedSetupError(
                f"config.distributed sets {[k for k in explicit if k not in missing]} but not {missing}: "
                f"give all three (or none, to use the environment)")
        setup = ProcessSetup("config", str(explicit["coordinator_address"]),
                             _int(explicit["num_processes"], "config.distributed.num_processes"),
                             _int(explicit["process_id"], "config.distributed.process_id"), timeout)
    elif ENV_COORDINATOR in environ or ENV_NUM_PROCESSES in environ or ENV_PROCESS_ID in environ:
        missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in environ]
        if missing:
            raise DistributedSetupError(f"environment sets some of the JAX_* process variables but not {missing}")
        setup = ProcessSetup("env", environ[ENV_COORDINATOR],
                             _int(environ[ENV_NUM_PROCESSES], ENV_NUM_PROCESSES),
                             _int(environ[ENV_PROCESS_ID], ENV_PROCESS_ID), timeout)
    elif _field(section, "auto_detect", False) or environ.get(ENV_AUTO) == "auto":
        return ProcessSetup("auto", initialization_timeout=timeout)
    elif "SLURM_JOB_ID" in environ and _int(environ.get("SLURM_NTASKS", "1"), "SLURM_NTASKS") > 1:
        return ProcessSetup("slurm", initialization_timeout=timeout)
    elif any(environ.get(k) for k in _TPU_POD_MARKERS) and _tpu_worker_count(environ) > 1:
        return ProcessSetup("tpu_pod", initialization_timeout=timeout)
    else:
        return ProcessSetup("single")
    if setup.num_processes < 1 or not 0 <= setup.process_id < setup.num_processes:
        raise DistributedSetupError(
            f"process_id={setup.process_id} with num_processes={setup.num_processes} "
            f"(from {setup.source}): need 0 <= process_id < num_processes")
    if ":" not in setup.coordinator_address:
        raise DistributedSetupError(
            f"coordinator_address={setup.coordinator_address!r} (from {setup.source}): expected host:port")
    return setup


def _tpu_worker_count(environ: Mapping[str, str]) -> int:
    hostnames = environ.get("TPU_WORKER_HOSTNAMES") or environ.get("TPU_PROCESS_ADDRESSES")
    if hostnames:
        return len([h for h in hostnames.split(",") if h.strip()])
    return 2  # MEGASCALE_* only appears on multi-host / multi-slice jobs


def initialize(config: Any = None, environ: Mapping[str, str] | None = None) -> ProcessSetup:
    """Join the other processes (idempotent) and make non-main processes quiet.

    Must run before anything touches devices: JAX fixes the device set at first use.
    """
    setup = detect_setup(config, environ)
    if not setup.multi_process or jax.distributed.is_initialized():
        return setup
    log.info("joining %s run: %s", setup.source, setup)
    if setup.source in ("config", "env"):
        jax.distributed.initialize(coordinator_address=setup.coordinator_address,
                                   num_processes=setup.num_processes, process_id=setup.process_id,
                                   initialization_timeout=setup.initialization_timeout)
    else:  # auto / SLURM / TPU pod: JAX's cluster detection knows these schedulers
        jax.distributed.initialize(initialization_timeout=setup.initialization_timeout)
    quiet_non_main_processes()
    return setup


def shutdown() -> None:
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# --------------------------------------------------------------- who speaks
def is_main_process() -> bool:
    """Process 0 logs, writes metrics, exports HF weights."""
    return jax.process_index() == 0


def main_process_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``fn`` on process 0 only (returns None elsewhere). No collectives inside!"""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None
    return wrapper


def quiet_non_main_processes(level: int = logging.WARNING) -> None:
    """Raise the log threshold on processes other than 0 (absl and stdlib logging alike)."""
    if is_main_process():
        return
    logging.getLogger().setLevel(level)
    try:
        from absl import logging as absl_logging  # noqa: PLC0415

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:  # absl is a dependency, but logging setup must never crash a run
        pass


# ----------------------------------------------------------------- batches
def host_batch_rows(sharding: jax.sharding.Sharding, global_batch: int) -> slice:
    """The contiguous rows of a ``[global_batch, ...]`` array that this host's devices hold.

    The batch dimension of ``sharding`` decides it (e.g. ``P(("data", "fsdp"))``). Raises if
    the batch does not divide over the hosts or this host's rows are not one block (a mesh
    whose device order interleaves hosts — build it with ``jax.make_mesh``).
    """
    if global_batch % jax.process_count():
        raise DistributedSetupError(
            f"global batch {global_batch} does not divide over {jax.process_count()} processes")
    try:
        indices = sharding.addressable_devices_indices_map((global_batch,))
    except ValueError as err:
        raise DistributedSetupError(
            f"global batch {global_batch} does not divide over its sharding {sharding}: {err}") from err
    starts_stops = sorted({(idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
                           for idx in indices.values()})
    start, stop = starts_stops[0][0], starts_stops[-1][1]
    covered = sum(b - a for a, b in starts_stops)
    if covered != stop - start:
        raise DistributedSetupError(
            f"process {jax.process_index()} holds batch rows {starts_stops}, not one contiguous block")
    return slice(start, stop)


def global_batch_from_host_rows(host_rows: Any, sharding: Any, global_batch: int) -> Any:
    """Assemble global arrays from each host's rows (a pytree of numpy ``[rows, ...]`` arrays).

    ``sharding`` is one sharding for every leaf or a pytree of shardings shaped like ``host_rows``.
    """
    def assemble(local, leaf_sharding):
        local = np.asarray(local)
        shape = (global_batch, *local.shape[1:])
        return jax.make_array_from_process_local_data(leaf_sharding, local, shape)
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda local: assemble(local, sharding), host_rows)
    return jax.tree.map(assemble, host_rows, sharding)


def gather_host_rows(local: Any, rows: slice, global_batch: int) -> np.ndarray:
    """Every host's ``[rows, ...]`` block of a small host array, as the global ``[global_batch, ...]`` array.

    For per-trajectory scalars (rewards, group ids) that a host-local computation needs globally
    (advantage statistics). A collective: every host calls it with blocks of the same shape.
    Blocks are placed by each host's ``rows.start``, not by process index.
    """
    local = np.asarray(local)
    if local.shape[0] != rows.stop - rows.start:
        raise DistributedSetupError(f"host block has {local.shape[0]} rows, its slice {rows} needs "
                                    f"{rows.stop - rows.start}")
    if jax.process_count() == 1:
        if (rows.start, rows.stop) != (0, global_batch):
            raise DistributedSetupError(f"one process must hold all {global_batch} rows, got {rows}")
        return local
    from jax.experimental import multihost_utils  # noqa: PLC0415

    blocks = np.asarray(multihost_utils.process_allgather(local))
    starts = np.asarray(multihost_utils.process_allgather(np.array([rows.start], np.int32)))[:, 0]
    out = np.empty((global_batch, *local.shape[1:]), local.dtype)
    for start, block in zip(starts, blocks):
        out[start:start + block.shape[0]] = block
    return out


def local_rows(array: jax.Array, rows: slice) -> np.ndarray:
    """This host's ``rows`` of a row-sharded global array, from its addressable shards (no communication).

    The rows must be the ones ``host_batch_rows`` gave for the array's sharding.
    """
    if array.is_fully_addressable:
        return np.asarray(array)[rows]
    out = np.empty((rows.stop - rows.start, *array.shape[1:]), array.dtype)
    filled = np.zeros(rows.stop - rows.start, bool)
    for shard in array.addressable_shards:
        index = shard.index
        start = index[0].start or 0
        stop = array.shape[0] if index[0].stop is None else index[0].stop
        if start < rows.start or stop > rows.stop:
            raise DistributedSetupError(f"process {jax.process_index()} holds rows {start}:{stop} of an array, "
                                        f"outside its batch rows {rows}")
        out[(slice(start - rows.start, stop - rows.start), *index[1:])] = np.asarray(shard.data)
        filled[start - rows.start:stop - rows.start] = True
    if not filled.all():
        raise DistributedSetupError(f"process {jax.process_index()} lacks some of its rows {rows}")
    return out


# ----------------------------------------------------------------- metrics
def gather_over_hosts(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every host's value of each scalar metric, as float64 ``[num_processes]`` arrays.

    All hosts must call this with the same keys (it is a collective). The float64 values travel
    as pairs of uint32 words, because JAX (without x64) would round them to float32 and token
    counts of a large batch exceed float32's exact integers. Single process: no communication.
    """
    names = sorted(values)
    local = np.array([float(values[k]) for k in names], dtype=np.float64)
    if jax.process_count() == 1:
        stacked = local[None]
    else:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        words = multihost_utils.process_allgather(local.view(np.uint32))
        stacked = np.ascontiguousarray(np.asarray(words, dtype=np.uint32)).view(np.float64)
    return {k: stacked[:, i] for i, k in enumerate(names)}


def fetch_to_host(tree: Any) -> Any:
    """Numpy copy of global arrays on every host (the step's metrics, params for export).

    A replicated array (the step's scalar metrics) is read from a local shard with no
    communication; a sharded one is all-gathered, so every host must call this together.
    """
    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils  # noqa: PLC0415

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(fetch, tree)


def sum_over_hosts(values: Mapping[str, Any]) -> dict[str, float]:
    """Scalar host metrics summed over processes (numerators and counts, not means)."""
    return {k: float(v.sum()) for k, v in gather_over_hosts(values).items()}


_REDUCERS = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, in process order (a collective; any sizes)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    blocks = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(block[:size]).decode()) for block, size in zip(blocks, sizes)]


def reduce_over_hosts(values: Mapping[str, Any], how: Callable[[str], str]) -> dict[str, float]:
    """Scalar metrics combined over processes; ``how(key)`` is ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.

    A collective. Hosts may report different keys (a diagnostic with no rows on one host): each
    key is combined over the hosts that have it. A non-finite value on any host stays
    non-finite. Means are of per-host values: exact for per-row means when hosts hold equal row
    counts. Single process: the values unchanged (as floats).
    """
    if jax.process_count() == 1:
        return {k: float(v) for k, v in values.items()}
    # JSON has no NaN/inf in the strict sense, but Python's json round-trips them.
    per_host = allgather_json({k: float(v) for k, v in values.items()})
    keys = sorted(set().union(*per_host))
    return {k: float(_REDUCERS[how(k)](np.array([h[k] for h in per_host if k in h], np.float64)))
            for k in keys}
