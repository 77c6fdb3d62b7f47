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


TIERS = ("unit", "integration")


def _tier(item) -> str:
    """The closest tier marker: the test's own (a decorator or ``pytest.param(marks=...)``), else its class's,
    else its module's ``pytestmark``; ValueError when there is none, or both at one level, or a slow unit test."""
    for node in reversed(item.listchain()):
        found = {mark.name for mark in node.own_markers} & set(TIERS)
        if len(found) == 2:
            raise ValueError(f"{item.nodeid}: marked both unit and integration ({node.nodeid or node.name})")
        if found:
            tier = found.pop()
            if tier == "unit" and item.get_closest_marker("slow"):
                raise ValueError(f"{item.nodeid} is marked slow and unit: a slow test is integration")
            return tier
    raise ValueError(
        f"{item.nodeid} has no tier: give its module `pytestmark = pytest.mark.unit` (in-process, fast) or "
        "`pytest.mark.integration` (child processes, whole jobs, real weights, compile-only TPU/GPU programs), "
        "or mark the test itself where its module mixes both")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """The tier check, as a collection error of the module (or class) holding the test: it stops the session
    before any test runs, with or without ``-m``, and pytest-xdist reports it with its message (a UsageError
    raised in a worker comes back as an unexplained INTERNALERROR)."""
    report = yield
    if report.passed:
        problems = []
        for node in report.result:
            if isinstance(node, pytest.Item):
                try:
                    _tier(node)
                except ValueError as error:
                    problems.append(str(error))
        if problems:
            report.outcome, report.longrepr = "failed", "\n".join(problems)
    return report


def _settle_tiers(items) -> None:
    """Each test keeps exactly one tier marker: a test's own overrides its module's, so that ``-m unit`` and
    ``-m integration`` split the suite (``-m`` reads the markers of the test and of every node above it)."""
    tiers = {item: _tier(item) for item in items}
    for item, tier in tiers.items():
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
        item.add_marker(tier)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: each test must carry its one tier by then
def pytest_collection_modifyitems(config, items):
    """Settle each test's tier (``unit`` / ``integration``, checked at collection); put the modules holding ``slow`` tests
    first (most first), so that under ``-n 2 --dist loadscope --no-loadscope-reorder`` (``launch/test.sh``) the
    longest modules start at once and the many short ones fill both workers at the end; ``--reverse-order``
    reverses it all."""
    _settle_tiers(items)
    slow_tests = Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[item.nodeid.split("::")[0]])  # stable: file order otherwise
    if config.getoption("--reverse-order"):
        items.reverse()
