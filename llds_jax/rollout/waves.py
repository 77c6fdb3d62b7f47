"""How many trajectories a rollout decodes at once (a *wave*), sized to device memory.

The paper's step (512 prompts x 5 samples, 4,096-token context) cannot hold all 2,560 KV
caches at once on any target, so the rollout runs its trajectories in waves of at most
``rollout.max_concurrent_rows`` rows. ``0`` derives the count, like vLLM's
``gpu_memory_utilization``: a fraction ``rollout.memory_fraction`` of one device's
memory, minus the weights, divided by what one row needs at its peak, times the devices
the rows are spread over::

    rows = floor((memory_fraction x device_bytes - weight_bytes) / row_bytes) x n_data_devices

``row_bytes`` (:func:`rollout_row_bytes`) is the row's KV at its largest — the engine's
waves policy gives each slot the paged blocks of a whole ``max_context`` (``kv_blocks=0``),
so nothing is ever preempted — plus the larger of the prefill workspace (activations of one layer and the fp32 attention scores of one key
block for a chunk of ``prefill_chunk`` or ``max_prompt_tokens`` tokens) and the
sampler's per-row vocabulary arrays. It is a closed-form first guess; ``plan/run.py``
compiles the real programs and checks them against the device.

Waves change nothing in the results (each row's randomness and cache layout are its
own: ``sampling/slots.py``), only the peak memory and the time.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from llds_jax.errors import InputError
from llds_jax.sampling.generate import MIN_LENGTH_BUCKET, bucket
from llds_jax.models.attention import CACHED_BLOCK
from llds_jax.rollout.scheduler import blocks_for
from llds_jax.sampling.slots import cache_slot_limit

logger = logging.getLogger(__name__)

# 4-byte [V] arrays a decode step keeps per row: the carried and the new logits, the scaled
# copy, its order keys and exp weights (the top-k/top-p cut-off search), one masked pass of
# that search, the filtered logits, and the Gumbel draw's random bits and noise.
SAMPLER_VOCAB_ARRAYS = 9
# [T, hidden]-sized activations of one layer alive together in a cached forward (residual,
# normed input, attention output, MLP output), besides q/k/v and the MLP's two up projections.
PREFILL_HIDDEN_ARRAYS = 4
DEFAULT_CPU_MEMORY_BYTES = 8 * 2**30  # when /proc/meminfo cannot be read


class RolloutMemoryError(InputError):
    """Not even one trajectory fits the rollout's memory budget."""


def kv_bytes_per_slot(model_config) -> int:
    """Bytes one cached token takes: K and V of every layer in the compute dtype, plus its valid flag."""
    itemsize = jnp.dtype(model_config.dtype).itemsize
    return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * itemsize + 1


@functools.lru_cache(maxsize=16)
def weight_bytes(model_config) -> int:
    """Bytes of the model's parameters in their stored dtype (from an abstract model: nothing is allocated)."""
    from flax import nnx  # noqa: PLC0415

    from llds_jax.models.decoder import Decoder  # noqa: PLC0415

    abstract = nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def rollout_row_bytes(model_config, rollout_config) -> dict[str, int]:
    """Peak bytes one rollout row needs on its device, by part (``total`` = kv + the larger workspace)."""
    block = int(rollout_config.kv_block_tokens)
    slots = blocks_for(cache_slot_limit(int(rollout_config.max_context)), block) * block
    kv = kv_bytes_per_slot(model_config) * slots
    chunk = int(rollout_config.prefill_chunk) or bucket(int(rollout_config.max_prompt_tokens),
                                                                    MIN_LENGTH_BUCKET)
    itemsize = jnp.dtype(model_config.dtype).itemsize
    c = model_config
    per_token = (PREFILL_HIDDEN_ARRAYS * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + 2 * c.intermediate_size) * itemsize
    key_block = min(CACHED_BLOCK, slots)
    scores = 2 * c.num_heads * key_block * 4  # fp32 scores and probabilities of one key block, per query
    prefill = chunk * (per_token + scores) + chunk * 8  # + the chunk's ids and mask
    action_width = bucket(int(rollout_config.max_action_tokens), MIN_LENGTH_BUCKET)
    decode = SAMPLER_VOCAB_ARRAYS * c.vocab_size * 4 + action_width * 8  # + the tokens/log-probs buffer
    return dict(kv_cache=kv, prefill=prefill, decode=decode, total=kv + max(prefill, decode))


