"""The GGUF tokenizer is transformers' own, built without PyTorch (the default job installs no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llds_jax.models.gguf_tokenizer import load_gguf_tokenizer
from llds_jax.utils.assets import smollm2_gguf_path
from tests.models import smollm2_reference

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello <search> world </search>",
    "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n<think>",
    "  spaces\tand\nnewlines ünïcödé 日本語 🙂",
    '<information>Doc 1(Title: "X") text</information><answer> Paris </answer><|endoftext|>',
]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf_path()


def test_matches_transformers_gguf_tokenizer(gguf_path):
    reference = smollm2_reference.transformers_tokenizer()  # transformers' own load of gguf_path
    ours = load_gguf_tokenizer(gguf_path)
    for text in TEXTS:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "all_special_tokens"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert len(ours) == len(reference)
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_builds_in_a_process_where_torch_cannot_be_imported(gguf_path):
    script = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from llds_jax.models.gguf_tokenizer import load_gguf_tokenizer\n"
        f"t = load_gguf_tokenizer({str(gguf_path)!r})\n"
        "print(t('Hello <search> world </search>')['input_ids'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    reference = load_gguf_tokenizer(gguf_path)("Hello <search> world </search>")["input_ids"]
    assert result.stdout.strip().splitlines()[-1] == str(reference)


@pytest.mark.unit
def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf_tokenizer(tmp_path / "absent.gguf")
