"""``generate``: greedy parity with transformers, stops, frozen rows, reproducibility, one compile per bucket."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models import from_pretrained
from llds_jax.models.testing import tiny_model
from llds_jax.sampling import FinishReason, build_stop_table, decode_loop, generate, slots

from .hf_reference import hf_greedy, left_padded, tiny_hf_model

pytestmark = pytest.mark.unit

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_and_ours(request, tmp_path_factory):
    hf_model = tiny_hf_model(request.param)
    directory = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf_model.save_pretrained(directory)
    return request.param, hf_model, from_pretrained(directory)


@pytest.mark.codegen_sensitive
def test_greedy_matches_transformers_generate_on_left_padded_batch(hf_and_ours):
    family, hf_model, model = hf_and_ours
    ids, mask = left_padded((11, 6, 3, 9), vocab=256, seed=1)
    expected = hf_greedy(hf_model, ids, mask, NEW_TOKENS)
    out = generate(model, ids, mask, max_new_tokens=NEW_TOKENS, temperature=0.0, key=jax.random.key(0))
    assert out.lengths.tolist() == [NEW_TOKENS] * 4
    mismatch = np.argwhere(out.tokens != expected)
    assert mismatch.size == 0, f"{family}: first mismatches (row, step) {mismatch[:5].tolist()}\n" \
                               f"ours\n{out.tokens}\ntransformers\n{expected}"


@pytest.mark.codegen_sensitive
def test_logprobs_are_the_models_logprobs_at_temperature_one(hf_and_ours):
    _, _, model = hf_and_ours
    ids, mask = left_padded((11, 6, 3, 9), vocab=256, seed=2)
    out = generate(model, ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.0, key=jax.random.key(3))
    # One uncached forward over prompt + sampled tokens (left padding kept): position t predicts t+1.
    full_ids = np.concatenate([ids, out.tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(out.tokens)], axis=1)
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(full_ids), jnp.asarray(full_mask)), axis=-1))
    width = ids.shape[1]
    expected = np.take_along_axis(logp[:, width - 1:-1], out.tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3)


@pytest.mark.codegen_sensitive
def test_sampled_decoding_with_a_fixed_key_is_reproducible(model):
    ids, mask = left_padded((5, 9, 2), vocab=256)
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50)
    a = generate(model, ids, mask, key=jax.random.key(11), **kwargs)
    b = generate(model, ids, mask, key=jax.random.key(11), **kwargs)
    c = generate(model, ids, mask, key=jax.random.key(12), **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)


def test_stop_token_id_freezes_only_its_row(model):
    ids, mask = left_padded((5, 9, 2), vocab=256, seed=4)
    free = generate(model, ids, mask, max_new_tokens=10, temperature=0.0, key=jax.random.key(0))
    stop_id = int(free.tokens[1, 3])
    first_in_row = [int(np.argmax(r == stop_id)) if (r == stop_id).any() else None for r in free.tokens]
    out = generate(model, ids, mask, max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id],
                   key=jax.random.key(0), pad_id=-7)
    for row, first in enumerate(first_in_row):
        if first is None:
            assert out.lengths[row] == 10 and out.finish[row] == FinishReason.CAP
            np.testing.assert_array_equal(out.tokens[row], free.tokens[row])
        else:
            assert out.lengths[row] == first + 1 and out.finish[row] == FinishReason.STOP_TOKEN
            np.testing.assert_array_equal(out.tokens[row, : first + 1], free.tokens[row, : first + 1])
            assert (out.tokens[row, first + 1:] == -7).all() and (out.logprobs[row, first + 1:] == 0).all()


def test_stop_string_ends_the_row_after_the_completing_token(model):
    ids, mask = left_padded((6, 3), vocab=256, seed=5)
    free = generate(model, ids, mask, max_new_tokens=12, temperature=0.0, key=jax.random.key(0))
    vocab = tuple(f"<{i}>".encode() for i in range(256))  # token i decodes to "<i>"
    target = f"{free.tokens[0, 4]}><{free.tokens[0, 5]}"  # starts inside token 4, ends inside token 5
    table = build_stop_table(vocab, (target,))
    out = generate(model, ids, mask, max_new_tokens=12, temperature=0.0, stop_strings=table, key=jax.random.key(0))
    text0 = "".join(f"<{t}>" for t in free.tokens[0])
    assert out.lengths[0] == 6 or text0.find(target) < 6 * 3, (out.lengths, text0, target)
    assert out.finish[0] == FinishReason.STOP_STRING
    assert target in "".join(f"<{t}>" for t in out.tokens[0, : out.lengths[0]])
    assert target not in "".join(f"<{t}>" for t in out.tokens[0, : out.lengths[0] - 1])


def test_one_compiled_program_per_bucket_across_repeated_calls(model):
    # generate runs on the decode slots: its programs are the slot session's append (_extend)
    # and decode (decode_segment); its small helpers (pools, weight slices, logits scatter,
    # row keys) must not compile per call either.
    helpers = (slots._new_pools, slots._layer_weights, slots._put_rows, decode_loop.row_keys)

    def sizes():
        return slots._extend._cache_size(), slots.decode_segment._cache_size()

    def helper_sizes():
        return [f._cache_size() for f in helpers]

    generate(model, *left_padded((5, 3), vocab=256), max_new_tokens=9, key=jax.random.key(0))
    before, helpers_before = sizes(), helper_sizes()
    # Same buckets (batch ≤ 2, prompt ≤ 16, new ≤ 16) and sampling mode (plain temperature),
    # different lengths, temperatures, stops and keys.
    for seed, (lengths, new) in enumerate([((7, 2), 16), ((16, 5), 10), ((1, 12), 11), ((3, 3), 9)]):
        generate(model, *left_padded(lengths, vocab=256, seed=seed), max_new_tokens=new,
                 temperature=[0.5, 0.7, 1.0, 1.3][seed], stop_token_ids=[seed], key=jax.random.key(seed))
    # New weights (same shapes) reuse the program too: params are arguments.
    generate(tiny_model("qwen2", seed=9), *left_padded((4, 8), vocab=256), max_new_tokens=12, key=jax.random.key(1))
    assert sizes() == before, f"jit cache grew within one bucket: {before} -> {sizes()}"
    assert helper_sizes() == helpers_before, f"a helper recompiled: {helpers_before} -> {helper_sizes()}"
    # Each other sampling mode (greedy, top-k, top-p, both) is a program of its own, compiled
    # once (other tests may have compiled it already): the mode is static (no run-time cond),
    # the knob values within it are not.
    for first, second in [((0.0, 0, 1.0), (0.0, 3, 0.5)), ((1.0, 20, 1.0), (0.8, 5, 1.0)),
                          ((1.0, 0, 0.9), (1.2, 0, 0.5)), ((1.0, 20, 0.5), (0.7, 9, 0.95))]:
        for knobs in (first, second):
            generate(model, *left_padded((7, 2), vocab=256), max_new_tokens=16, key=jax.random.key(2),
                     **dict(zip(("temperature", "top_k", "top_p"), knobs)))
            if knobs == first:
                compiled = sizes()
        assert sizes() == compiled, f"{second} recompiled the program of {first}: {compiled} -> {sizes()}"
    assert sizes()[1] <= before[1] + 4, f"four more modes, at most four more programs: {before} -> {sizes()}"
    # A longer prompt bucket. The append pads its rows to MIN_EXTEND_TOKENS positions (64), so
    # two rows already ran 32 columns: a prompt of 17..32 real ids compiles nothing new. Past
    # 32 ids (64 columns) the append is one new program; the decode program keeps, since the
    # row's context (64 + 16 slots) still fits one 128-slot block (the pool and the block
    # tables are its only shapes that follow the prompt).
    # The append's cache is the process's: another test module on this worker may have compiled the
    # longer bucket already, so count from an empty cache (the short bucket compiled again first).
    slots._extend.clear_cache()
    generate(model, *left_padded((7, 2), vocab=256), max_new_tokens=9, key=jax.random.key(0))
    before = sizes()
    generate(model, *left_padded((20, 3), vocab=256), max_new_tokens=9, key=jax.random.key(0))
    assert sizes() == before, f"a prompt within the append floor recompiled: {before} -> {sizes()}"
    generate(model, *left_padded((40, 3), vocab=256), max_new_tokens=9, key=jax.random.key(0))
    grown = sizes()
    assert grown == (before[0] + 1, before[1]), f"a new prompt bucket should add one append program: {before} -> {grown}"
