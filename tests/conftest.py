"""Every test process sees 8 simulated CPU devices, so sharding mistakes fail on CPU."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections import Counter  # noqa: E402
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


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the collected tests in reverse order (every test must pass in any order)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the code-generator marks must be on
def pytest_collection_modifyitems(config, items):
    """Mark the tests ``tests/codegen_sensitive.py`` names; put the modules holding ``slow`` tests first (most first), so
    that under ``-n 2 --dist loadscope --no-loadscope-reorder`` (``launch/test.sh``) the longest modules
    start at once and the many short ones fill both workers at the end; ``--reverse-order`` reverses it all."""
    import ast  # noqa: PLC0415

    from tests.codegen_sensitive import ALL, CODEGEN_SENSITIVE, DEFAULT_CODEGEN_ONLY  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    collected = {item.nodeid.split("::")[0] for item in items}
    for listed in (CODEGEN_SENSITIVE, DEFAULT_CODEGEN_ONLY):  # a renamed test must not drop out silently
        for module, names in listed.items():
            if names is ALL or module not in collected:
                continue
            tree = ast.parse((root / module).read_text(encoding="utf-8"))
            if missing := sorted(set(names) - {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}):
                raise pytest.UsageError(f"tests/codegen_sensitive.py names {missing} in {module}, which defines none of them")
    for marker, listed in (("codegen_sensitive", CODEGEN_SENSITIVE), ("default_codegen_only", DEFAULT_CODEGEN_ONLY)):
        for item in items:
            names = listed.get(item.nodeid.split("::")[0])
            if names is ALL or (names is not None and item.originalname in names):
                item.add_marker(getattr(pytest.mark, marker))
    slow_tests = Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[item.nodeid.split("::")[0]])  # stable: file order otherwise
    if config.getoption("--reverse-order"):
        items.reverse()
