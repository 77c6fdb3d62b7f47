"""Closed-form FLOPs and bytes of each phase of a step, and the chips' peaks: MFU / MBU per step.

The MaxText way (``maxtext_utils.calculate_tflops_training_per_device``): count the matmul
FLOPs a phase needs from the model's shapes and the tokens it processed, divide by the phase's
seconds and the devices' peak. Two counts per phase:

* **model FLOPs** (what MFU divides): forward = 2 × (weights a token meets) per token, plus
  causal attention (4 · heads · head_dim · keys per query, keys = position + 1), plus the LM head
  on the *scored* positions only (``models.logprobs.scored_positions``: only action targets meet
  the head); training = 3 × forward (the backward costs two forwards);
* **hardware FLOPs** (what a time prediction needs): model FLOPs plus what remat recomputes
  (``model.remat="full"`` / ``"nothing_saveable"`` rerun the whole forward in the backward;
  ``"minimal"`` / ``"dots_saveable"`` keep the matmul outputs and rerun only elementwise work and an
  opaque attention kernel's forward; the LM head's chunks rerun their projection under any policy:
  :func:`update_hardware_flops`).

Decode is bandwidth-bound, so its utilisation is MBU: bytes a decode step must read — the
weights once per step (all rows share them) and each row's *live* KV entries — over seconds and
the devices' HBM bandwidth. Counted on live tokens, not on the buffers a kernel happens to read,
so a schedule that reads padding scores lower.

Peaks (:data:`PEAKS`) are datasheet figures, bf16 dense; CPU has no datasheet, so its peak is
measured once per process (:func:`cpu_peak`, an fp32 matmul and a copy) unless
``train.peak_flops`` / ``train.peak_bytes_per_s`` say otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import time

# (label, bf16 dense FLOP/s per chip, HBM bytes/s per chip): vendor datasheets.
PEAKS: dict[str, tuple[str, float, float]] = {
    "H100": ("NVIDIA H100 SXM (989 TFLOP/s bf16, 3.35 TB/s)", 989e12, 3.35e12),
    "H200": ("NVIDIA H200 (989 TFLOP/s bf16, 4.8 TB/s)", 989e12, 4.8e12),
    "v5e": ("TPU v5e (197 TFLOP/s bf16, 819 GB/s)", 197e12, 819e9),
    "v5p": ("TPU v5p (459 TFLOP/s bf16, 2.77 TB/s)", 459e12, 2.765e12),
}
REMAT_RERUNS_FORWARD = ("full", "nothing_saveable")
# Policies that keep every matmul's output (``models.decoder._remat``): the backward reruns elementwise work
# (no matmul FLOPs) and, where the attention is an opaque kernel (cuDNN, splash: its residuals live inside its
# custom VJP, so no policy can name them), that kernel's forward.
REMAT_KEEPS_MATMULS = ("minimal", "dots_saveable")
# Policies that keep every matmul's output but the MLP gate projection's, which the backward recomputes.
REMAT_RERUNS_GATE = ("minimal_no_gate",)


@dataclasses.dataclass(frozen=True)
class Peak:
    """One device's peak: ``flops`` per second and HBM ``bytes_per_s``; ``source`` says where from."""

    flops: float
    bytes_per_s: float
    source: str


def hardware_of(device_kind: str, platform: str) -> str | None:
    """The :data:`PEAKS` key of a device (``jax.Device.device_kind``), None when unknown (e.g. CPU)."""
    kind = device_kind.lower()
    if platform == "gpu" or "nvidia" in kind:
        return "H200" if "h200" in kind else "H100" if "h100" in kind else None
    if platform == "tpu":
        return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p" if "v5" in kind else None
    return None


@functools.cache
def cpu_peak() -> Peak:
    """This CPU's fp32 matmul FLOP/s and copy bandwidth, measured once (best of 3, ≈ 0.3 s)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    big = np.ones(32 * 2**20 // 4, np.float32)
    flops, bandwidth = 0.0, 0.0
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        flops = max(flops, 2 * 1024**3 / (time.perf_counter() - start))
        start = time.perf_counter()
        big.copy()
        bandwidth = max(bandwidth, 2 * big.nbytes / (time.perf_counter() - start))
    return Peak(flops, bandwidth, "measured on this CPU (numpy fp32 1024^3 matmul, 128 MB copy)")


def device_peak(device, flops_override: float = 0.0, bytes_override: float = 0.0) -> Peak:
    """The peak of ``device`` (a ``jax.Device``): the overrides, else :data:`PEAKS`, else measured (CPU)."""
    key = hardware_of(str(getattr(device, "device_kind", "")), str(getattr(device, "platform", "cpu")))
    if key is not None:
        label, flops, bandwidth = PEAKS[key]
        source = label
    else:
        measured = cpu_peak()
        flops, bandwidth, source = measured.flops, measured.bytes_per_s, measured.source
    if flops_override or bytes_override:
        source = f"{source}; overridden by train.peak_flops / train.peak_bytes_per_s"
    return Peak(float(flops_override or flops), float(bytes_override or bandwidth), source)


# ------------------------------------------------------------------ the model's shapes
def layer_weights(cfg) -> int:
    """Weights one token meets in one decoder layer's matmuls (q, k, v, o and the gated MLP)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size


