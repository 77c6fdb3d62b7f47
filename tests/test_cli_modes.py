"""Every ``--mode`` of ``python -m llds_jax.main`` as a real process: exit 0 on success, 2 with one
``error:`` line naming the problem on bad input. Scripts and launchers chain these commands, so
the status is the contract (absl's ``app.run`` used to turn a mode's returned path into status 1).

One tiny training run (random tiny model, real tokenizer, bundled BM25 corpus) feeds the modes
that read a run: eval loads its HF export, report reads its metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.codegen_sensitive import child_xla_flags

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.integration]

TINY_CONFIG = '''
import sys
sys.path.insert(0, {helpers!r})
from train_helpers import tiny_loop_config

def get_config():
    c = tiny_loop_config({workdir!r}, {tokenizer!r})
    c.mesh.shape = (1, 1, 1)
    c.train.total_steps, c.train.warmup_sft_steps = 1, 1
    return c
'''

SWEEP_CONFIG = '''
import ml_collections

def get_config():
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(dict(base_config={base!r}, workdir_root={root!r}, launch=False,
                                             num_devices=1, grid=(("rl.llds_coef", (0.0, 0.1)),)))
    return c
'''


def run_main(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")  # one CPU device, as a user has
    return subprocess.run([sys.executable, "-m", "llds_jax.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def assert_exit(result: subprocess.CompletedProcess, code: int) -> None:
    assert result.returncode == code, (
        f"{' '.join(result.args[2:])}: exit {result.returncode}, expected {code}\n"
        f"stdout tail:\n{result.stdout[-2000:]}\nstderr tail:\n{result.stderr[-3000:]}")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, shared_dir) -> Path:
    root = tmp_path_factory.mktemp("cli")
    path = root / "tiny.py"
    path.write_text(TINY_CONFIG.format(helpers=str(REPO / "tests" / "train"), workdir=str(root / "run"),
                                       tokenizer=str(shared_dir / "assets" / "qwen2_tokenizer")))
    return path


@pytest.fixture(scope="module")
def trained_run(tiny_config) -> Path:
    result = run_main("--mode=train", f"--config={tiny_config}")
    assert_exit(result, 0)
    workdir = tiny_config.parent / "run"
    assert json.loads((workdir / "summary.json").read_text())["rl_steps"] == 1
    return workdir


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, shared_dir) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "head.jsonl"
    with open(shared_dir / "data" / "corpus" / "wiki18_subset.jsonl", encoding="utf-8") as src:
        path.write_text("".join(next(src) for _ in range(300)), encoding="utf-8")
    return path


def exported(run: Path) -> Path:
    exports = sorted((run / "hf").glob("step_*/config.json"))
    assert exports, f"{run}/hf holds no exported step"
    return exports[-1].parent


def test_train_exits_zero(trained_run):
    assert exported(trained_run)


def test_sft_exits_zero(tiny_config, tmp_path):
    # 2 steps (sft.steps defaults to 20): run_sft's check that the step compiled once still sees a second step.
    result = run_main("--mode=sft", f"--config={tiny_config}", f"--config.workdir={tmp_path}", "--config.sft.steps=2")
    assert_exit(result, 0)
    assert list(tmp_path.rglob("config.json")), "sft exported no HF directory"


def test_eval_exits_zero(trained_run, tiny_config, tmp_path):
    result = run_main("--mode=eval", f"--config={tiny_config}", f"--config.workdir={tmp_path}",
                      f"--config.model.source={exported(trained_run)}")
    assert_exit(result, 0)
    assert list(tmp_path.rglob("*.md")) or list(tmp_path.rglob("*.json")), "eval wrote no table"


def test_report_exits_zero(trained_run):
    result = run_main("--mode=report", "--config=configs/cpu_smoke.py", f"--config.workdir={trained_run}")
    assert_exit(result, 0)
    assert list(trained_run.rglob("*.png")), "report drew nothing"


PROBE_SECTION = '''

_tiny_job = get_config


def get_config():  # 2 probed questions, not the default 32: 64 rollouts at a wave width of their own
    from llds_jax.lab.probe import default_probe_config

    c = _tiny_job()
    c.probe = default_probe_config()
    c.probe.questions = 2
    return c
'''


def test_probe_exits_zero_and_writes_probe_json_and_a_run_without_checkpoints_exits_2(trained_run, tiny_config,
                                                                                    tmp_path):
    config = tmp_path / "probe_config.py"
    config.write_text(tiny_config.read_text() + PROBE_SECTION)
    result = run_main("--mode=probe", f"--config={config}", f"--config.workdir={trained_run}")
    assert_exit(result, 0)
    probes = sorted(trained_run.glob("probe/*/probe.json"))
    assert probes and "lld_share" in json.loads(probes[-1].read_text())
    result = run_main("--mode=probe", f"--config={config}", f"--config.workdir={tmp_path}")
    assert_exit(result, 2)
    assert "checkpoints does not exist" in result.stderr


def test_report_without_a_run_exits_2_naming_the_file_and_the_flag(tmp_path):
    result = run_main("--mode=report", "--config=configs/cpu_smoke.py", f"--config.workdir={tmp_path / 'never_ran'}")
    assert_exit(result, 2)
    assert "error: --mode=report" in result.stderr and "never_ran/metrics.jsonl" in result.stderr, result.stderr[-2000:]
    assert "--config.workdir" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_plan_exits_zero(tiny_config):
    result = run_main("--mode=plan", f"--config={tiny_config}")
    assert_exit(result, 0)
    assert "update" in result.stdout, result.stdout[-2000:]


def test_plan_sizes_the_default_job_from_its_gguf_without_loading_weights():
    """The shapes come from the GGUF's header: the resident state and the step time follow from them. No phase
    is compiled (``plan.phases=()``): compiling every phase is ``test_plan_exits_zero``'s (a tiny model) and
    ``tests/scale/test_plan.py``'s; at SmolLM2's size they cost ≈ 68 CPU-s here and were not checked."""
    result = run_main("--mode=plan", f"--config={REPO / 'configs' / 'cpu_smoke.py'}", "--config.plan.devices=1",
                      "--config.plan.phases=()")
    assert_exit(result, 0)
    assert "smollm2 (30 layers, d=576), 0.135 B parameters" in result.stdout, result.stdout[-2000:]
    assert re.search(r"^  params +0\.54$", result.stdout, re.M), result.stdout[-2000:]  # 0.135 B fp32 masters


def test_sweep_exits_zero_and_a_bad_grid_exits_2(tiny_config, tmp_path):
    sweep = tmp_path / "sweep.py"
    sweep.write_text(SWEEP_CONFIG.format(base=str(tiny_config), root=str(tmp_path / "runs")))
    result = run_main("--mode=sweep", f"--config={sweep}")
    assert_exit(result, 0)
    assert result.stdout.count("llds_jax.main") >= 2, result.stdout[-2000:]
    bad = run_main("--mode=sweep", f"--config={sweep}", "--config.sweep.base_config=/no/such/config.py")
    assert_exit(bad, 2)
    assert "/no/such/config.py" in bad.stderr, bad.stderr[-2000:]


def test_sweep_with_an_unknown_llds_gate_exits_2_naming_the_field_before_any_run(tiny_config, tmp_path):
    sweep = tmp_path / "sweep_gate.py"
    sweep.write_text(SWEEP_CONFIG.format(base=str(tiny_config), root=str(tmp_path / "runs")).replace(
        '(("rl.llds_coef", (0.0, 0.1)),)', '(("rl.llds_gate", ("action", "acton")),)'))
    result = run_main("--mode=sweep", f"--config={sweep}")
    assert_exit(result, 2)
    assert "error: --mode=sweep" in result.stderr and "rl.llds_gate = 'acton'" in result.stderr, result.stderr[-2000:]
    assert "sweep run 'llds_gate=acton'" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), "a sweep run started before every grid point was validated"


def test_train_with_sizes_that_do_not_divide_exits_2_naming_the_field(tiny_config):
    result = run_main("--mode=train", f"--config={tiny_config}", "--config.train.mini_batch_size=3")
    assert_exit(result, 2)
    assert "mini_batch_size" in result.stderr, result.stderr[-2000:]


def test_index_exits_zero_and_a_missing_corpus_exits_2(small_corpus, tmp_path):
    result = run_main("--mode=index", "--config=configs/retriever.py", f"--config.retrieval.corpus_path={small_corpus}",
                      f"--config.retrieval.index_path={tmp_path / 'bm25'}")
    assert_exit(result, 0)
    missing = tmp_path / "missing.jsonl"
    bad = run_main("--mode=index", "--config=configs/retriever.py", f"--config.retrieval.corpus_path={missing}",
                   f"--config.retrieval.index_path={tmp_path / 'bm25_missing'}")
    assert_exit(bad, 2)
    assert str(missing) in bad.stderr, bad.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_exits_zero_when_stopped(small_corpus, tmp_path):
    """A service stopped by SIGTERM (what a job scheduler sends) or SIGINT (Ctrl-C) shuts down cleanly."""
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(), JAX_PLATFORMS="cpu")
    for stop in (signal.SIGTERM, signal.SIGINT):
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "llds_jax.main", "--mode=serve", "--config=configs/retriever.py",
             f"--config.retrieval.corpus_path={small_corpus}", f"--config.retrieval.index_path={tmp_path / 'bm25'}",
             f"--config.retrieval.port={port}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            assert proc.poll() is None, f"service exited {proc.returncode} before serving:\n{proc.stdout.read()[-3000:]}"
            proc.send_signal(stop)
            output, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, f"serve stopped by {stop.name}: exit {proc.returncode}\n{output[-3000:]}"


def test_train_that_will_not_fit_exits_2_before_loading_weights(tiny_config):
    result = run_main("--mode=train", f"--config={tiny_config}", "--config.plan.check_before_train=always",
                      "--config.plan.device_memory_bytes=100000", "--config.rollout.max_concurrent_rows=4")
    assert_exit(result, 2)
    assert "update:" in result.stderr and "train.micro_batch_size" in result.stderr, result.stderr[-2000:]
    assert "retriever ready" not in result.stdout, "the weights were loaded before the fit check"


def _config_of(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_replay_exits_zero_on_equal_feedback_one_on_a_changed_block_and_two_without_samples(tiny_config, tmp_path,
                                                                                           qwen_tokenizer):
    """``--mode=replay`` asks the configured retriever the recorded searches again (the comparison itself:
    ``tests/rollout/test_feedback_replay.py``); the recorded block here is built in-process from the same
    config, so 0 needs the process to build the same retriever, cut and tokenizer."""
    from llds_jax.retrieval.factory import build_retriever
    from llds_jax.rollout import protocol
    from llds_jax.sampling.token_bytes import decode_text, vocab_bytes

    config = _config_of(tiny_config)
    retriever = build_retriever(config.retrieval, qwen_tokenizer)
    (feedback,) = protocol.batch_search_feedback(retriever, ["album"], config.rollout.topk)
    block = decode_text(protocol.encode_feedback(qwen_tokenizer, feedback, config.rollout.max_obs_tokens),
                        vocab_bytes(qwen_tokenizer))
    for name, recorded in (("equal", block), ("changed", block.replace("Doc 1(Title:", "Doc 1(Title: x", 1))):
        (tmp_path / name).mkdir()
        response = f"<search> album </search>{recorded}<answer> a </answer>"
        (tmp_path / name / "samples.jsonl").write_text(json.dumps({"response": response}) + "\n")
    method = config.retrieval.method
    equal = run_main("--mode=replay", f"--config={tiny_config}", f"--config.workdir={tmp_path / 'equal'}")
    assert_exit(equal, 0)
    assert f"replay over retrieval.method={method}: 1 of 1 feedback blocks equal" in equal.stdout, equal.stdout[-2000:]
    changed = run_main("--mode=replay", f"--config={tiny_config}", f"--config.workdir={tmp_path / 'changed'}")
    assert_exit(changed, 1)
    assert "differs: sample 0 turn 0 query 'album'" in changed.stdout, changed.stdout[-2000:]
    assert json.loads((tmp_path / "changed" / f"replay_{method}.json").read_text())["equal"] == 0
    missing = run_main("--mode=replay", f"--config={tiny_config}", f"--config.workdir={tmp_path / 'never_ran'}")
    assert_exit(missing, 2)
    assert "never_ran/samples.jsonl does not exist" in missing.stderr, missing.stderr[-2000:]
