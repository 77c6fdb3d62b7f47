"""Slots and KV blocks per device for the rollout engine, from the same memory arithmetic as the waves.

Waves (``waves.py``) reserve ``max_context`` slots of KV for every row, so the row count
is set by the worst case. The engine's KV follows each trajectory's length: a pool of
blocks of ``rollout.kv_block_tokens`` tokens, taken as trajectories grow
(``scheduler.py``). Its slot count is sized vLLM's way — for an expected length, with
preemption by recompute as the valve when the pool runs short::

    free      = memory_fraction x device_bytes - weight_bytes            (as waves.py)
    prefill   = prefill_rows x row_bytes["prefill"]    (appends run on a few rows at a time)
    per slot  = row_bytes["decode"] + blocks(slot_tokens) x block_bytes
    slots     = min(trajectories per device, (free - prefill) // per slot)
    kv_blocks = (free - prefill - slots x row_bytes["decode"]) // block_bytes

``rollout.slot_tokens`` is the expected length a slot is sized for (default 512; Search-R1's
3B policy averages 708 tokens at the end of a trajectory and about half that over its life).
The numbers are per device; the planner compiles the real programs against them.
"""

from __future__ import annotations

import dataclasses

from llds_jax.rollout.scheduler import blocks_for
from llds_jax.rollout.waves import (
    RolloutMemoryError,
    device_memory_bytes,
    kv_bytes_per_slot,
    rollout_row_bytes,
    weight_bytes,
)
from llds_jax.sampling.slots import cache_slot_limit


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


def engine_memory(model_config, rollout_config, device_bytes: int, trajectories_per_device: int) -> EngineMemory:
    """Slots and KV blocks one device holds (see the module docstring); raises
    :class:`RolloutMemoryError` when not one trajectory of ``max_context`` fits."""
    fraction = float(rollout_config.memory_fraction)
    block = int(rollout_config.kv_block_tokens)
    slot_tokens = int(rollout_config.slot_tokens)
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


def engine_sizing(rollout_config, trajectories: int, model_config, devices: int) -> tuple[int, int]:
    """``(slots, kv blocks per device)`` the engine runs ``trajectories`` with over ``devices`` sampler devices.

    ``rollout.max_concurrent_rows`` set: that many slots (at most the trajectories, rounded up to
    the devices), ``rollout.kv_blocks`` blocks per device (0: each slot can hold ``max_context``).
    Else :func:`engine_memory` of this device's memory; its pool is capped at what the slots
    could ever hold (``max_context`` each), which is what a CPU device's "memory" (a share of
    host RAM) yields and would otherwise allocate for nothing.
    """
    per_device = -(-int(trajectories) // devices)
    explicit = int(rollout_config.max_concurrent_rows)
    configured = int(rollout_config.kv_blocks)
    if explicit or model_config is None:
        return min(explicit or per_device * devices, per_device * devices), configured
    memory = engine_memory(model_config, rollout_config, device_memory_bytes(rollout_config), per_device)
    whole = blocks_for(cache_slot_limit(int(rollout_config.max_context)), memory.block_tokens)
    return memory.slots_per_device * devices, configured or min(memory.kv_blocks_per_device,
                                                                memory.slots_per_device * whole)
