"""``train.profile_steps``: a ``jax.profiler`` trace of chosen RL steps, without editing code.

Each chosen step (rollout, π_old/π_ref, the updates and the diagnostics) is traced on its own
into ``<workdir>/profile/step_<n>/plugins/profile/<timestamp>/*.xplane.pb``; open it with
TensorBoard's profile plugin (``tensorboard --logdir <workdir>/profile/step_<n>``) or upload the
``.xplane.pb`` to Perfetto / XProf. One trace per step keeps a trace's size bounded (a whole run
in one trace is gigabytes) and names which step it is. Only process 0 traces on several hosts
would be a lie (the collective waits on the others), so every host traces its own device work.
"""

from __future__ import annotations

from pathlib import Path

import jax


def trace_dir(workdir: str | Path, step: int) -> Path:
    return Path(workdir) / "profile" / f"step_{int(step)}"


def normalise_steps(value) -> frozenset[int]:
    """``train.profile_steps`` as a set: a tuple, one int (``--config.train.profile_steps=1``) or a "1,2" string."""
    if value in (None, "", ()):
        return frozenset()
    if isinstance(value, int | str):
        value = [part for part in str(value).split(",") if part.strip()]
    steps = frozenset(int(step) for step in value)
    if any(step < 0 for step in steps):
        raise ValueError(f"train.profile_steps = {value!r}: step numbers are >= 0")
    return steps


class StepProfiler:
    """``begin(step)`` / ``end(step)`` around one step: a trace when the step is in ``steps``, nothing otherwise."""

    def __init__(self, steps, workdir: str | Path):
        self.steps = normalise_steps(steps)
        self.workdir = Path(workdir)
        self._active: int | None = None

    def begin(self, step: int) -> None:
        if step in self.steps and self._active is None:
            jax.profiler.start_trace(str(trace_dir(self.workdir, step)))
            self._active = step

    def end(self, step: int) -> None:
        """Stop the trace after the step's device work has finished (so the trace holds all of it)."""
        if self._active is not None and self._active == step:
            jax.effects_barrier()
            jax.profiler.stop_trace()
            self._active = None

    def close(self) -> None:
        if self._active is not None:
            self.end(self._active)
