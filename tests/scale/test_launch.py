"""launch/ scripts: syntax, the exact commands they would run (--dry-run), argument errors, restarts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["launch/_common.sh", "launch/gpu_node.sh", "launch/tpu_pod.sh", "launch/slurm.sbatch"]


def launch(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    if check and result.returncode:
        pytest.fail(f"bash {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def commands(result: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    launch("-n", script)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (bash -n and dry runs still cover syntax)")
@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_shellcheck(script):
    result = subprocess.run(["shellcheck", "-x", "-S", "warning", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_gpu_node_starts_retriever_on_cpu_then_trains_against_it():
    cmds = commands(launch("launch/gpu_node.sh", "--dry-run", "--config", "configs/qwen3b.py",
                           "--workdir", "runs/q3", "--port", "8123", "--", "--config.train.total_steps=7"))
    assert cmds == [
        ".venv/bin/python -m llds_jax.main --mode=serve --config=configs/retriever.py "
        "--config.retrieval.host=127.0.0.1 --config.retrieval.port=8123 > logs/retriever.log 2>&1 &"
        .replace(".venv/bin/python", "env JAX_PLATFORMS=cpu .venv/bin/python", 1),
        "wait for http://127.0.0.1:8123/health",
        ".venv/bin/python -m llds_jax.main --config=configs/qwen3b.py --config.retrieval.url=http://127.0.0.1:8123 "
        "--config.workdir=runs/q3 --config.train.total_steps=7",
    ]


def test_gpu_node_with_external_retriever_starts_nothing_else():
    cmds = commands(launch("launch/gpu_node.sh", "--dry-run", "--retriever-url", "http://ret:8000"))
    assert cmds == [".venv/bin/python -m llds_jax.main --config=configs/qwen3b.py --config.retrieval.url=http://ret:8000"]


def test_tpu_pod_runs_one_command_on_every_worker_with_auto_distributed():
    cmds = commands(launch("launch/tpu_pod.sh", "--dry-run", "--tpu", "llds-v5p", "--zone", "us-east5-a",
                           "--project", "proj", "--workdir", "gs://bucket/q3", "--", "--config.train.save_every=25"))
    scope = "--zone us-east5-a --project proj"
    assert cmds[0].startswith(f"gcloud compute tpus tpu-vm describe llds-v5p {scope}")
    assert cmds[1].startswith(f"gcloud compute tpus tpu-vm ssh llds-v5p {scope} --worker=0 '--command=")
    assert "--mode=serve" in cmds[1] and "--config.retrieval.host=0.0.0.0" in cmds[1]
    assert "/health" in cmds[2]
    train = cmds[3]
    assert train.startswith(f"gcloud compute tpus tpu-vm ssh llds-v5p {scope} --worker=all '--command=")
    for part in ("LLDS_DISTRIBUTED=auto", "--config=configs/qwen3b.py", "--config.workdir=gs://bucket/q3",
                 "--config.retrieval.url=http://<worker0-internal-ip>:8000", "--config.train.save_every=25"):
        assert part in train


def test_slurm_runs_one_task_per_node_and_has_preemption_headers():
    script = (REPO / "launch/slurm.sbatch").read_text()
    for header in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=TERM@", "#SBATCH --requeue"):
        assert header in script
    cmds = commands(launch("launch/slurm.sbatch", "--dry-run", "--config", "configs/qwen7b.py",
                           "--workdir", "/shared/q7", "--retriever-url", "http://ret:8000"))
    assert cmds == ["srun --kill-on-bad-exit=1 --ntasks-per-node=1 .venv/bin/python -m llds_jax.main "
                    "--config=configs/qwen7b.py --config.workdir=/shared/q7 --config.retrieval.url=http://ret:8000"]


@pytest.mark.parametrize("args, message", [
    (["launch/tpu_pod.sh", "--dry-run", "--zone", "z", "--workdir", "gs://b"], "--tpu NAME is required"),
    (["launch/tpu_pod.sh", "--dry-run", "--tpu", "t", "--zone", "z"], "--workdir is required"),
    (["launch/gpu_node.sh", "--dry-run", "--config", "configs/nope.py"], "--config configs/nope.py: no such file"),
    (["launch/gpu_node.sh", "--dry-run", "--max-restarts", "many"], "--max-restarts many: not a number"),
    (["launch/gpu_node.sh", "--dry-run", "--workdir"], "--workdir needs a value"),
    (["launch/gpu_node.sh", "--dry-run", "--bogus"], "unknown option --bogus"),
    (["launch/slurm.sbatch", "--workdir", "/w"], "not inside a SLURM allocation"),
])
def test_bad_arguments_fail_with_a_message(args, message):
    result = launch(*args, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_failed_training_is_restarted_then_gives_up(tmp_path):
    """with_restarts reruns the command (which resumes from its checkpoint) up to N more times."""
    counter = tmp_path / "attempts"
    flaky = f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; [ "$n" -ge 2 ]'
    script = f'source launch/_common.sh; sleep() {{ :; }}; with_restarts "$1" bash -c \'{flaky}\''
    assert launch("-c", script, "_", "3").returncode == 0
    assert counter.read_text().strip() == "3"  # failed twice, third attempt succeeded
    counter.unlink()
    result = launch("-c", script, "_", "1", check=False)
    assert result.returncode == 1 and "giving up" in result.stderr
    assert counter.read_text().strip() == "2"
