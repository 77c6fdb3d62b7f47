"""Run control: when a training run saves and stops, apart from reaching its last step.

``PreemptionGuard`` turns SIGTERM (TPU/GCE preemption, SLURM ``--signal``, ``kill``) into
"save at the next step boundary, then exit"; ``NonFiniteStreak`` stops a run after K skipped
(non-finite) optimizer updates in a row. Both only decide; ``app.run``'s step callback saves
through ``train.checkpoint.Checkpointer``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import jax

log = logging.getLogger(__name__)


class PreemptionGuard:
    """Turn SIGTERM into "checkpoint at the next step boundary, then exit cleanly".

    Single process: a SIGTERM handler sets a flag (the step in flight finishes; a signal
    handler must not touch device state). Multi-process (``jax.distributed``): the hosts must
    agree on *which* step to save at, and each host may see the signal at a different step, so
    ``should_stop`` asks JAX's preemption sync point, whose coordination service already
    listens for SIGTERM on every host; our handler is then *not* installed (a Python handler
    would replace that service's). ``request()`` is for stop decisions every host makes
    identically (e.g. K non-finite updates in a row). Use::

        guard = PreemptionGuard().install()
        for step in ...:
            state = train_step(...)
            if guard.should_stop(step):
                ckpt.save(step, state, extra); ckpt.close(); break
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self._signalled = threading.Event()
        self._requested = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionGuard:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, _frame) -> None:
        self._signalled.set()

    def request(self) -> None:
        """Stop at the next ``should_stop`` on every host (call it on every host alike)."""
        self._requested.set()

    @property
    def signalled(self) -> bool:
        return self._signalled.is_set()

    def should_stop(self, step: int) -> bool:
        if self._requested.is_set():
            return True
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError as err:  # preemption service disabled
                log.warning("preemption sync unavailable (%s); relying on request() only", err)
                return False
        return self._signalled.is_set()


class NonFiniteStop(SystemExit):
    """The run stopped on a streak of non-finite updates; ``str(err)`` is the streak's message.

    A ``SystemExit``, so ``python -m llds_jax.main`` ends with exit status 1 and prints the
    message on stderr, while in-process callers can catch it by name.
    """


class NonFiniteStreak:
    """Stop the run after ``limit`` non-finite (skipped) optimizer updates in a row.

    The update step already skips a non-finite update and counts it; one bad batch is noise,
    but a streak means the weights or the data went wrong and every further step is wasted.
    Feed it each step's per-mini-batch skip flags in order; when it trips, save (the state is
    the last finite one — skipped updates leave it unchanged) and exit with ``message``::

        streak = NonFiniteStreak(limit=config.train.max_nonfinite_updates)
        if streak.record(per_mini["update/skipped"]):
            ckpt.save(step, state, extra); ckpt.close(); raise NonFiniteStop(streak.message)
    """

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"non-finite update limit={limit!r}: must be an int >= 1")
        self.limit = limit
        self.current = 0
        self.total = 0

    def record(self, skipped_flags) -> bool:
        """Add one step's skip flags (truthy = skipped); True once the streak reaches the limit."""
        for flag in list(skipped_flags):
            skipped = bool(flag)
            self.total += skipped
            self.current = self.current + 1 if skipped else 0
        return self.current >= self.limit

    @property
    def message(self) -> str:
        return (f"stopping: {self.current} optimizer updates in a row had a non-finite loss or gradient "
                f"(limit {self.limit}; {self.total} skipped in this run). The checkpoint holds the last "
                f"finite state; inspect the data of the last steps or lower the learning rate, then resume.")
