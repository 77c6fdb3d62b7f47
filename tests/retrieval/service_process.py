"""Start the real retrieval service (``python -m llds_jax.main --mode=serve``) as a subprocess."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from llds_jax.retrieval.server import READY_BANNER

REPO = Path(__file__).resolve().parents[2]
STARTUP_LIMIT_S = 120.0  # a guard against a hung child, not a performance assertion


class ServiceProcess:
    """One server subprocess; `start` returns once it printed its URL, `stop` always reaps it."""

    def __init__(self, overrides: dict[str, object], log_path: Path):
        self.overrides = overrides
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.url = ""

    def command(self) -> list[str]:
        flags = [f"--config.retrieval.{key}={value}" for key, value in self.overrides.items()]
        return [sys.executable, "-m", "llds_jax.main", "--mode=serve", f"--config={REPO / 'configs' / 'retriever.py'}",
                *flags]

    def start(self) -> ServiceProcess:
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(self.command(), cwd=REPO, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.process.stdout], daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=STARTUP_LIMIT_S).decode()
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"service printed no banner in {STARTUP_LIMIT_S}s; log: {self.log_text()}") from None
            match = re.search(re.escape(READY_BANNER) + r" (\S+)", line)
            if match:
                self.url = match.group(1)
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"service exited with {self.process.returncode}; log: {self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the crash case, no graceful shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
