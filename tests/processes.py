"""Child processes a test starts as a user would (``python -m llds_jax.main …``): wait, reap, report."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    """Wait for ``proc`` (started with ``start_new_session=True``); past ``timeout`` its whole process group is
    killed, so no child outlives the test. A non-zero exit fails the test with the log's tail."""
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code:
        pytest.fail(f"{' '.join(proc.args[:4])} exited {code}:\n{log.read_text()[-4000:]}")
