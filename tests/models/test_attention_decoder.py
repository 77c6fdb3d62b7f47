"""The decoder gives the same logits, log-prob gradients and cached decode whichever
attention backend it uses: the naive oracle vs the blockwise kernel chosen by "auto" on CPU.

Sequences of 600 tokens span two 512-key blocks (the second shifted back to end at S),
so block boundaries are crossed inside the real model. Tolerance 1e-5 absolute: the
tiny models' logits and parameter gradients are O(0.1–1) and the kernels differ only in
fp32 summation order (measured differences are ~1e-7 – 1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models import init_cache
from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_model
from llds_jax.parallel import make_mesh, shard_model

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

TOL = 1e-5
LENGTH = 600


def _batch(length=LENGTH):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (4, length)).astype(np.int32)
    mask = np.ones((4, length), bool)   # row 3: no padding
    mask[0, :37] = False            # left padding
    mask[1, length - 90:] = False   # right padding
    mask[2, :5] = False             # both
    mask[2, length - 3:] = False
    return jnp.asarray(ids), jnp.asarray(mask)


def _loss_and_grads(model, ids, mask):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logp, entropy = sequence_logprobs(nnx.merge(graphdef, p, rest), ids, mask, chunk_size=128)
        real = mask[:, 1:] & mask[:, :-1]  # predicted from a real token: a pad's hidden state is meaningless
        return jnp.sum(logp * real) / jnp.sum(real) + 0.01 * jnp.sum(entropy * real) / jnp.sum(real)

    return jax.jit(jax.value_and_grad(loss))(params)


def _compare_grads(naive, blockwise, label):
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(naive), jax.tree.leaves(blockwise)))
    assert worst <= TOL, f"{label}: max |grad naive - grad blockwise| = {worst:.3g}"
    return worst


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # qwen3: q/k RMSNorm; both GQA 4/2
def test_logprob_value_and_gradients_match_naive_attention(family):
    ids, mask = _batch()
    (loss_naive, grads_naive) = _loss_and_grads(tiny_model(family, attention="naive"), ids, mask)
    (loss_auto, grads_auto) = _loss_and_grads(tiny_model(family), ids, mask)
    assert abs(float(loss_naive) - float(loss_auto)) <= TOL, (float(loss_naive), float(loss_auto))
    _compare_grads(grads_naive, grads_auto, family)


def test_logits_match_naive_attention_on_real_tokens():
    ids, mask = _batch()
    naive = np.asarray(jax.jit(lambda i, m: tiny_model("qwen2", attention="naive")(i, m))(ids, mask))
    blockwise = np.asarray(jax.jit(lambda i, m: tiny_model("qwen2", attention="xla_blockwise")(i, m))(ids, mask))
    real = np.asarray(mask)
    diff = float(np.max(np.abs(naive - blockwise)[real]))
    assert diff <= TOL, f"max |logits naive - blockwise| on real tokens = {diff:.3g}"
    assert np.all(np.isfinite(blockwise)), "pad rows must stay finite"


def test_prefill_and_decode_with_a_right_padded_append_match_naive_attention():
    """Left-padded prefill, a right-padded appended chunk (which leaves holes once the
    next write lands past it), then decode steps: the two backends agree at every step."""
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, 256, (2, 12)), jnp.int32)
    prompt_mask = jnp.asarray(np.arange(12)[None, :] >= np.array([[4], [0]]))
    chunk = jnp.asarray(rng.integers(0, 256, (2, 5)), jnp.int32)
    chunk_mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)

    def run(backend):
        model = tiny_model("qwen3", attention=backend)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda s, t, c, m: nnx.merge(graphdef, s).forward_cached(t, c, m))
        cache = init_cache(model.config, 2, 40)
        outs = []
        logits, cache = step(state, prompt, cache, prompt_mask)
        outs.append(logits)
        logits, cache = step(state, chunk, cache, chunk_mask)
        outs.append(logits)
        for _ in range(6):
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
            logits, cache = step(state, token, cache, jnp.ones((2, 1), bool))
            outs.append(logits)
        return np.stack([np.asarray(x) for x in outs])

    naive, blockwise = run("naive"), run("auto")
    diff = np.max(np.abs(naive - blockwise), axis=(1, 2))
    assert np.all(diff <= TOL), f"per-step max |logits naive - blockwise| = {diff}"


def test_blockwise_decoder_on_an_8_device_mesh_matches_single_device():
    """Sharding constraints stay active inside the kernel: batch over data x fsdp, heads over tensor."""
    ids, mask = _batch(520)
    single = np.asarray(jax.jit(lambda i, m: tiny_model("qwen3")(i, m))(ids, mask))
    mesh = make_mesh((2, 2, 2))  # batch 4 over data x fsdp, 4 query / 2 KV heads over tensor
    model = shard_model(tiny_model("qwen3"), mesh)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        sharded = np.asarray(jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m))(state, ids, mask))
    real = np.asarray(mask)
    diff = float(np.max(np.abs(single - sharded)[real]))
    assert diff <= TOL, f"max |single - 8-device| = {diff:.3g}"