def rollout_rows_per_wave(model_config, rollout_config, device_bytes: int, n_data_devices: int = 1) -> int:
    """Rows decoded together: ``rollout.max_concurrent_rows`` when set, else derived from the budget.

    ``device_bytes``: one device's memory; ``n_data_devices``: how many devices the rows
    are sharded over (the mesh's data and fsdp axes). Weights are counted in full on every
    device (conservative: the sampler may hold a gathered copy). Raises
    :class:`RolloutMemoryError` naming the fields when not one row fits.
    """
    explicit = int(rollout_config.max_concurrent_rows)
    if explicit < 0:
        raise RolloutMemoryError(f"rollout.max_concurrent_rows={explicit}: expected 0 (derive) or a row count")
    if explicit:
        return explicit
    fraction = float(rollout_config.memory_fraction)
    if not 0.0 < fraction <= 1.0:
        raise RolloutMemoryError(f"rollout.memory_fraction={fraction}: expected a fraction in (0, 1]")
    if n_data_devices < 1 or device_bytes <= 0:
        raise RolloutMemoryError(f"device_bytes={device_bytes}, n_data_devices={n_data_devices}: both must be > 0")
    weights = weight_bytes(model_config)
    row = rollout_row_bytes(model_config, rollout_config)
    free = fraction * device_bytes - weights
    per_device = int(free // row["total"]) if free > 0 else 0
    if per_device < 1:
        raise RolloutMemoryError(
            f"rollout.memory_fraction={fraction} of {device_bytes / 2**30:.2f} GiB per device leaves "
            f"{free / 2**30:.2f} GiB after {weights / 2**30:.2f} GiB of weights, but one row of "
            f"rollout.max_context={rollout_config.max_context} needs {row['total'] / 2**20:.1f} MiB "
            f"(KV cache {row['kv_cache'] / 2**20:.1f} MiB); raise rollout.memory_fraction, lower "
            f"rollout.max_context or rollout.prefill_chunk, or use a device with more memory")
    return per_device * n_data_devices


def reported_bytes_limit(devices) -> int | None:
    """What this process's first device among ``devices`` reports as usable (None: CPU, no limit).

    Only this process's devices answer ``memory_stats()``; a multi-host mesh lists the others' too.
    """
    local = [d for d in devices if getattr(d, "process_index", 0) == jax.process_index()] or list(devices)
    stats = local[0].memory_stats() if hasattr(local[0], "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def device_memory_bytes(rollout_config, device: jax.Device | None = None) -> int:
    """One device's memory: what it reports (``bytes_limit``), else ``rollout.cpu_memory_bytes``,
    else the host's MemTotal shared by its local devices (simulated CPU devices share one RAM)."""
    device = device or jax.local_devices()[0]
    reported = reported_bytes_limit([device])
    if reported is not None:
        return reported
    configured = int(rollout_config.cpu_memory_bytes)
    host = configured or _host_memory_bytes()
    return host // max(1, jax.local_device_count(device.platform))


def _host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return DEFAULT_CPU_MEMORY_BYTES


def data_devices_of_ambient_mesh() -> int:
    """Devices the batch dimension is split over under the ambient mesh (1 without one).

    On several hosts each samples its own prompts with a host-local copy of the policy on one
    device (``Learner.sampler_policy``), so its rows are not spread over the global mesh: 1.
    """
    from llds_jax.parallel.rules import current_rules  # noqa: PLC0415

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.process_count() > 1:
        return 1
    return current_rules().shards("batch", mesh)


_last_logged: dict[tuple, int] = {}


def wave_plan(rollout_config, trajectories: int, model_config=None) -> tuple[int, int]:
    """``(rows per wave, batch width)`` for a rollout of ``trajectories`` rows.

    Every wave is compiled at one batch width: the wave size when there are several
    waves (the last one padded with inert rows), else the power-of-two bucket of the
    row count as before (capped at the wave size). Without a ``model_config`` (a
    scripted policy) only an explicit ``rollout.max_concurrent_rows`` splits the
    rollout. A derived wave size is logged when it changes.
    """
    if trajectories < 1:
        raise ValueError(f"a rollout of {trajectories} trajectories")
    explicit = int(rollout_config.max_concurrent_rows)
    if explicit < 0:
        raise RolloutMemoryError(f"rollout.max_concurrent_rows={explicit}: expected 0 (derive) or a row count")
    if not explicit and model_config is None:
        return trajectories, bucket(trajectories)
    if explicit:
        capacity = explicit
    else:
        capacity = _derived_rows(rollout_config, trajectories, model_config)
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
                    "%.1f MiB per row of which KV %.1f MiB, %d data devices); %d trajectories -> %d wave(s)",
                    rows, device_bytes / 2**30, float(rollout_config.memory_fraction),
                    weight_bytes(model_config) / 2**30, row["total"] / 2**20, row["kv_cache"] / 2**20, n_data,
                    trajectories, -(-trajectories // rows))
    return rows
