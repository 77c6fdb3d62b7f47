"""Compile-only targets of ``--mode=plan``: real XLA:TPU / XLA:GPU compilers on a CPU-only host.

* ``plan.topology="v5e:8x8"`` — JAX's TPU plugin (``libtpu``, ``pip install '.[plan-tpu]'``)
  describes any TPU slice without a TPU attached
  (``jax.experimental.topologies.get_topology_desc(topology, "tpu")``, as MaxText's
  ``train_compile.py`` does); programs lowered on a mesh of those devices are compiled by
  XLA:TPU for that chip, and its ``memory_analysis`` is the TPU's.
* ``plan.gpu="h100"`` (or ``"h200"``, or a path to a ``GpuTargetConfigProto`` text file) with
  ``plan.devices`` GPUs, ``plan.gpus_per_host`` per host — the CUDA PJRT plugin
  (``pip install '.[plan-gpu]'``) builds a compile-only GPU topology from a target config
  (``get_topology_desc(platform="cuda", topology="1xHOSTSxPER_HOST", target_config=TEXT)``) and
  XLA:GPU compiles for that GPU without a driver (no autotuning: default kernel choices).

Without the package a plan falls back to XLA:CPU on as many simulated devices and says so.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
from pathlib import Path

from llds_jax.errors import InputError

# The leading fields of XLA's specs (xla/backends/gpu/target_config/specs/h100_sxm.txtpb,
# h200.txtpb) that the jax-cuda12 0.10.2 plugin parses; device_memory_size is the HBM the
# driver reports.
_SM90 = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{name}"
"""
GPU_TARGETS: dict[str, str] = {
    "h100": _SM90.format(bandwidth=3352320000000, memory=84942979072, name="NVIDIA H100 80GB HBM3"),
    "h200": _SM90.format(bandwidth=4800000000000, memory=151397597184, name="NVIDIA H200 141GB HBM3e"),
}
# libtpu's own pattern for topology names, e.g. v5e:4x4, v5p:2x2x1, v6e:8x8.
_TOPOLOGY = re.compile(r"^(?P<chip>[A-Za-z0-9_ ]+):(?P<dims>\d+(?:x\d+){1,2})(?:_twisted|_untwisted)?$")
# Which HARDWARE row (plan.HARDWARE) a compiled device kind is.
DEVICE_KIND_TO_HARDWARE = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "NVIDIA H100 80GB HBM3": "H100",
                           "NVIDIA H200 141GB HBM3e": "H200"}


class PlanError(InputError):
    """A plan that cannot be made as configured; the message names the field and value."""


class NeedsFreshProcess(Exception):
    """This process cannot build the target (CPU device count fixed, or the CUDA plugin was
    skipped at start-up); the plan reruns in ``python -m llds_jax.plan.run`` with
    ``JAX_PLATFORMS=cpu`` and ``args[0]`` simulated CPU devices."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the plan compiles for."""
    platform: str                 # "tpu", "gpu" or "cpu"
    devices: tuple | None         # compile-only devices; None = this process's (simulated) CPU devices
    count: int
    compiler: str                 # printed in the table
    note: str = ""                # why the plan fell back to XLA:CPU, if it did
    hardware: str = ""            # the HARDWARE row the compiler targeted ("" = none)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package ("jax_plugins")
        return False


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    match = _TOPOLOGY.match(topology)
    if not match:
        raise PlanError(f"plan.topology={topology!r}: expected CHIP:AxB or CHIP:AxBxC "
                        f"(e.g. 'v5e:8x8', 'v5p:2x2x1', 'v6e:4x4')")
    return match["chip"], tuple(int(d) for d in match["dims"].split("x"))


