"""The decoder's backward keeps activations token-major: no [features, tokens] copies on XLA:CPU.

Why: with ``btd,dhk->bthk``-style einsums the weight gradient contracts both batch and
sequence, and XLA:CPU wrote the activation gradient feature-major ([F, B*T]) from inside the
SwiGLU backward fusion, a strided write that made the MLP's fwd+bwd 1.8× slower than its
matmuls (SmolLM2 at 4×256: 110 ms vs 62 ms). ``layers.project`` flattens tokens to one axis
so every weight gradient is one plain [D, N] x [N, F] product. This test compiles the grad and
looks for any array laid out with a feature axis ahead of the token axes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models.testing import tiny_model

pytestmark = pytest.mark.unit

BATCH, LENGTH = 2, 24  # 48 tokens: no weight dimension of the config below equals 48, 24 or 2


def _optimised_hlo(scan_layers: bool) -> tuple[str, set[int]]:
    model = tiny_model("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                       vocab_size=256, scan_layers=scan_layers)
    graph, params = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 256, (BATCH, LENGTH)), jnp.int32)
    probe = jnp.ones((BATCH, LENGTH, 64), jnp.float32)

    def loss(p):
        return jnp.sum(nnx.merge(graph, p).hidden_states(ids, jnp.ones_like(ids, bool)) * probe)

    features = {64, 160, 4 * 16, 2 * 16}
    return jax.jit(jax.grad(loss)).lower(params).compile().as_text(), features


def _feature_major_arrays(hlo: str, features: set[int]) -> list[str]:
    """Instructions whose (row-major, default-layout) shape puts a feature axis before the tokens."""
    bad = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]+)\]\{([\d,]+)\}", line)
        if not match:
            continue
        dims = [int(d) for d in match.group(1).split(",")]
        minor_to_major = [int(d) for d in match.group(2).split(",")]
        physical = [dims[i] for i in reversed(minor_to_major)]  # major → minor
        flat_tokens = len(physical) == 2 and physical[1] == BATCH * LENGTH and physical[0] in features
        split_tokens = len(physical) == 3 and physical[1:] == [BATCH, LENGTH] and physical[0] in features
        if flat_tokens or split_tokens:
            bad.append(line.strip()[:160])
    return bad


def test_no_activation_or_activation_gradient_is_laid_out_feature_major():
    for scan_layers in (True, False):
        hlo, features = _optimised_hlo(scan_layers)
        bad = _feature_major_arrays(hlo, features)
        assert not bad, f"scan_layers={scan_layers}: {len(bad)} feature-major activation arrays, e.g.\n" + "\n".join(
            bad[:5])


def _transposed_table_arrays(vocab_major: bool) -> list[str]:
    """[D, V]-laid-out arrays in the compiled grad of a tied model's log-prob loss.

    ``vocab_major=False`` feeds the head ``embed.T``, the form before ``Decoder.output_head``."""
    from llds_jax.models.logprobs import token_logprobs

    model = tiny_model("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                       vocab_size=384, tie_embeddings=True)
    graph, params = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 384, (BATCH, LENGTH)), jnp.int32)

    def loss(p):
        m = nnx.merge(graph, p)
        table, _ = m.output_head()
        hidden = m.hidden_states(ids, jnp.ones_like(ids, bool))
        head = (table, True) if vocab_major else (table.T, False)
        logp, entropy = token_logprobs(hidden[:, :-1], head[0], ids[:, 1:], vocab_major=head[1], chunk_size=8)
        return jnp.sum(logp) + jnp.sum(entropy)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    bad = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]+)\]\{([\d,]+)\}", line)
        if match:
            dims = [int(d) for d in match.group(1).split(",")]
            physical = [dims[int(i)] for i in reversed(match.group(2).split(","))]
            if physical == [64, 384]:
                bad.append(line.strip()[:160])
    return bad


def test_tied_head_reads_the_embedding_as_stored():
    """The tied LM head contracts the [V, D] embedding in place: no transposed copy of the
    table or of its gradient (SmolLM2: 113 MB each way per micro-batch)."""
    assert _transposed_table_arrays(vocab_major=False), "the embed.T form should show the transposed table"
    bad = _transposed_table_arrays(vocab_major=True)
    assert not bad, f"{len(bad)} [D, V] arrays in the tied head's grad, e.g.\n" + "\n".join(bad[:5])
