"""The training passes' data-parallel collectives, per phase, for the step-time model.

The trainer shards every weight over the mesh's ``fsdp`` (and ``tensor``) axes and replicates it over
``data`` (``parallel.rules``), so each pass over a micro-batch first gathers the weights it multiplies.
What the compiled programs move, read off XLA:GPU's compile of the tiny model on 8 H100s (FSDP 8, bf16,
compile-only; ``tests/scale/test_plan_collectives.py``): every pass over a micro-batch all-gathers the
layers' weights in the compute dtype inside the layer loop; the update gathers them a second time in its
backward (its remat keeps matmul outputs, not the gathered weights) and reduce-scatters their gradients
every micro-batch in the compute dtype. The embedding (the LM head's table; ``models.logprobs`` gathers it
before its chunks): a no-grad pass gathers it once in the compute dtype, hoisted out of its micro-batch
loop; an update micro-batch all-reduces its gradient in fp32, and gathers it in fp32 (qwen3b's compiled
update, read once: three fp32 ring passes over the table a micro-batch, charged). Gradients summed over a
``data`` axis are charged as a ring all-reduce of the device's gradient shard every micro-batch. A
``tensor`` axis's activation all-reduces are not charged: of the paper configs only qwen7b has one (4
ways), so its prediction is short of them.

What is charged is what stays exposed. On a GPU the programs are compiled with
``parallel.overlap.TRAINING_COMPILER_OPTIONS``, under which (the same test reads it) a forward's layer
gathers and the update's layer reduce-scatters are pipelined across the layer loop's trips: each runs
behind one trip's compute, so it costs only what it outlasts that trip by; the first layer's gather (peeled
before the loop), the last layer's reduce-scatter (drained after it), the embedding's collectives, the
backward's layer gathers and the data all-reduce stay exposed. Elsewhere nothing is assumed to hide
(XLA:TPU's schedule is not read: its async collective fusions run some gathers beside a matmul).

Bytes are what one device receives (a ring's ``(n - 1) / n`` of the gathered or scattered buffer), at
the chips' link bandwidth one way (``plan.retrieval.INTERCONNECT``: datasheets) — within a host for
GPUs, whose hosts are joined by a slower network (``GPU_NETWORK``) — and no efficiency below it. Compute
beside a collective is assumed not slowed by it (NCCL's kernels take a few SMs: unmeasured here).
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

    layers_gather: float          # the layers' weights' all-gather over fsdp, in the compute dtype
    embedding_gather: float       # the embedding's (and an untied head's), in the compute dtype: a no-grad pass
    layers_reduce_scatter: float  # the layers' gradients' reduce-scatter over fsdp, compute dtype (update only)
    embedding_fp32: float         # one ring pass over the embedding (and head) in fp32 (update only, 3 a micro-batch)
    all_reduce: float             # the gradient shard's all-reduce over data (update only)


def micro_batch_traffic(model_cfg, mesh_shape: tuple[int, int, int], compute_bytes: int) -> MicroBatchTraffic:
    """One micro-batch's collectives on a ``(data, fsdp, tensor)`` mesh: each device holds 1 / (fsdp ·
    tensor) of every weight and gathers the rest of its tensor shard over fsdp; the layers' gradients come
    back the same way in the compute dtype, the embedding's in fp32 (module docstring). The matmuls' weights
    only: the norms' scales and the biases are gathered outside the micro-batch loop, in fp32 (Qwen2.5-3B: 0.24 M)."""
    data, fsdp, tensor = (int(n) for n in mesh_shape)
    layers = model_cfg.num_layers * flops.layer_weights(model_cfg)
    embedding = model_cfg.vocab_size * model_cfg.hidden_size * (1 if model_cfg.tie_embeddings else 2)
    ring = (fsdp - 1) / fsdp / tensor
    gradients = (layers * compute_bytes + embedding * 4) / tensor
    return MicroBatchTraffic(layers_gather=layers * compute_bytes * ring,
                             embedding_gather=embedding * compute_bytes * ring,
                             layers_reduce_scatter=layers * compute_bytes * ring,
                             embedding_fp32=embedding * 4 * ring,
                             all_reduce=2 * gradients / fsdp * (data - 1) / data)


