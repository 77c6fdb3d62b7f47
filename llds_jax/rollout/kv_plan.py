"""The rollout's one memory plan: slots and KV blocks per device for the engine, under either policy.

The engine's KV follows each trajectory's length: a pool of blocks of ``rollout.kv_block_tokens``
tokens, taken as trajectories grow (``scheduler.py``). Its slot count is sized vLLM's way — for an
expected length, with preemption by recompute as the valve when the pool runs short (the bytes:
``memory.py``)::

    free      = memory_fraction x device_bytes - weight_bytes
    prefill   = prefill_rows x row_bytes["prefill"]    (an append runs at most prefill_rows rows a call)
    per slot  = row_bytes["decode"] + blocks(slot_tokens) x block_bytes
    slots     = min(trajectories per device, (free - prefill) // per slot)
    kv_blocks = (free - prefill - slots x row_bytes["decode"]) // block_bytes

The continuous policy sizes a slot for ``rollout.slot_tokens`` (default 512; Search-R1's 3B policy
averages 708 tokens at the end of a trajectory and about half that over its life). The waves
policy sizes it for a whole ``max_context`` (:func:`rollout_rows_per_wave`: a wave's rows, each
with every block it could need, so nothing is preempted), like vLLM's ``gpu_memory_utilization``.
The numbers are per device; the planner compiles the real programs against them.
"""

from __future__ import annotations

import dataclasses
import logging

from llds_jax.rollout.memory import (
    RolloutMemoryError,
    data_devices_of_ambient_mesh,
    device_memory_bytes,
    kv_bytes_per_slot,
    rollout_row_bytes,
    weight_bytes,
)
from llds_jax.rollout.scheduler import blocks_for
from llds_jax.sampling.slots import bucket, cache_slot_limit

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """One device's share of the engine: decode slots, the KV pool and the bytes behind them."""

    slots_per_device: int
    kv_blocks_per_device: int
    block_tokens: int
    block_bytes: int
    free_bytes: int
    prefill_bytes: int

    @property
    def kv_tokens_per_device(self) -> int:
        return self.kv_blocks_per_device * self.block_tokens


