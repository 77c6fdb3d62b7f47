"""What the rollout's memory plan (``kv_plan.py``) is made of: the bytes of a cached token, of the
weights and of one row's workspace, and a device's memory.

``rollout_row_bytes`` (:func:`rollout_row_bytes`) is a row's KV at its largest — the paged blocks
of a whole ``max_context`` — and the larger of the append workspace (activations of one layer and
the fp32 attention scores of one key block for a chunk of ``prefill_chunk`` or
``max_prompt_tokens`` tokens) and the sampler's per-row vocabulary arrays. They are closed-form
first guesses; ``plan/run.py`` compiles the real programs and checks them against the device.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from llds_jax.errors import InputError
from llds_jax.models.attention import CACHED_BLOCK
from llds_jax.rollout.scheduler import blocks_for
from llds_jax.sampling.slots import MIN_LENGTH_BUCKET, bucket, cache_slot_limit

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
