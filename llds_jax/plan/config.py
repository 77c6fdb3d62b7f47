"""The ``plan`` config section: its defaults, the hardware it knows, and its own checks.

Kept apart from ``plan.run`` (which compiles with JAX) so the config assembly in
``llds_jax.config`` can embed and validate the section without importing the planner.
"""

from __future__ import annotations

import ml_collections

from llds_jax.plan.targets import PlanError, parse_topology

GB = 1e9
# Usable fraction of HBM: XLA keeps some for itself; on GPU also set
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the default preallocation is only 75%).
USABLE_FRACTION = 0.92
HARDWARE: dict[str, tuple[str, float]] = {
    "H100": ("NVIDIA H100 SXM, 80 GB", 80 * GB),
    "H200": ("NVIDIA H200, 141 GB", 141 * GB),
    "v5e": ("TPU v5e chip, 16 GB", 16 * GB),
    "v5p": ("TPU v5p chip, 95 GB", 95 * GB),
}

PHASES = ("update", "logprobs", "prefill", "decode")
CHECK_MODES = ("auto", "always", "never")


def default_plan_config() -> ml_collections.ConfigDict:
    """The ``plan`` config section (the trainer's base config embeds it)."""
    return ml_collections.ConfigDict(dict(
        devices=8,            # devices of the planned mesh (CPU: simulated; GPU: plan.gpu's); 0 = this process's
        topology="",          # TPU slice to compile for with XLA:TPU, e.g. "v5e:8x8" (pip install '.[plan-tpu]')
        gpu="",               # GPU to compile for with XLA:GPU: "h100", "h200" or a target .txtpb ('.[plan-gpu]')
        gpus_per_host=8,      # with plan.gpu: GPUs per host (plan.devices / this = hosts)
        rollout_batch=0,      # rows decoded together; 0 = the trainer's own wave (rollout.max_concurrent_rows or derived)
        hardware=("H100", "H200", "v5e", "v5p"),
        phases=("update", "logprobs", "prefill", "decode"),
        # --mode=train plans its own programs on its own devices before loading weights and refuses
        # to start when a phase will not fit. auto: where the devices report a memory limit (TPU,
        # GPU); always: also elsewhere (needs device_memory_bytes); never: skip.
        check_before_train="auto",
        device_memory_bytes=0,  # per device; 0 = the device's own limit (memory_stats()["bytes_limit"])
        # Step time (llds_jax.plan.step_time): seconds per phase of one step on the target.
        step_time=True,
        length_source="",        # "" = Search-R1 3B reference lengths (bundled); a run dir = its samples.jsonl
        # Retrieval (llds_jax.plan.retrieval): seconds per call from the configured backend's cost model.
        retrieval_s=0.0,         # > 0: a flat charge per batched retriever call instead of the backend's model
        host_flops=0.0,          # the retrieval host's FLOP/s on a faiss Flat search; 0 = measured here a thread x the target host's vCPUs
        index_passages=21_015_324,  # the index's passages when the configured one cannot be read: wiki-18 (Search-R1's corpus)
        index_dim=768,           # its vector width when unreadable: E5-base (Search-R1's e5_Flat.index)
        checkpoint_bytes_per_s=1e9,  # per host, writing the train state
        efficiency_matmul=0.0,   # fraction of peak FLOP/s of the update/log-prob/prefill; 0 = per platform
        efficiency_hbm=0.0,      # fraction of HBM bandwidth of the decode; 0 = per platform
        decode_step_overhead_s=-1.0,  # fixed seconds per decode step on top of its bytes; < 0 = per platform
        json_out="",             # also write the whole plan (memory and step_time_s) as JSON here
    ))


def validate(section) -> None:
    """The ``plan`` section's own values, checked before anything is compiled or loaded."""
    for field in ("retrieval_s", "host_flops", "checkpoint_bytes_per_s", "efficiency_matmul", "efficiency_hbm"):
        value = section[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise PlanError(f"plan.{field}={value!r} must be a number ≥ 0")
    for field in ("efficiency_matmul", "efficiency_hbm"):
        if section[field] > 1:
            raise PlanError(f"plan.{field}={section[field]!r} is a fraction of peak: at most 1 (0 = per platform)")
    for field in ("index_passages", "index_dim"):
        value = section[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"plan.{field}={value!r} must be a positive integer")
    for field in ("devices", "rollout_batch", "device_memory_bytes"):
        value = section[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"plan.{field}={value!r} must be an integer ≥ 0")
    if section.check_before_train not in CHECK_MODES:
        raise PlanError(f"plan.check_before_train={section.check_before_train!r} is not one of {CHECK_MODES}")
    if unknown := [p for p in section.phases if p not in PHASES]:
        raise PlanError(f"plan.phases has unknown phases {unknown}; known: {PHASES}")
    if unknown := [h for h in section.hardware if h not in HARDWARE]:
        raise PlanError(f"plan.hardware has unknown entries {unknown}; known: {tuple(HARDWARE)}")
    if section.topology and section.gpu:
        raise PlanError(f"plan.topology={section.topology!r} and plan.gpu={section.gpu!r}: set one of them")
    if section.topology:
        parse_topology(str(section.topology))
