"""The lab cache: a finished artifact is reused, an interrupted build leaves nothing behind."""

import pytest

from llds_jax.lab.prepare import _built, _digest

pytestmark = pytest.mark.unit


def test_a_built_artifact_is_reused_without_calling_the_builder(tmp_path):
    calls = []

    def build(directory):
        calls.append(directory)
        (directory / "done").write_text("x")

    target = tmp_path / "world-abc"
    assert _built(target, build) == target and (target / "done").read_text() == "x"
    _built(target, build)
    assert len(calls) == 1, f"builder ran {len(calls)} times for an existing artifact"


def test_a_failed_build_leaves_no_artifact_and_no_temporary_directory(tmp_path):
    def build(directory):
        (directory / "half").write_text("x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        _built(tmp_path / "policy-abc", build)
    assert list(tmp_path.iterdir()) == []


def test_the_digest_changes_with_any_setting_and_not_with_key_order():
    assert _digest({"a": 1, "b": 2}) == _digest({"b": 2, "a": 1})
    assert _digest({"a": 1, "b": 2}) != _digest({"a": 1, "b": 3})


def _record(directory, one_hop_em):
    import json

    directory.mkdir()
    check = {"nq": {"em": one_hop_em}, "hotpotqa": {"em": 0.0}}
    (directory / "lab_build.json").write_text(json.dumps({"check": check}))
    return directory


def test_the_build_gate_fails_naming_the_record_its_em_and_the_setting(tmp_path):
    from llds_jax.lab.prepare import PolicyBelowGateError, check_build_gate

    low = _record(tmp_path / "policy-low", 0.0625)
    with pytest.raises(PolicyBelowGateError, match=r"lab_build.json has greedy EM .*0\.062 < lab.policy.min_build_em=0.3"):
        check_build_gate(low, 0.3)
    check_build_gate(low, 0.0)  # no gate
    check_build_gate(_record(tmp_path / "policy-ok", 0.3), 0.3)


def test_a_gate_without_a_recorded_check_is_an_error_not_a_pass(tmp_path):
    from llds_jax.lab.prepare import PolicyBelowGateError, check_build_gate

    (tmp_path / "p").mkdir()
    with pytest.raises(PolicyBelowGateError, match="check_questions"):
        check_build_gate(tmp_path / "p", 0.3)