def parameters(cfg) -> int:
    """Every parameter: embeddings, an untied head, the layers' matmuls, biases and norms."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = layer_weights(cfg) + 2 * cfg.hidden_size
    per_layer += (q + 2 * kv) if cfg.qkv_bias else 0
    per_layer += 2 * cfg.head_dim if cfg.qk_norm else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + head + cfg.num_layers * per_layer + cfg.hidden_size


def kv_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    """Bytes of one token's K and V over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def attention_flops(cfg, key_reads: float) -> float:
    """QKᵀ and PV for ``key_reads`` (query, key) pairs, all layers and heads."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * key_reads


def causal_pairs(length: int) -> int:
    """(query, key) pairs of one causal sequence of ``length`` tokens."""
    return length * (length + 1) // 2


def forward_flops(cfg, rows: int, length: int, scored_per_row: int, *, pairs_per_row: float | None = None) -> float:
    """Model FLOPs of a no-grad forward over ``rows`` × ``length`` tokens whose LM head sees
    ``scored_per_row`` positions a row (``pairs_per_row``: attention pairs, default causal over ``length``)."""
    pairs = causal_pairs(length) if pairs_per_row is None else pairs_per_row
    body = 2.0 * cfg.num_layers * layer_weights(cfg) * length + attention_flops(cfg, pairs)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size * scored_per_row
    return rows * (body + head)


def training_flops(cfg, rows: int, length: int, scored_per_row: int, remat: str = "none",
                   *, pairs_per_row: float | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one forward + backward over the rows (see the module doc)."""
    forward = forward_flops(cfg, rows, length, scored_per_row, pairs_per_row=pairs_per_row)
    return 3.0 * forward, (4.0 if remat in REMAT_RERUNS_FORWARD else 3.0) * forward


def update_hardware_flops(cfg, rows: int, length: int, scored_per_row: int, remat: str, *,
                          pairs_per_row: float | None = None, opaque_attention: bool = False,
                          head_chunked: bool = False) -> float:
    """Hardware FLOPs of the update's forward + backward over the rows, term by term (what the job runs):
    the decoder body B (layers and attention A) and the LM head H each once forward and twice backward;
    ``remat`` in :data:`REMAT_RERUNS_FORWARD` reruns B, one in :data:`REMAT_KEEPS_MATMULS` reruns A where the
    kernel is opaque (``opaque_attention``), one in :data:`REMAT_RERUNS_GATE` that and the MLP gate projection; ``head_chunked`` (``models.logprobs.token_logprobs`` scans more
    than one chunk of scored positions and checkpoints each) reruns H. Full remat with a chunked head is
    ``4 × forward``, :func:`training_flops`' count."""
    pairs = causal_pairs(length) if pairs_per_row is None else pairs_per_row
    attention = rows * attention_flops(cfg, pairs)
    head = rows * 2.0 * cfg.hidden_size * cfg.vocab_size * scored_per_row
    body = forward_flops(cfg, rows, length, scored_per_row, pairs_per_row=pairs) - head
    kept = remat in REMAT_KEEPS_MATMULS or remat in REMAT_RERUNS_GATE
    rerun = body if remat in REMAT_RERUNS_FORWARD else attention if (kept and opaque_attention) else 0.0
    if remat in REMAT_RERUNS_GATE:
        rerun += rows * length * 2.0 * cfg.num_layers * cfg.hidden_size * cfg.intermediate_size
    return 3.0 * (body + head) + rerun + (head if head_chunked else 0.0)


def decode_bytes(cfg, steps: int, key_reads: float, weight_bytes: int = 2, kv_bytes: int = 2) -> float:
    """Bytes ``steps`` decode steps must read: the weights once a step, plus ``key_reads`` live KV entries."""
    return steps * parameters(cfg) * weight_bytes + key_reads * kv_bytes_per_token(cfg, kv_bytes)


def decode_flops(cfg, tokens: int, key_reads: float) -> float:
    """Model FLOPs of sampling ``tokens`` tokens (full LM head each) attending ``key_reads`` keys in all."""
    per_token = 2.0 * (cfg.num_layers * layer_weights(cfg) + cfg.hidden_size * cfg.vocab_size)
    return tokens * per_token + attention_flops(cfg, key_reads)


def utilisation(work: float, seconds: float, peak_per_device: float, devices: int) -> float:
    """``work`` / (seconds × peak × devices): MFU for FLOPs, MBU for bytes; NaN when nothing was timed."""
    if seconds <= 0 or peak_per_device <= 0 or devices <= 0:
        return float("nan")
    return work / (seconds * peak_per_device * devices)
