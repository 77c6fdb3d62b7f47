"""The exact bytes each token id contributes to decoded text.

Stop strings are matched, and answer spans located, on the bytes the sampled ids decode
to. Byte-level BPE tokens (Qwen2.5, SmolLM2, GPT-2) can hold half a UTF-8 character, so
``tokenizer.decode([id])`` is lossy (it yields U+FFFD); the byte map is exact, and the
concatenation of per-token bytes is byte-for-byte what decoding the whole sequence gives.

Special tokens (``<|im_end|>``, ``<|endoftext|>``…) contribute no bytes, as with the
reference's ``decode(..., skip_special_tokens=True)``. Ids beyond the tokenizer (the model's
padded vocabulary rows) contribute no bytes either.
"""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable stand-in character → raw byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return type(backend.decoder).__name__ == "ByteLevel"


def vocab_bytes(tokenizer, vocab_size: int | None = None) -> tuple[bytes, ...]:
    """Per-id byte strings for ids ``0 .. vocab_size-1`` (default: the tokenizer's length).

    Cached per tokenizer object and size, since building it walks the whole vocabulary.
    """
    size = len(tokenizer) if vocab_size is None else vocab_size
    return _vocab_bytes_cached(tokenizer, size)


@functools.lru_cache(maxsize=8)
def _vocab_bytes_cached(tokenizer, size: int) -> tuple[bytes, ...]:
    """The tokenizer's table cut or padded (empty bytes) to ``size``. One walk of the vocabulary
    serves every size: a run asks for the tokenizer's length (SFT warm-up) and for the model's
    padded vocabulary (rollouts), and each walk of Qwen's 151k tokens takes half a second."""
    table = _tokenizer_bytes(tokenizer, len(tokenizer))
    if size == len(table):
        return table
    return table[:size] + (b"",) * (size - len(table))


@functools.lru_cache(maxsize=4)
def _tokenizer_bytes(tokenizer, n: int) -> tuple[bytes, ...]:
    """Bytes of ids ``0 .. n-1`` (``n`` = the tokenizer's length, in the key so added tokens refresh it)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids)
    special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    out: list[bytes] = []
    if _is_byte_level(tokenizer):
        decoder = _byte_level_decoder()
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
            elif all(ch in decoder for ch in piece):
                out.append(bytes(decoder[ch] for ch in piece))
            else:  # an added (non-special) token stored as plain text
                out.append(piece.encode("utf-8"))
    else:  # SentencePiece-style: "▁" is a space, "<0xNN>" is a raw byte
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
                continue
            fallback = _BYTE_FALLBACK.match(piece)
            out.append(bytes([int(fallback.group(1), 16)]) if fallback else piece.replace("▁", " ").encode())
    return tuple(out)


def decode_bytes(ids, table: tuple[bytes, ...]) -> bytes:
    """The bytes of a sequence of ids (special tokens contribute nothing)."""
    return b"".join(table[int(i)] for i in ids)


def decode_text(ids, table: tuple[bytes, ...]) -> str:
    """Decoded text of ``ids``; invalid UTF-8 (a character cut by a cap) becomes U+FFFD as in HF decode."""
    return decode_bytes(ids, table).decode("utf-8", errors="replace")


def char_offsets(ids, table: tuple[bytes, ...]) -> list[int]:
    """``offsets[i]`` = number of characters decoded from ``ids[:i]`` (len(ids)+1 entries).

    Counts characters the way :func:`decode_text` produces them, so a character split over
    two tokens is assigned to the token that completes it. Used to map a regex span found in
    an action's text back to the token positions that produced it.
    """
    offsets = [0]
    data = b""
    for i in ids:
        data += table[int(i)]
        offsets.append(len(data.decode("utf-8", errors="ignore")))
    return offsets
