"""The paged KV cache ``Decoder.forward_cached`` also takes (layout: ``attention/paged.py``).

A row's tokens fill its slots from 0 (no left padding, no holes: the rollout engine's rows),
so a row's state is its end and its block table; there is no per-slot valid mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from llds_jax.models.config import DecoderConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """k, v: per layer, a pool ``[devices, blocks, kv_heads, block, head_dim]``; ``table`` [B, C]
    int32: row ``b``'s blocks in slot order, on its own device's pool (rows are split over
    devices in contiguous groups), ``blocks`` where it holds none; ``end`` [B]: the next slot
    each row writes (its token count). ``max_len`` = C × block: the most slots a row can hold.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    table: jax.Array
    end: jax.Array

    @property
    def block_size(self) -> int:
        return self.k[0].shape[3]

    @property
    def blocks_per_device(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.block_size

    def next_positions(self) -> jax.Array:
        """RoPE position of each row's next token: its token count (its slots have no holes)."""
        return self.end


def init_paged_pools(config: DecoderConfig, devices: int, blocks: int, block: int, dtype: Any = None):
    """(k, v) pools of zeros, one ``[devices, blocks, kv_heads, block, head_dim]`` per layer."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (devices, blocks, config.num_kv_heads, block, config.head_dim)
    return (tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))


def paged_pool_bytes(config: DecoderConfig, blocks: int, block: int, dtype: Any = None) -> int:
    """One device's bytes of k and v pools of ``blocks`` blocks over every layer."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * blocks * config.num_kv_heads * block * config.head_dim * itemsize
