"""The slot session's paged cache: appends run only the rows with ids, and a device's rows read
and write only its own pool (the compiled programs move no array between devices)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models.testing import tiny_model
from llds_jax.sampling import placement, slots
from llds_jax.sampling.decode_loop import DecodeState, SamplingParams

pytestmark = pytest.mark.unit

COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(")


def non_scalar_collectives(hlo: str) -> list[str]:
    """Collectives that move arrays. The one the paged read needs is a scalar: the furthest live
    block over every device's rows, the key loop's shared trip count (the dense cache has the same)."""
    return [m.group(0) for m in COLLECTIVE.finditer(hlo) if re.search(r"\[\d", m.group(1))]


def _session(devices: int, rows: int, kv_blocks: int):
    model = tiny_model("llama")
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=np.zeros((1, 2, model.config.vocab_size), np.int8))
    mesh = placement.sampler_mesh(jax.devices()[:devices]) if devices > 1 else None
    return slots.SlotSession(nnx.split(model), sampling, slots=rows, max_action_tokens=8, key=jax.random.key(0),
                             max_tokens=512, mesh=mesh, kv_blocks=kv_blocks)


def test_an_append_runs_only_the_rows_with_ids(monkeypatch):
    """16 slots, 3 of them with feedback: the append call's batch is 4 rows (3 rounded up to a power
    of two), not 16; the rows' ids land in their own blocks."""
    session = _session(1, 16, kv_blocks=40)
    shapes = []
    original = slots._extend

    def recorded(graphdef, params, layer_weights, tokens, *args):
        shapes.append(tokens.shape)
        return original(graphdef, params, layer_weights, tokens, *args)

    monkeypatch.setattr(slots, "_extend", recorded)
    for slot, block in ((2, 5), (7, 9), (11, 0)):
        session.reset(slot, slot, 0)
        session.set_blocks(slot, [block])
    session.append({2: [3, 4, 5], 7: [6], 11: [7, 8]})
    assert [s[0] for s in shapes] == [4]
    assert session.rows_end[[2, 7, 11]].tolist() == [3, 1, 2] and session.rows_end.sum() == 6
    pool = np.asarray(session.k[0])[0]  # [blocks, kv_heads, block, head_dim]
    written = {b for b in range(40) if np.any(pool[b] != 0)}
    assert written == {5, 9, 0}


def test_four_devices_decode_and_append_without_collectives():
    session = _session(4, 8, kv_blocks=8)
    for slot in range(8):
        session.reset(slot, slot, 0)
        session.set_blocks(slot, [slot % 2])  # two rows per device: blocks 0 and 1 of its own pool
    session.append({slot: [1, 2, 3] for slot in range(8)})
    with placement.on_mesh(session.mesh):
        end = session._rows(session.rows_end.astype(np.int32))
        ids = session._rows(np.ones((8, 16), np.int32))
        append = slots._extend.lower(session.graphdef, session.params, session.layer_weights, ids,
                                     session._rows(np.ones((8, 16), bool)), session.k, session.v,
                                     session._device_table(), end).compile().as_text()
        cache = slots.PagedKVCache(k=session.k, v=session.v, table=session._device_table(), end=end)
        state = DecodeState(cache=cache, logits=session.logits, keys=session.keys, drawn=session._rows(session.drawn),
                            step=jnp.zeros((), jnp.int32), **session.state)
        rows = session._rows(np.ones((8,), bool))
        decode = slots.decode_segment.lower(session.graphdef, session.params, session.layer_weights, state, rows,
                                            ~rows, session._rows(np.full((8,), 4, np.int32)), session.sampling,
                                            steps=4).compile().as_text()
    assert COLLECTIVE.search(decode)  # the pattern matches this compiler's collectives
    assert non_scalar_collectives(append) == [] and non_scalar_collectives(decode) == []


def test_an_action_starts_only_on_logits_an_append_set():
    """The decode step writes every row's next-token logits (no per-token select keeping a frozen
    row's), so after a decode call only an append makes a slot's logits mean something again:
    starting an action before one is refused, and the engine's order (append, start, decode) runs."""
    session = _session(1, 2, kv_blocks=4)
    session.reset(0, 0, 0)
    session.set_blocks(0, [0, 1])
    with pytest.raises(RuntimeError, match="slot 0: no ids were appended"):
        session.start_action(0, 4)  # reset: nothing fed yet
    session.append({0: [1, 2, 3]})
    session.start_action(0, 4)
    ended = session.decode(8)
    assert list(ended) == [0] and len(ended[0].ids) == 4  # budget 4, no stop ids: capped
    with pytest.raises(RuntimeError, match="slot 0: no ids were appended"):
        session.start_action(0, 4)  # the logits after the decode call follow no id of the slot
    session.append({0: [4, 5]})
    session.start_action(0, 2)
    assert len(session.decode(8)[0].ids) == 2


def test_append_rows_caps_a_calls_rows_and_changes_no_bit(monkeypatch):
    """``append_rows=2`` (the engine passes ``rollout.prefill_rows``, what the memory plan holds append
    workspace for): five rows' prompts go in three calls of at most two rows, and every row's cache
    and logits are the one-call append's, bit for bit (rows are batch-invariant)."""
    rows_per_call = []
    original = slots._extend

    def recorded(graphdef, params, layer_weights, tokens, mask, *args):
        rows_per_call.append(int(np.asarray(mask).any(axis=1).sum()))
        return original(graphdef, params, layer_weights, tokens, mask, *args)

    prompts = {slot: list(range(1, 4 + 7 * slot)) for slot in range(5)}
    results = []
    for append_rows in (0, 2):
        session = _session(1, 5, kv_blocks=5)
        session.append_rows = append_rows
        for slot in range(5):
            session.reset(slot, slot, 0)
            session.set_blocks(slot, [slot])
        rows_per_call.clear()
        monkeypatch.setattr(slots, "_extend", recorded)
        session.append(prompts)
        monkeypatch.setattr(slots, "_extend", original)
        results.append((list(rows_per_call), np.asarray(session.k[0]), np.asarray(session.logits)))
    (whole_calls, whole_k, whole_logits), (capped_calls, capped_k, capped_logits) = results
    assert whole_calls == [5] and capped_calls == [2, 2, 1]
    np.testing.assert_array_equal(capped_k, whole_k)
    np.testing.assert_array_equal(capped_logits[:5], whole_logits[:5])
