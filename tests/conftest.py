"""Every test process sees 8 simulated CPU devices, so sharding mistakes fail on CPU."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.exists():
        pytest.fail(f"tests need ../shared beside the checkout (looked in {SHARED})")
    return SHARED


@pytest.fixture(scope="session")
def qwen_tokenizer(shared_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(shared_dir / "assets" / "qwen2_tokenizer"))
