"""One config section = one default: no ``.get("<field>", <default>)`` restating a declared default.

Every field a run reads is declared once, with its default and its comment, in ``base_config()``
(``llds_jax/config.py`` and the sections it embeds: ``rl/config.py``, ``rollout/config.py``,
``retrieval/config.py``, ``plan/config.py``, ``parallel/distributed.py``). A reader that writes
``section.get("field", default)`` states a second default that silently wins wherever the field is
missing, and drifts: before issue 60, ``train.get("packing", False)`` disagreed with the declared
``True`` and ``rollout.get("prefill_chunk", 0)`` with the declared 512. Readers therefore use plain
attribute access. This test scans the source with ``ast`` and fails on a two-argument ``.get``
whose key is a declared field, except the sites in :data:`ALLOWED`, each with its reason.

It also pins the one TensorBoard switch: ``train.loggers``; a config that still sets the removed
``train.tensorboard`` fails validation naming it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from llds_jax.config import base_config, validate_sections
from llds_jax.errors import InputError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("llds_jax", "configs", "benchmarks", "tools")

# (file, field): why a `.get(field, default)` there does not restate a declared section default.
ALLOWED = {
    ("llds_jax/models/loading.py", "seed"): "model.seed is no declared model field (the run's seed is the "
                                            "top-level one): a `random:` source's init seed, 0 unless a config adds it",
    ("llds_jax/train/loop.py", "retrieval_s"): "the rollout's timings dict, not the plan section's retrieval_s",
    ("benchmarks/device_check.py", "phases"): "a plan.json read back from disk, not the plan section",
}


def declared_fields() -> set[str]:
    """Every field of every section of ``base_config()``, plus its top-level scalars (``seed``, ``resume``)."""
    fields = set()
    for name, value in base_config().items():
        fields.update(value.keys() if hasattr(value, "keys") else [name])
    return fields


def restated_in(tree: ast.AST, fields: set[str]) -> list[ast.Call]:
    """The ``x.get("<field in fields>", <default>)`` calls of ``tree``."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and len(node.args) + len(node.keywords) == 2 and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value in fields]


def restated_defaults() -> list[tuple[str, int, str, str]]:
    """(file, line, field, source) of each restated default under :data:`SCANNED`."""
    fields, found = declared_fields(), []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in restated_in(ast.parse(path.read_text(encoding="utf-8"), str(path)), fields):
                found.append((path.relative_to(ROOT).as_posix(), node.lineno, node.args[0].value, ast.unparse(node)))
    return found


def test_no_reader_restates_a_declared_default():
    offenders = [f"{file}:{line}: {source}" for file, line, field, source in restated_defaults()
                 if (file, field) not in ALLOWED]
    assert not offenders, ("these `.get(field, default)` restate a default base_config() declares; read the "
                           "attribute (or add the site to ALLOWED with its reason):\n" + "\n".join(offenders))


def test_every_allowed_site_still_exists():
    """A stale allow-list entry would silently excuse a future offender in the same file."""
    present = {(file, field) for file, _, field, _ in restated_defaults()}
    assert set(ALLOWED) <= present, sorted(set(ALLOWED) - present)


def test_the_scan_sees_a_restated_default():
    """Guard against a vacuous pass: the matcher flags the pattern it exists for, and only that."""
    source = ('config.train.get("packing", False)\nconfig.rollout.get("engine")\n'
              'timings.get("total_s", 0.0)\nconfig.train.packing\n')
    assert [ast.unparse(n) for n in restated_in(ast.parse(source), declared_fields())] == [
        "config.train.get('packing', False)"]


def test_train_loggers_is_the_one_tensorboard_switch():
    c = base_config()
    assert "tensorboard" not in c.train and tuple(c.train.loggers) == ("tensorboard",)
    c.train.tensorboard = False  # what an older config file still says
    with pytest.raises(InputError, match=re.escape("train.tensorboard=False was removed: train.loggers")):
        validate_sections(c)
