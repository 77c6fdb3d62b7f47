"""Utilisation of one RL step: MFU of the update and the log-prob passes, MBU of the decode.

The counts are closed-form (``llds_jax.utils.flops``) from the model's shapes and what the step
actually processed — the device batch's rows × length (what the programs computed, padding or
packing included), the scored positions per row, the rollout's decode steps and live KV reads —
so the figures are comparable across runs, chips and the plan's prediction
(``--mode=plan``'s step-time section uses the same functions). Peaks come from
``flops.device_peak``: the datasheet row of the chip, measured once on a CPU, or
``train.peak_flops`` / ``train.peak_bytes_per_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax

from llds_jax.utils import flops


def device_count(tree) -> int:
    """Devices the arrays of ``tree`` live on (the sampler's copy may live on fewer than the mesh)."""
    devices = set()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            devices |= set(leaf.sharding.device_set)
    return max(1, len(devices))


class ComputedRows(NamedTuple):
    """What one step's training programs computed: rows of ``length`` tokens, ``scored_per_row`` LM-head positions each."""

    rows: int  # the update's rows (packed: every row of the micro-batches its mini-batches used)
    pass_rows: int  # a no-grad pass's rows (π_old, π_ref, Δ; packed: the whole batch as one group)
    length: int
    scored_per_row: int
    pairs: float | None  # attention (query, key) pairs of the whole batch; None = causal over each row

    def pairs_per_row(self, rows: int) -> float | None:
        return None if self.pairs is None else self.pairs / max(rows, 1)


def computed_rows(learner, device_batch, trajectory_lengths) -> ComputedRows:
    """The rows the step's training programs computed: the packed rows of the micro-batches its passes used
    (the update's per mini-batch, the no-grad passes' over the whole batch), or the padded batch.
    ``trajectory_lengths``: this host's real tokens per trajectory; packed rows span every host, so on
    several hosts their attention pairs are summed over hosts (a collective: every host calls this)."""
    import numpy as np

    from llds_jax.parallel import distributed
    from llds_jax.train.step_settings import StepSizes

    packing = getattr(learner, "packing", None)
    if packing is None or getattr(device_batch, "packed", None) is None:
        rows, length = device_batch.input_ids.shape
        return ComputedRows(rows, rows, length, StepSizes.from_config(learner.config).scored_positions, None)
    used, pass_used = (int(np.sum(distributed.fetch_to_host(p.mini_count)))
                       for p in (device_batch.packed, device_batch.packed_passes))
    lengths = np.asarray(trajectory_lengths, np.float64)
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    if jax.process_count() > 1:
        pairs = distributed.sum_over_hosts({"pairs": pairs})["pairs"]
    return ComputedRows(used * packing.rows, pass_used * packing.rows, packing.width, packing.scored, pairs)


def peak_memory_bytes() -> float:
    """The largest ``peak_bytes_in_use`` over this process's devices; where none reports it (XLA:CPU,
    whose devices live in host memory) the process's peak resident set."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except (RuntimeError, NotImplementedError):
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    if peaks:
        return max(peaks)
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(rss if sys.platform == "darwin" else rss * 1024)


def step_utilisation(model_cfg, config, *, metrics: Mapping[str, float], rollout_timings: Mapping[str, float],
                     computed: ComputedRows, logprob_passes: int, mesh_devices: int, sampler_devices: int,
                     weight_bytes: int) -> dict[str, float]:
    """``throughput/*`` utilisation metrics of one step (the keys ``diagnostics.keys`` registers).

    ``computed``: the rows the update and log-prob programs ran over (``computed_rows``: padded rows, or
    the packed rows of the micro-batches used, whose attention stays inside each trajectory);
    ``logprob_passes``: π_old plus π_ref when it ran; ``weight_bytes``: bytes per weight of the
    sampler's params (its compute dtype).
    """
    peak = flops.device_peak(jax.devices()[0], float(config.train.peak_flops),
                             float(config.train.peak_bytes_per_s))
    rows, pass_rows, length, scored_per_row = computed.rows, computed.pass_rows, computed.length, computed.scored_per_row
    model_flops, _ = flops.training_flops(model_cfg, rows, length, scored_per_row, model_cfg.remat,
                                          pairs_per_row=computed.pairs_per_row(rows))
    forward = flops.forward_flops(model_cfg, pass_rows, length, scored_per_row,
                                  pairs_per_row=computed.pairs_per_row(pass_rows))
    update_s, logprobs_s = metrics.get("time/update_s", 0.0), metrics.get("time/logprobs_s", 0.0)
    steps, key_reads = int(rollout_timings.get("decode_steps", 0)), float(rollout_timings.get("decode_key_reads", 0))
    decode_s, decoded = float(rollout_timings.get("decode_s", 0.0)), float(rollout_timings.get("decode_tokens", 0))
    kv_bytes = 2 if model_cfg.dtype in ("bfloat16", "float16") else 4
    out = {
        "throughput/update_mfu": flops.utilisation(model_flops, update_s, peak.flops, mesh_devices),
        "throughput/logprobs_mfu": flops.utilisation(logprob_passes * forward, logprobs_s, peak.flops, mesh_devices),
        "throughput/logprobs_tokens_per_s": logprob_passes * pass_rows * length / max(logprobs_s, 1e-9),
        "throughput/decode_mbu": flops.utilisation(flops.decode_bytes(model_cfg, steps, key_reads, weight_bytes, kv_bytes),
                                                   decode_s, peak.bytes_per_s, sampler_devices),
        "throughput/decode_tokens_per_s": decoded / max(decode_s, 1e-9),
    }
    out["memory/device_peak_bytes"] = peak_memory_bytes()
    return out
