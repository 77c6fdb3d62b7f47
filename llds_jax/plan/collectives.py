"""The training passes' data-parallel collectives, per phase, for the step-time model.

The trainer shards every weight over the mesh's ``fsdp`` (and ``tensor``) axes and replicates it over
``data`` (``parallel.rules``), so each pass over a micro-batch first gathers the weights it multiplies.
What the compiled programs do, read off XLA:GPU's compile of the tiny model on 8 H100s (FSDP 8, bf16,
compile-only: docs/performance.md, step time): every pass over a micro-batch all-gathers the weights in
the compute dtype (each layer's inside the layer loop's body, the embedding and head's in the micro-batch
loop); the update gathers them a second time in its backward (its remat keeps matmul outputs, not the
gathered weights) and reduce-scatters the gradients every micro-batch, the layers' in the compute dtype
and the embedding and head's in fp32. Each gather starts one to four ops before the layer that uses it,
inside the same loop trip, so none is assumed to hide behind compute: the charge is an upper bound until
the compiled programs' overlap is measured. Gradients summed over a ``data`` axis are charged as a ring
all-reduce of the device's gradient shard every micro-batch, beside the reduce-scatter. A ``tensor`` axis's
activation all-reduces are not charged: of the paper configs only qwen7b has one (4 ways), so its
prediction is short of them.

Bytes are what one device receives (a ring's ``(n - 1) / n`` of the gathered or scattered buffer), at
the chips' link bandwidth one way (``plan.retrieval.INTERCONNECT``: datasheets) — within a host for
GPUs, whose hosts are joined by a slower network (``GPU_NETWORK``) — and no efficiency below it.
"""

from __future__ import annotations

import dataclasses
import math

from llds_jax.plan.retrieval import INTERCONNECT
from llds_jax.utils import flops

# Weights gathered per micro-batch of each training pass (the compiled tiny programs above).
GATHERS_PER_MICRO_BATCH = {"logprobs": 1, "update": 2, "delta": 1}
# A GPU host's network to other hosts (8 x 400 Gb/s NICs on a DGX H100 / H200 host: 50 GB/s a GPU).
GPU_NETWORK = (50e9, "8 x 400 Gb/s InfiniBand NDR a DGX H100/H200 host: 50 GB/s a GPU between hosts")


@dataclasses.dataclass(frozen=True)
class MicroBatchTraffic:
    """Bytes one device moves for one micro-batch's one pass over the weights."""

    gather: float          # the weights' all-gather over fsdp, in the compute dtype
    reduce_scatter: float  # the gradients' reduce-scatter over fsdp (update only)
    all_reduce: float      # the gradient shard's all-reduce over data (update only)


def micro_batch_traffic(model_cfg, mesh_shape: tuple[int, int, int], compute_bytes: int) -> MicroBatchTraffic:
    """One micro-batch's collectives on a ``(data, fsdp, tensor)`` mesh: each device holds 1 / (fsdp ·
    tensor) of every weight and gathers the rest of its tensor shard over fsdp; gradients come back the
    same way, the embedding and head's in fp32, the layers' in the compute dtype. The matmuls' weights
    only: the norms' scales and the biases are gathered outside the micro-batch loop, in fp32 (Qwen2.5-3B: 0.24 M)."""
    data, fsdp, tensor = (int(n) for n in mesh_shape)
    layers = model_cfg.num_layers * flops.layer_weights(model_cfg)
    embedding = model_cfg.vocab_size * model_cfg.hidden_size * (1 if model_cfg.tie_embeddings else 2)
    gathered = (layers + embedding) * compute_bytes / tensor
    gradients = (layers * compute_bytes + embedding * 4) / tensor
    return MicroBatchTraffic(gather=gathered * (fsdp - 1) / fsdp,
                             reduce_scatter=gradients * (fsdp - 1) / fsdp,
                             all_reduce=2 * gradients / fsdp * (data - 1) / data)


