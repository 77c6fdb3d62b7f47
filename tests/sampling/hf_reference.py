"""transformers (PyTorch) reference models and greedy generation for sampler parity tests."""

from __future__ import annotations

import numpy as np
import torch

from tests.models.tiny_hf_models import build_hf_model, padded_batch


def tiny_hf_model(family: str, seed: int = 0):
    """A random tiny HF model with large enough weights that greedy choices are not near-ties."""
    return build_hf_model(family, seed, weight_scale=0.1)


def hf_greedy(model, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """``generate(do_sample=False)`` on a left-padded batch; returns ``[B, new_tokens]`` new ids."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=0, eos_token_id=None, temperature=None, top_p=None, top_k=None,
        )
    return out[:, ids.shape[1]:].numpy()


def left_padded(lengths, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return padded_batch(seed, "left", lengths, max(lengths), vocab)