def tpu_target(topology: str) -> Target:
    """The compile-only devices of a TPU slice; XLA:CPU fallback when libtpu is not installed."""
    _, dims = parse_topology(topology)
    from jax._src.lib import _jax  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    # Compile-only: no chip is claimed, so concurrent plans need not queue on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = topologies.get_topology_desc(topology, "tpu").devices
    except RuntimeError as err:
        if "not installed" not in str(err) or isinstance(err, _jax.JaxRuntimeError):
            raise PlanError(f"plan.topology={topology!r}: libtpu rejected it: {err}") from err
        chips = math.prod(dims)
        return Target("cpu", None, chips, f"XLA:CPU SPMD, {chips} simulated devices (proxy for {topology})",
                      note=f"plan.topology={topology!r}: JAX TPU support (libtpu) is not installed "
                           f"(pip install '.[plan-tpu]'); compiled with XLA:CPU for {chips} simulated "
                           f"devices instead — temporaries are a proxy")
    kind = devices[0].device_kind
    hosts = len({d.process_index for d in devices})
    return Target("tpu", tuple(devices), len(devices),
                  f"XLA:TPU (libtpu {_version('libtpu')}), topology {topology}: {len(devices)} x {kind}, "
                  f"{hosts} host(s)", hardware=DEVICE_KIND_TO_HARDWARE.get(kind, ""))


def gpu_target(gpu: str, count: int, per_host: int) -> Target:
    """Compile-only NVIDIA GPUs from a target config; XLA:CPU fallback without the CUDA plugin."""
    if gpu.lower() in GPU_TARGETS:
        config_text = GPU_TARGETS[gpu.lower()]
    elif gpu.endswith((".txtpb", ".pbtxt", ".textproto")) and Path(gpu).is_file():
        config_text = Path(gpu).read_text()
    else:
        raise PlanError(f"plan.gpu={gpu!r}: expected one of {sorted(GPU_TARGETS)} or the path of a "
                        f"GpuTargetConfigProto text file (.txtpb)")
    if count < 1 or per_host < 1:
        raise PlanError(f"plan.devices={count}, plan.gpus_per_host={per_host}: both must be ≥ 1 for plan.gpu")
    per_host = min(per_host, count)
    if count % per_host:
        raise PlanError(f"plan.devices={count} is not a multiple of plan.gpus_per_host={per_host}")
    if not _importable("jax_plugins.xla_cuda12"):
        return Target("cpu", None, count, f"XLA:CPU SPMD, {count} simulated devices (proxy for {gpu})",
                      note=f"plan.gpu={gpu!r}: the CUDA PJRT plugin is not installed "
                           f"(pip install '.[plan-gpu]'); compiled with XLA:CPU for {count} simulated "
                           f"devices instead — temporaries are a proxy")
    import jax  # noqa: PLC0415
    from jax._src.lib import _jax  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    # The plugin registers itself only after a CUDA version check, which fails on a host
    # without CUDA and is skipped when JAX_PLATFORMS=cpu: compile in such a process.
    if jax.config.jax_platforms != "cpu":
        raise NeedsFreshProcess(count)
    shape = f"1x{count // per_host}x{per_host}"
    try:
        devices = topologies.get_topology_desc(gpu, "cuda", target_config=config_text, topology=shape).devices
    except NotImplementedError as err:
        raise PlanError(f"plan.gpu={gpu!r}: the CUDA plugin did not register ({err})") from err
    except _jax.JaxRuntimeError as err:
        raise PlanError(f"plan.gpu={gpu!r} with topology {shape}: the CUDA plugin rejected it: {err}") from err
    kind = devices[0].device_kind
    return Target("gpu", tuple(devices), len(devices),
                  f"XLA:GPU (jax-cuda12-pjrt {_version('jax-cuda12-pjrt')}, compile-only, no autotuning), "
                  f"{len(devices)} x {kind}, {count // per_host} host(s) x {per_host}",
                  hardware=DEVICE_KIND_TO_HARDWARE.get(kind, ""))


def resolve_target(section) -> Target:
    """The target named by the ``plan`` config section (``topology``, ``gpu``, ``devices``)."""
    topology, gpu = str(section.topology), str(section.gpu)
    if topology and gpu:
        raise PlanError(f"plan.topology={topology!r} and plan.gpu={gpu!r}: set one of them")
    if topology:
        return tpu_target(topology)
    if gpu:
        return gpu_target(gpu, int(section.devices) or 8, int(section.gpus_per_host))
    count = int(section.devices)
    return Target("cpu", None, count, f"XLA:CPU SPMD, {count} devices")


def target_installed(platform: str) -> str:
    """'' when the compile-only target of ``platform`` ("tpu"/"gpu") is installed, else why not."""
    package = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}[platform]
    if not _importable(package):
        return f"{package} is not installed (pip install '.[plan-{platform}]')"
    return ""
