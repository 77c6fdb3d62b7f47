"""Chunked log-probs equal the naive full softmax, in values and gradients, without its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models.logprobs import sequence_logprobs, token_logprobs
from llds_jax.models.testing import tiny_model

pytestmark = pytest.mark.unit


def _naive(hidden, unembed, targets, temperature):
    logits = (hidden @ unembed).astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _inputs(batch=3, length=37, width=16, vocab=300, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (batch, length, width))
    unembed = jax.random.normal(k2, (width, vocab)) * 0.5
    targets = jax.random.randint(k3, (batch, length), 0, vocab)
    return hidden, unembed, targets


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("chunk_size,temperature", [(8, 1.0), (37, 0.7), (5, 1.3)])
def test_chunked_values_equal_naive_softmax(chunk_size, temperature):
    hidden, unembed, targets = _inputs()
    logp, entropy = token_logprobs(hidden, unembed, targets, temperature=temperature, chunk_size=chunk_size)
    want_logp, want_entropy = _naive(hidden, unembed, targets, temperature)
    np.testing.assert_allclose(logp, want_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("vocab_major,chunk_size", [(False, 8), (True, 8), (False, 64)])
def test_chunked_gradients_equal_naive_softmax(vocab_major, chunk_size):
    """A vocab-major table ([V, D], a tied embedding as stored) gives the same values and its
    gradient comes back [V, D], the transpose of the [D, V] one; one chunk covering the
    sequence (64 ≥ 37, not rematerialised) gives them too."""
    hidden, unembed, targets = _inputs()
    weights = jax.random.normal(jax.random.key(9), targets.shape)
    table = unembed.T if vocab_major else unembed

    def loss(fn, h, u):
        logp, entropy = fn(h, u)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy)

    chunked = lambda h, u: token_logprobs(h, u, targets, vocab_major=vocab_major, temperature=0.9, chunk_size=chunk_size)
    naive = lambda h, u: _naive(h, u, targets, 0.9)
    got = jax.grad(lambda h, u: loss(chunked, h, u), argnums=(0, 1))(hidden, table)
    want = jax.grad(lambda h, u: loss(naive, h, u), argnums=(0, 1))(hidden, unembed)
    want = (want[0], want[1].T if vocab_major else want[1])
    for name, g, w in zip(("d hidden", "d table"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=name)


def _vocab_projections(length, chunk_size):
    """How many [.., V]-wide matmuls the gradient of the log-probs runs."""
    hidden, unembed, targets = _inputs(length=length)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h: jnp.sum(token_logprobs(h, unembed, targets, chunk_size=chunk_size)[0])))(hidden)
    text = str(jaxpr)
    return text.count(f"{unembed.shape[1]}] = dot_general")


def test_lone_chunk_is_not_rematerialised():
    """Rematerialising a chunk saves memory only when another chunk follows it: a single chunk's
    logits die before the decoder's backward either way, so its projection runs once."""
    assert _vocab_projections(37, 64) == 1
    assert _vocab_projections(37, 8) == 2  # chunked: the backward recomputes each chunk's logits


def _temp_bytes(length, vocab, chunk_size):
    hidden = jax.ShapeDtypeStruct((2, length, 32), jnp.float32)
    unembed = jax.ShapeDtypeStruct((32, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, length), jnp.int32)

    def loss(h, u, t):
        logp, entropy = token_logprobs(h, u, t, chunk_size=chunk_size)
        return jnp.sum(logp) + jnp.sum(entropy)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, unembed, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_peak_temporary_memory_does_not_grow_with_length_times_vocab():
    vocab, chunk = 8192, 64
    short, long = _temp_bytes(256, vocab, chunk), _temp_bytes(2048, vocab, chunk)
    full_logits_long = 2 * 2048 * vocab * 4
    assert long < full_logits_long / 4, (
        f"grad of chunked log-probs uses {long / 2**20:.1f} MiB temp; full fp32 logits are "
        f"{full_logits_long / 2**20:.1f} MiB")
    # 8x longer sequence: only O(B*T*D)-sized buffers may grow, not the B*chunk*V logits
    assert long - short < 2 * 2048 * vocab * 4 / 8, f"temp grew {short} -> {long} bytes for 8x length"


@pytest.mark.codegen_sensitive
def test_sequence_logprobs_scores_the_next_token_of_a_decoder():
    model = tiny_model("qwen3")
    ids = jax.random.randint(jax.random.key(0), (2, 10), 0, 256)
    mask = jnp.ones((2, 10), bool)
    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state):
        m = nnx.merge(graphdef, state)
        return sequence_logprobs(m, ids, mask, chunk_size=4)[0], jax.nn.log_softmax(m(ids, mask), axis=-1)

    logp, full = both(state)
    want = jnp.take_along_axis(full[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(logp, want, atol=1e-5)
