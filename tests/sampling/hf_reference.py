"""transformers (PyTorch) reference models and greedy generation for sampler parity tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)
_FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)),
}


def tiny_hf_model(family: str, seed: int = 0):
    """A random tiny HF model with large enough weights that greedy choices are not near-ties."""
    config_cls, model_cls, extra = _FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_TINY, **extra})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model


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
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = rng.integers(1, vocab, n)
        mask[row, width - n:] = 1
    return ids, mask
