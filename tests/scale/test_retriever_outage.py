"""A retrieval service killed mid-rollout: the client retries, then the step fails with a clear error.

Documented behaviour (issue 9, "Faults"): ``HttpRetriever`` retries a dead or 5xx-ing service
with exponential backoff (``retrieval.retries``, ``retrieval.backoff``); if the service comes
back inside that window the rollout simply continues, with the same result as without the
outage. Otherwise ``run_rollouts`` raises ``RetrievalError`` naming the URL and the attempts,
the training step is abandoned before its update and checkpoint, the process exits non-zero,
and the same command resumes from the last checkpoint (``launch/*.sh --max-restarts`` reruns it;
``test_fault_recovery.py`` shows a resume equals the uninterrupted run).

Real parts: the service is ``python -m llds_jax.main --mode=serve`` on a free localhost port,
killed with SIGKILL between the two search turns of a rollout; the policy is the scripted one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from llds_jax.retrieval.client import HttpRetriever
from llds_jax.retrieval.hit import RetrievalError
from llds_jax.rollout import default_config, run_rollouts, terminator_ids
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.scripted_policy import ScriptedPolicy
from llds_jax.sampling import vocab_bytes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# Two searches, then an answer: the service is needed in turn 1 and again in turn 2.
ROWS = [["<search> nobel prize physics </search>", "<search> wilhelm rontgen </search>",
         "<answer> Wilhelm Conrad Röntgen </answer><|im_end|>"]] * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """The real retrieval service in a subprocess; ``kill()`` is SIGKILL, as an OOM or a crash."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> Service:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llds_jax.main", "--mode=serve", "--config=configs/retriever.py",
             f"--config.retrieval.port={self.port}"], cwd=REPO, env=env, stdout=self.log.open("a"),
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"retrieval service exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"retrieval service not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class KillAfterFirstSearch:
    """Passes searches to ``client``; SIGKILLs the service right after the first one returns."""

    def __init__(self, client: HttpRetriever, service: Service, on_kill=None):
        self.client, self.service, self.on_kill, self.calls = client, service, on_kill, 0

    def search(self, queries, topk):
        hits = self.client.search(queries, topk)
        self.calls += 1
        if self.calls == 1:
            self.service.kill()
            if self.on_kill is not None:
                self.on_kill()
        return hits


def rollout(tokenizer, retriever):
    cfg = default_config()
    cfg.update(n_samples=1, max_turns=2)
    streams = [[tokenizer.encode(turn, add_special_tokens=False) for turn in row] for row in ROWS]
    policy = ScriptedPolicy(streams, action_stop_table(vocab_bytes(tokenizer)),
                            stop_token_ids=terminator_ids(tokenizer), filler_id=tokenizer.encode("!")[0])
    return run_rollouts(policy, tokenizer, ["who got the first nobel prize in physics"] * len(ROWS), retriever, cfg)


@pytest.fixture
def service(tmp_path):
    svc = Service(free_port(), tmp_path / "service.log").start()
    yield svc
    svc.kill()


@pytest.mark.slow
def test_service_killed_mid_rollout_fails_the_step_naming_url_and_attempts(service, qwen_tokenizer):
    with HttpRetriever(service.url, retries=2, backoff=0.05) as client:
        retriever = KillAfterFirstSearch(client, service)
        with pytest.raises(RetrievalError) as err:
            rollout(qwen_tokenizer, retriever)
    assert retriever.calls == 1, "the first turn's search must have succeeded before the kill"
    message = str(err.value)
    assert f"retrieval service {service.url}/retrieve failed after 3 attempts" in message
    assert "ConnectError" in message


@pytest.mark.slow
def test_service_restarted_within_the_retry_window_lets_the_rollout_finish_unchanged(service, qwen_tokenizer):
    with HttpRetriever(service.url) as client:
        expected = rollout(qwen_tokenizer, client)

    restarter = threading.Thread(target=service.start)
    with HttpRetriever(service.url, retries=40, backoff=0.25, max_backoff=2.0) as client:
        retriever = KillAfterFirstSearch(client, service, on_kill=restarter.start)
        got = rollout(qwen_tokenizer, retriever)
    restarter.join()
    assert retriever.calls == 2
    assert got.input_ids.tolist() == expected.input_ids.tolist()  # same passages came back
    assert got.action_mask.tolist() == expected.action_mask.tolist()