def micro_batches_per_pass(config, train_rows: int, packing) -> dict[str, int]:
    """Micro-batches each pass computes over the step's ``train_rows``: packed rows ``packing.rows`` at a
    time (every pass), or padded rows ``train.micro_batch_size`` (the update) and
    ``train.logprob_batch_size`` (the no-grad passes) at a time."""
    if packing is not None:
        update = logprobs = math.ceil(train_rows / int(packing.rows))
    else:
        update = math.ceil(train_rows / int(config.train.micro_batch_size))
        logprobs = math.ceil(train_rows / int(config.train.logprob_batch_size))
    return {"logprobs": logprobs, "update": update, "delta": logprobs}


def link_rate(platform: str, hardware: str, hosts: int) -> tuple[float, str] | None:
    """The bandwidth a device's collectives run at, one way, and its source; None where the plan knows
    no link (a CPU plan's simulated devices share one host's memory: nothing is charged)."""
    if platform == "cpu" or hardware not in INTERCONNECT:
        return None
    if platform == "gpu" and hosts > 1:
        return GPU_NETWORK
    return INTERCONNECT[hardware]


def collective_seconds(config, model_cfg, *, platform: str, hardware: str, devices: int, hosts: int,
                       compute_bytes: int, train_rows: int, packing, passes: int,
                       delta_every: int) -> tuple[dict[str, float], str]:
    """Seconds each training phase spends in its collectives (added to the phase: not overlapped), and
    the assumption's text. ``passes``: the no-grad log-prob passes a step (π_old, π_ref);
    ``delta_every``: the Δ forward's cadence (0: off)."""
    from llds_jax.parallel.mesh import resolve_mesh_shape  # noqa: PLC0415

    mesh_shape = resolve_mesh_shape(tuple(config.mesh.shape), devices)
    rate = link_rate(platform, hardware, hosts)
    zero = {"logprobs": 0.0, "update": 0.0, "delta": 0.0}
    if rate is None:
        return zero, f"none charged: no chip-to-chip link known on {platform} ({hardware or 'no target chip'})"
    if mesh_shape[0] * mesh_shape[1] == 1:
        return zero, f"none: mesh {tuple(mesh_shape)} shards no weight over fsdp and sums no gradient over data"
    traffic = micro_batch_traffic(model_cfg, mesh_shape, compute_bytes)
    counts = micro_batches_per_pass(config, train_rows, packing)
    link, why = rate
    per_pass = {phase: counts[phase] * GATHERS_PER_MICRO_BATCH[phase] * traffic.gather for phase in counts}
    per_pass["update"] += counts["update"] * (traffic.reduce_scatter + traffic.all_reduce)
    seconds = {"logprobs": passes * per_pass["logprobs"] / link, "update": per_pass["update"] / link,
               "delta": per_pass["delta"] / link / delta_every if delta_every else 0.0}
    text = (f"mesh {tuple(mesh_shape)}: a micro-batch's weight gather {traffic.gather / 1e9:.2f} GB a device "
            f"(compute dtype), gradient reduce-scatter {traffic.reduce_scatter / 1e9:.2f} GB (layers in the compute "
            f"dtype, embedding and head in fp32) + data all-reduce {traffic.all_reduce / 1e9:.2f} GB; "
            f"{counts['update']} micro-batches an update ({GATHERS_PER_MICRO_BATCH['update']} gathers each), "
            f"{counts['logprobs']} a log-prob pass ({GATHERS_PER_MICRO_BATCH['logprobs']} gather each); at {link / 1e9:.0f} GB/s one way ({why}); added to each phase, none overlapped: an upper "
            f"bound (XLA:GPU's compiled tiny FSDP programs start each layer's gather just before that layer: "
            f"plan/collectives.py): logprobs {seconds['logprobs']:.2f} s, update {seconds['update']:.2f} s, "
            f"delta {seconds['delta']:.2f} s")
    return seconds, text
