"""Two localhost processes joined by jax.distributed train exactly like one 8-device process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from llds_jax.train.checkpoint import Checkpointer, with_shardings
from tests.codegen_sensitive import child_xla_flags
from tests.scale import toy_train
from tests.scale.multihost_worker import STEPS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(module: str, out_dir: Path, timeout: float = 300, args: list[str] | None = None,
                      expect_codes: tuple[int, int] = (0, 0)) -> None:
    """Start process 0 and 1 of ``python -m module out_dir`` (or ``module *args``).

    Fails with both logs unless the exit statuses are ``expect_codes``.
    """
    args = [str(out_dir)] if args is None else args
    port = free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(4),
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
        log = open(out_dir / f"process_{pid}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        codes = [p.wait(timeout=timeout) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if tuple(codes) != tuple(expect_codes):
        logs = "\n".join(f"--- process {i} (exit {c}) ---\n{(out_dir / f'process_{i}.log').read_text()[-3000:]}"
                         for i, c in enumerate(codes))
        pytest.fail(f"multi-process run ended with {codes}, expected {list(expect_codes)}:\n{logs}")


@pytest.mark.slow
def test_two_processes_match_single_process_8_devices(tmp_path):
    run_two_processes("tests.scale.multihost_worker", tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    multi_params = dict(np.load(tmp_path / "params.npz"))

    mesh = toy_train.make_mesh((2, 4))
    state = toy_train.init_state(0, mesh)
    step_fn = toy_train.jit_train_step(mesh)
    losses = []
    for step in range(STEPS):
        state, loss = step_fn(state, *toy_train.batch(step))
        losses.append(float(loss))

    # Process 0 owns the first half of the batch rows; metrics were summed over both hosts.
    assert result["rows"] == [0, toy_train.BATCH // 2]
    assert result["host_metrics"] == {"rows": toy_train.BATCH, "hosts": 2.0, "big_count": 2.0**41 + 1}
    # Cross-process (gloo) and in-process all-reduces sum in different orders: equal up to
    # float32 rounding, which Adam's g/sqrt(v) can lift to ~1e-7 absolute on 0.1-sized weights.
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-6)
    for name, value in state["params"].items():
        np.testing.assert_allclose(multi_params[name], np.asarray(value), rtol=1e-5, atol=1e-6,
                                   err_msg=f"param {name}: 2 processes vs 1 process")

    # The checkpoint both processes wrote restores in one process onto another mesh shape.
    target = toy_train.make_mesh((1, 8))
    abstract = with_shardings(jax.eval_shape(toy_train.init_state_host, 0), toy_train.state_shardings(target))
    restored = Checkpointer(tmp_path / "run").restore_latest(abstract)
    assert restored.step == STEPS and restored.extra == {"rows_of_process_0": [0, toy_train.BATCH // 2]}
    for name, value in restored.state["params"].items():
        np.testing.assert_array_equal(np.asarray(value), multi_params[name])


@pytest.mark.slow
def test_trainer_update_step_in_two_processes_equals_one_process(tmp_path):
    """Acceptance: ``Learner.update`` with each host's own rows, two jax.distributed processes vs one with 8 devices,
    both on packed rows (the one-process packed step equals the padded one: tests/train/test_packing.py)."""
    from llds_jax.train.batch import TrainBatch
    from tests.scale.test_resume_trainer_state import learner_on, rollout
    from tests.scale.trainer_step_worker import MESH

    run_two_processes("tests.scale.trainer_step_worker", tmp_path)
    multi_metrics = dict(np.load(tmp_path / "metrics.npz"))
    multi_params = np.load(tmp_path / "params.npz")
    assert (tmp_path / "rows.txt").read_text() == "0 8"  # process 0 fed half of the 16 trajectories
    hosts = [dict(np.load(tmp_path / f"host_{pid}.npz")) for pid in range(2)]
    assert [tuple(h["rows"]) for h in hosts] == [(0, 8), (8, 16)]

    learner = learner_on(MESH)
    initial = jax.tree.leaves(jax.tree.map(np.asarray, jax.device_get(learner.state.params)))
    arrays = rollout(seed=0)
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    logp_now = learner.logprobs_now(extra["batch"])
    advantages = extra["advantages"].copy()
    advantages[::2] = 0.0  # as the workers: Δ computed for the odd rows only, on both hosts' packed rows
    delta_sums = learner.step_reductions(extra["batch"], np.zeros((len(advantages), 2), np.float32), 2,
                                         with_delta=True, advantages=advantages)[0]["delta_logp"]
    params = jax.tree.leaves(jax.tree.map(np.asarray, jax.device_get(learner.state.params)))

    # Advantages come from the same all-gathered rewards: identical. Each host got its own rows back.
    np.testing.assert_array_equal(np.concatenate([h["advantages"] for h in hosts]), extra["advantages"])
    # Both pack (train.packing): two processes plan from the all-gathered lengths — the one-process
    # plan, so the same micro-batches — and scatter their own rows' tokens into rows spanning both hosts.
    assert learner.packing is not None
    want_counts = np.asarray(extra["batch"].packed.mini_count)
    want_pass_count = np.asarray(extra["batch"].packed_passes.mini_count)  # the no-grad passes' one group
    for h in hosts:
        np.testing.assert_array_equal(h["mini_count"], want_counts)
        np.testing.assert_array_equal(h["pass_count"], want_pass_count)
        assert h["compiles"].max() <= 1, "a jitted function compiled twice in one step"
    # Log-probs are computed on action targets only: compare where the objective reads.
    action = np.asarray(arrays["action_mask"]) > 0  # [N, SEQ]: every real token lies in these columns
    width = action.shape[1]
    for key, want in (("old_logp", extra["old_logp"]), ("logp_now", logp_now)):
        got = np.concatenate([h[key] for h in hosts])
        np.testing.assert_allclose(np.where(action, got[:, :width], 0.0), np.where(action, want[:, :width], 0.0),
                                   rtol=1e-5, atol=1e-5, err_msg=f"{key}: hosts' rows vs one process, on action tokens")
    # Δlog-prob metrics are differences of log-probs, so their rounding is the log-probs' (1e-5 of their size).
    logp_rounding = 1e-5 * float(np.max(np.abs(extra["old_logp"])))
    got = np.concatenate([h["delta_sums"] for h in hosts])
    assert (got[::2] == 0).all() and (delta_sums[::2] == 0).all() and (delta_sums[1::2] != 0).any()
    np.testing.assert_allclose(got, delta_sums, rtol=0, atol=logp_rounding * 7,  # a sum over an action's ≤ 7 tokens
                               err_msg="the Δ pass's per-action sums: hosts' rows vs one process")
    for name, value in extra["per_mini_batch"].items():
        atol = logp_rounding if name.startswith("delta_logp/") else 1e-7
        np.testing.assert_allclose(multi_metrics[name], value, rtol=1e-5, atol=atol, err_msg=f"metric {name}")
    # Metrics agree to fp32 rounding. Params: Adam's m/sqrt(v) turns the all-reduce order noise of a
    # near-zero gradient element into a visible part of an lr-sized (1e-3) step, so compare each
    # leaf's largest difference with its largest weight, and the update as a whole in L2.
    for i, (value, before) in enumerate(zip(params, initial)):
        got = multi_params[f"arr_{i}"]
        worst = np.max(np.abs(got - value)) / np.max(np.abs(value))
        assert worst <= 5e-4, f"param leaf {i}: max difference {worst:.2e} of its largest weight"
        update_gap = np.linalg.norm((got - before) - (value - before)) / np.linalg.norm(value - before)
        assert update_gap <= 1e-3, f"param leaf {i}: update differs by {update_gap:.2e} (relative L2)"
