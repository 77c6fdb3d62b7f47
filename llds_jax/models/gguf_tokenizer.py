"""The tokenizer a GGUF file describes, built without PyTorch.

transformers builds GGUF tokenizers with its own converters, but reaches them through a
metadata reader that imports torch (``transformers/integrations/gguf/reader.py``), which is a
test-only dependency here: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` fails with
``Could not import module 'read_gguf_metadata'`` on a machine without torch. This reads the
metadata with the ``gguf`` package (numpy only) and hands it to the same converters, so the
result is token-for-token the tokenizer transformers would build (tested against it).
"""

from __future__ import annotations

from pathlib import Path

# GGUF metadata key (after "tokenizer.ggml.") → the transformers tokenizer argument holding that token
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                      "pad_token": "padding_token_id"}


def _metadata(path: Path) -> dict:
    from llds_jax.models.gguf_io import open_gguf  # noqa: PLC0415

    reader = open_gguf(path)  # parsed once: the weights read the same file
    return {name: field.contents() for name, field in reader.fields.items()}


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer (vocabulary, merges, special tokens, chat template) from a GGUF file."""
    from transformers import TokenizersBackend  # noqa: PLC0415
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: PLC0415
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    metadata = _metadata(path)
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path}: no tokenizer in this GGUF file (metadata key tokenizer.ggml.tokens is missing)")
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # sentencepiece files add BOS unless they say otherwise
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, name_or_path=str(path), **tokenizer_config, **extra)
