"""``decode_loop.run_steps``: the stop check every few tokens never runs past ``steps`` and stops
at the first chunk boundary after every row is done."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from llds_jax.sampling.decode_loop import STOP_CHECK_EVERY, run_steps, stop_check_every

pytestmark = pytest.mark.unit


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Rows:
    """What ``run_steps`` reads (``step``, ``done``), plus a count of the steps that ran."""

    step: jax.Array
    done: jax.Array
    ran: jax.Array


def _run(steps: int, finish_at: int, every: int = STOP_CHECK_EVERY["gpu"]) -> tuple[int, int]:
    def step(s: _Rows) -> _Rows:
        return _Rows(step=s.step + 1, done=s.done | (s.step + 1 >= finish_at), ran=s.ran + 1)

    start = _Rows(step=jnp.int32(0), done=jnp.zeros((3,), bool), ran=jnp.int32(0))
    out = jax.jit(lambda s: run_steps(step, s, steps, every))(start)
    return int(out.ran), int(out.step)


@pytest.mark.parametrize("steps, finish_at, ran", [
    (20, 99, 20),   # nobody finishes: every step
    (20, 5, 12),    # the 20 % 8 = 4 odd steps first, then a chunk: done at 5, noticed at 12
    (20, 3, 4),     # done within the odd steps: noticed before the first chunk
    (20, 13, 20),
    (16, 16, 16),
    (16, 2, 8),
    (4, 1, 4),      # steps < every: one chunk of 4, never past steps
    (0, 1, 0),
])
def test_never_past_steps_and_stops_at_a_check(steps, finish_at, ran):
    assert _run(steps, finish_at) == (ran, ran)


def test_the_chunks_are_static_loops_inside_one_data_dependent_loop():
    def step(s: _Rows) -> _Rows:
        return _Rows(step=s.step + 1, done=s.done | (s.step >= 5), ran=s.ran + 1)

    start = _Rows(step=jnp.int32(0), done=jnp.zeros((3,), bool), ran=jnp.int32(0))
    hlo = jax.jit(lambda s: run_steps(step, s, 64, STOP_CHECK_EVERY["gpu"])).lower(start).as_text(dialect="hlo")
    assert len(re.findall(r" while\(", hlo)) == 2, "an outer loop over chunks and the chunk's own loop"


def test_xla_cpu_checks_every_token_and_accelerators_every_8():
    """The interval follows the platform the program compiles for (here, this process's CPU)."""
    assert stop_check_every() == STOP_CHECK_EVERY["cpu"] == 1 and STOP_CHECK_EVERY["gpu"] == STOP_CHECK_EVERY["tpu"] == 8
    assert _run(20, 5, every=stop_check_every()) == (5, 5)  # noticed at once
