"""A small byte-level BPE tokenizer trained on the lab world and the Search-R1 protocol text.

Why our own: a tiny policy with a real model's 50k–150k-entry vocabulary would be mostly
embedding and output projection; a couple of thousand entries learned on the world's names, the
prompt template and the tags keep it small (sequence length stays about Qwen2.5's: the
pre-tokenizer splits at words). Byte-level, so
any text the policy samples still encodes and decodes losslessly. Saved as an HF directory
(``tokenizer.json`` + ``tokenizer_config.json``) that ``AutoTokenizer.from_pretrained`` loads; it
has no chat template, so the rollout uses the plain prompt (SPEC §2). ``<|endoftext|>`` is EOS
and padding, one of the rollout's known terminators.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llds_jax.errors import InputError
from llds_jax.lab.world import World
from llds_jax.rollout import protocol

EOS = "<|endoftext|>"


class TokenizerConfigError(InputError):
    """A ``lab.tokenizer`` value that cannot give a usable tokenizer."""


def protocol_texts(world: World) -> Iterable[str]:
    """Text in the exact shapes the rollout will produce: prompts, tagged actions, feedback docs."""
    for question in world.train:
        yield protocol.user_prompt(question.question)
        yield f"<think> I need to search. </think>\n<search> {question.entity or question.question} </search>"
        yield f"<think> I found the answer. </think>\n<answer> {question.answer} </answer>"
    for index, (title, text) in enumerate(world.passages):
        yield protocol.search_feedback(f"Doc {index % 3 + 1}(Title: {title}) {text}\n")
    yield protocol.INVALID_ACTION_FEEDBACK


def train_tokenizer(world: World, vocab_size: int, directory: Path):
    """Train, save to ``directory`` and return the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 300:
        raise TokenizerConfigError(f"lab.tokenizer.vocab_size={vocab_size!r} must be an integer ≥ 300 "
                                   "(256 byte symbols plus merges)")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(protocol_texts(world), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return tokenizer