def engine_memory(model_config, rollout_config, device_bytes: int, trajectories_per_device: int, *,
                  slot_tokens: int | None = None) -> EngineMemory:
    """Slots and KV blocks one device holds (see the module docstring), a slot sized for
    ``slot_tokens`` (default ``rollout.slot_tokens``); raises :class:`RolloutMemoryError` when not
    one trajectory of ``max_context`` fits."""
    fraction = float(rollout_config.memory_fraction)
    if not 0.0 < fraction <= 1.0:
        raise RolloutMemoryError(f"rollout.memory_fraction={fraction}: expected a fraction in (0, 1]")
    block = int(rollout_config.kv_block_tokens)
    slot_tokens = int(rollout_config.slot_tokens) if slot_tokens is None else int(slot_tokens)
    prefill_rows = int(rollout_config.prefill_rows)
    row = rollout_row_bytes(model_config, rollout_config)
    block_bytes = kv_bytes_per_slot(model_config) * block
    free = int(fraction * device_bytes - weight_bytes(model_config))
    prefill = prefill_rows * row["prefill"]
    per_slot = row["decode"] + blocks_for(slot_tokens, block) * block_bytes
    slots = min(int(trajectories_per_device), max(0, (free - prefill) // per_slot))
    kv_blocks = (free - prefill - slots * row["decode"]) // block_bytes if slots else 0
    if slots < 1 or kv_blocks < blocks_for(int(rollout_config.max_context), block):
        raise RolloutMemoryError(
            f"rollout.memory_fraction={fraction} of {device_bytes / 2**30:.2f} GiB leaves {free / 2**30:.2f} GiB "
            f"after weights: not one trajectory of rollout.max_context={rollout_config.max_context} tokens fits "
            f"the engine's KV pool ({block_bytes / 2**20:.1f} MiB per {block}-token block)")
    return EngineMemory(int(slots), int(kv_blocks), block, block_bytes, free, prefill)


def explicit_rows(rollout_config) -> int:
    """``rollout.max_concurrent_rows``: a row count, or 0 to derive it from memory; a negative one is refused."""
    explicit = int(rollout_config.max_concurrent_rows)
    if explicit < 0:
        raise RolloutMemoryError(f"rollout.max_concurrent_rows={explicit}: expected 0 (derive) or a row count")
    return explicit


def engine_sizing(rollout_config, trajectories: int, model_config, devices: int) -> tuple[int, int]:
    """``(slots, kv blocks per device)`` the engine runs ``trajectories`` with over ``devices`` sampler devices.

    ``rollout.max_concurrent_rows`` set: that many slots (at most the trajectories, rounded up to
    the devices), ``rollout.kv_blocks`` blocks per device (0: each slot can hold ``max_context``).
    Else :func:`engine_memory` of this device's memory; its pool is capped at what the slots
    could ever hold (``max_context`` each), which is what a CPU device's "memory" (a share of
    host RAM) yields and would otherwise allocate for nothing.
    """
    per_device = -(-int(trajectories) // devices)
    explicit = explicit_rows(rollout_config)
    configured = int(rollout_config.kv_blocks)
    if explicit or model_config is None:
        return min(explicit or per_device * devices, per_device * devices), configured
    memory = engine_memory(model_config, rollout_config, device_memory_bytes(rollout_config), per_device)
    whole = blocks_for(cache_slot_limit(int(rollout_config.max_context)), memory.block_tokens)
    return memory.slots_per_device * devices, configured or min(memory.kv_blocks_per_device,
                                                                memory.slots_per_device * whole)


def rollout_rows_per_wave(model_config, rollout_config, device_bytes: int, n_data_devices: int = 1) -> int:
    """The waves policy's rows: ``rollout.max_concurrent_rows`` when set, else :func:`engine_memory`'s
    slots sized for a whole ``max_context`` on one device of ``device_bytes``, times the
    ``n_data_devices`` the rows are spread over. Weights are counted in full on every device
    (conservative: the sampler may hold a gathered copy). Raises :class:`RolloutMemoryError` naming
    the fields when not one row fits."""
    explicit = explicit_rows(rollout_config)
    if explicit:
        return explicit
    if n_data_devices < 1 or device_bytes <= 0:
        raise RolloutMemoryError(f"device_bytes={device_bytes}, n_data_devices={n_data_devices}: both must be > 0")
    whole = cache_slot_limit(int(rollout_config.max_context))
    memory = engine_memory(model_config, rollout_config, device_bytes, 2**31, slot_tokens=whole)
    return memory.slots_per_device * n_data_devices


_last_logged: dict[tuple, int] = {}


def wave_plan(rollout_config, trajectories: int, model_config=None) -> tuple[int, int]:
    """``(rows per wave, batch width)`` for a rollout of ``trajectories`` rows under the waves
    policy (the batch width is the scripted turn loop's: it pads a short wave with inert rows).

    Without a ``model_config`` (a scripted policy) only an explicit ``rollout.max_concurrent_rows``
    splits the rollout. A derived wave size is logged when it changes.
    """
    if trajectories < 1:
        raise ValueError(f"a rollout of {trajectories} trajectories")
    explicit = explicit_rows(rollout_config)
    if not explicit and model_config is None:
        return trajectories, bucket(trajectories)
    capacity = explicit or _derived_rows(rollout_config, trajectories, model_config)
    if trajectories > capacity:
        return capacity, capacity
    return trajectories, min(bucket(trajectories), capacity)


def _derived_rows(rollout_config, trajectories: int, model_config) -> int:
    device_bytes, n_data = device_memory_bytes(rollout_config), data_devices_of_ambient_mesh()
    rows = rollout_rows_per_wave(model_config, rollout_config, device_bytes, n_data)
    signature = (model_config, float(rollout_config.memory_fraction), int(rollout_config.max_context),
                 device_bytes, n_data)
    if _last_logged.get(signature) != rows:
        _last_logged[signature] = rows
        row = rollout_row_bytes(model_config, rollout_config)
        logger.info("rollout: %d rows per wave (%.2f GiB per device x memory_fraction %.2f, weights %.2f GiB, "
                    "a row's KV %.1f MiB, %d data devices); %d trajectories -> %d wave(s)",
                    rows, device_bytes / 2**30, float(rollout_config.memory_fraction),
                    weight_bytes(model_config) / 2**30, row["kv_cache"] / 2**20, n_data,
                    trajectories, -(-trajectories // rows))
    return rows