def micro_batches_per_pass(config, train_rows: int, packing, pass_rows: int | None = None) -> dict[str, int]:
    """Micro-batches each pass computes: packed rows ``packing.rows`` at a time (the update's ``train_rows``,
    a no-grad pass's ``pass_rows``: the whole batch as one group), or padded rows ``train.micro_batch_size``
    (the update) and ``train.logprob_batch_size`` (the no-grad passes) at a time."""
    if packing is not None:
        update = math.ceil(train_rows / int(packing.rows))
        logprobs = math.ceil((train_rows if pass_rows is None else pass_rows) / int(packing.rows))
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
                       compute_bytes: int, train_rows: int, packing, passes: int, delta_every: int,
                       compute_seconds: dict[str, float] | None = None,
                       pass_rows: int | None = None) -> tuple[dict[str, float], str]:
    """Seconds each training phase's collectives add to it (what compute does not hide), and the
    assumption's text. ``passes``: the no-grad log-prob passes a step (π_old, π_ref); ``delta_every``: the
    Δ forward's cadence (0: off); ``train_rows`` / ``pass_rows``: the rows the update and a no-grad pass compute
    (``pass_rows`` None: the update's); ``compute_seconds``: one pass's compute over its rows —
    ``"forward"`` (a no-grad pass), ``"update_forward"`` and ``"update_backward"`` (the update's, split at
    one forward) — which a pipelined collective runs behind, a layer trip at a time (none given: nothing
    hides)."""
    from llds_jax.parallel.mesh import resolve_mesh_shape  # noqa: PLC0415

    mesh_shape = resolve_mesh_shape(tuple(config.mesh.shape), devices)
    rate = link_rate(platform, hardware, hosts)
    zero = {"logprobs": 0.0, "update": 0.0, "delta": 0.0}
    if rate is None:
        return zero, f"none charged: no chip-to-chip link known on {platform} ({hardware or 'no target chip'})"
    if mesh_shape[0] * mesh_shape[1] == 1:
        return zero, f"none: mesh {tuple(mesh_shape)} shards no weight over fsdp and sums no gradient over data"
    traffic = micro_batch_traffic(model_cfg, mesh_shape, compute_bytes)
    counts = micro_batches_per_pass(config, train_rows, packing, pass_rows)
    link, why = rate
    layers = int(model_cfg.num_layers)
    pipelined = platform == "gpu" and compute_seconds is not None
    gather, scatter = traffic.layers_gather / layers / link, traffic.layers_reduce_scatter / layers / link

    def behind(collective: float, pass_seconds: float, micro: int) -> float:
        """One micro-batch's layer collectives, one a trip: all exposed, or (pipelined) the first or last
        one whole and every other one's excess over the trip it runs behind."""
        if not pipelined:
            return layers * collective
        return collective + (layers - 1) * max(0.0, collective - pass_seconds / (micro * layers))

    compute = compute_seconds or {}
    micro = counts["logprobs"]
    no_grad = traffic.embedding_gather / link + micro * behind(gather, compute.get("forward", 0.0), micro)
    micro = counts["update"]
    update = micro * (behind(gather, compute.get("update_forward", 0.0), micro)
                      + layers * gather                                         # the backward's: in its trip
                      + behind(scatter, compute.get("update_backward", 0.0), micro)
                      + (3 * traffic.embedding_fp32 + traffic.all_reduce) / link)
    seconds = {"logprobs": passes * no_grad, "update": update,
               "delta": no_grad / delta_every if delta_every else 0.0}
    moved = {"logprobs": passes * (traffic.embedding_gather + counts["logprobs"] * traffic.layers_gather) / link,
             "update": counts["update"] * (2 * traffic.layers_gather + traffic.layers_reduce_scatter
                                           + 3 * traffic.embedding_fp32 + traffic.all_reduce) / link}
    how = ("pipelined across the layer trips (parallel.overlap.TRAINING_COMPILER_OPTIONS): a forward's layer "
           "gathers and the update's layer reduce-scatters cost what they outlast a trip's compute by; the "
           "first gather, last reduce-scatter, the embedding's, the backward's layer gathers and the data "
           "all-reduce exposed" if pipelined else
           "added to each phase, none overlapped ("
           + ("XLA:TPU's schedule not read)" if platform == "tpu" else "no compute to run behind)"))
    text = (f"mesh {tuple(mesh_shape)}: a micro-batch's layer weight gather {traffic.layers_gather / 1e9:.2f} GB a "
            f"device and gradient reduce-scatter {traffic.layers_reduce_scatter / 1e9:.2f} GB (compute dtype), the "
            f"embedding's gather {traffic.embedding_gather / 1e9:.2f} GB once a no-grad pass and 3 x "
            f"{traffic.embedding_fp32 / 1e9:.2f} GB fp32 an update micro-batch, data all-reduce "
            f"{traffic.all_reduce / 1e9:.2f} GB; "
            f"{counts['update']} micro-batches an update ({GATHERS_PER_MICRO_BATCH['update']} gathers each), "
            f"{counts['logprobs']} a log-prob pass ({GATHERS_PER_MICRO_BATCH['logprobs']} gather each); at "
            f"{link / 1e9:.0f} GB/s one way ({why}): π_old + π_ref {moved['logprobs']:.2f} s, update "
            f"{moved['update']:.2f} s of link time; {how} (plan/collectives.py): logprobs "
            f"{seconds['logprobs']:.2f} s, update {seconds['update']:.2f} s, delta {seconds['delta']:.2f} s")
    return seconds, text
