"""Tiny transformers (PyTorch) reference models, built in the test from configs."""

import numpy as np
import torch
import transformers

TINY_HF = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)

HF_FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen2_untied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(tie_word_embeddings=True, head_dim=16, rope_theta=1000000.0)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)),
}


def build_hf_model(family: str, seed: int = 0, weight_scale: float = 0.08, **overrides):
    """A randomly initialised HF model whose every weight (norms, biases too) is non-trivial.

    Larger ``weight_scale`` makes next-token distributions peakier (the sampler's greedy parity
    tests use 0.1 so that greedy choices are not near-ties).
    """
    config_cls, model_cls, extra = HF_FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY_HF, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(weight_scale * torch.randn_like(param))
    return model


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with positions from the mask (HF's forward alone would use arange)."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long),
                    position_ids=torch.as_tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def padded_batch(seed: int = 0, side: str = "left", lengths=(11, 6, 3), width: int = 11, vocab: int = 256):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, sl] = rng.integers(1, vocab, n)
        mask[i, sl] = 1
    return ids, mask
