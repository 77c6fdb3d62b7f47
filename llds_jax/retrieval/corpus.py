"""Random access to a Search-R1 / FlashRAG JSONL corpus without loading it.

wiki-18 has 21M rows; holding them as Python strings costs tens of GB, and the
reference server's ``datasets.load_dataset`` spends minutes building an Arrow cache.
A retriever only ever needs "give me rows 17, 3, 9000", so we keep one int64 byte
offset per row (168 MB for 21M rows) in a ``.npy`` file memory-mapped at open, and
read each row with ``os.pread`` (thread-safe: the HTTP server reads from worker threads).

Every row is parsed and checked once, while the offsets are built, so a bad row fails
then with its file, line number and field — not halfway through a training run.
Gzipped corpora are decompressed once into the cache (gzip has no random access).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from llds_jax.errors import InputError
from llds_jax.utils.assets import cache_dir

OFFSETS_SUFFIX = ".offsets.npy"


class CorpusFormatError(InputError):
    """A corpus row that is not ``{"id": str|int, "contents": str}``; the message names file and line."""


def corpus_fingerprint(path: str | os.PathLike) -> str:
    """Short hash of (absolute path, size, mtime): changes whenever the file is replaced or edited."""
    path = Path(path)
    info = path.stat()
    return hashlib.sha1(f"{path.resolve()}|{info.st_size}|{info.st_mtime_ns}".encode()).hexdigest()[:16]


def _atomic_write_npy(target: Path, array: np.ndarray) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, array)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared corpus's index from other users
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse_row(line: bytes, source: str, line_number: int) -> tuple[str, str]:
    """``(id, contents)`` of one JSONL line; integer ids (some FlashRAG dumps) become strings."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorpusFormatError(f"{source}:{line_number}: not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise CorpusFormatError(f"{source}:{line_number}: expected a JSON object, got {type(row).__name__}")
    for field in ("id", "contents"):
        if field not in row:
            raise CorpusFormatError(f"{source}:{line_number}: missing field '{field}'")
    row_id, contents = row["id"], row["contents"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise CorpusFormatError(f"{source}:{line_number}: field 'id' must be a string, got {type(row_id).__name__}")
    if not isinstance(contents, str):
        raise CorpusFormatError(
            f"{source}:{line_number}: field 'contents' must be a string, got {type(contents).__name__}"
        )
    return str(row_id), contents


def build_offsets(jsonl_path: Path, source: str) -> np.ndarray:
    """Byte offset of every non-blank line, plus the file size as a final sentinel."""
    offsets: list[int] = []
    position = 0
    with open(jsonl_path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                parse_row(line, source, line_number)
                offsets.append(position)
            position += len(line)
    if not offsets:
        raise CorpusFormatError(f"{source}: corpus has no rows")
    offsets.append(position)
    return np.asarray(offsets, dtype=np.int64)


def _plain_jsonl(path: Path) -> Path:
    """The path itself, or a once-decompressed copy in the cache for ``.gz`` corpora."""
    if path.suffix != ".gz":
        return path
    target = cache_dir() / "corpora" / f"{path.name.removesuffix('.gz')}.{corpus_fingerprint(path)}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        try:
            with gzip.open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


def _marked_read_only(directory: Path) -> bool:
    """No write bit at all: honoured even for root, who could write anyway (shared data dirs)."""
    return not directory.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def _offsets_candidates(corpus_path: Path, plain: Path) -> tuple[list[Path], list[Path]]:
    """(where to look, where to write): beside the corpus (the issue's layout), else the cache.

    A directory marked read-only is never written, even by root (shared data dirs).
    """
    cached = cache_dir() / "corpus_offsets" / f"{corpus_path.name}.{corpus_fingerprint(plain)}{OFFSETS_SUFFIX}"
    beside = corpus_path.with_name(corpus_path.name + OFFSETS_SUFFIX)
    writable = [cached] if _marked_read_only(corpus_path.parent) else [beside, cached]
    return [beside, cached], writable


def _load_fresh_offsets(candidate: Path, plain: Path) -> np.ndarray | None:
    if not candidate.exists() or candidate.stat().st_mtime_ns < plain.stat().st_mtime_ns:
        return None
    offsets = np.load(candidate, mmap_mode="r")
    if offsets.ndim != 1 or len(offsets) < 2 or int(offsets[-1]) != plain.stat().st_size:
        return None
    return offsets


class Corpus:
    """Rows of a JSONL corpus by position (the row number faiss and BM25 return)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"corpus not found: {self.path}")
        self._plain = _plain_jsonl(self.path)
        self._offsets = self._open_offsets()
        self._fd = os.open(self._plain, os.O_RDONLY)

    def _open_offsets(self) -> np.ndarray:
        readable, writable = _offsets_candidates(self.path, self._plain)
        for candidate in readable:
            offsets = _load_fresh_offsets(candidate, self._plain)
            if offsets is not None:
                return offsets
        offsets = build_offsets(self._plain, str(self.path))
        for candidate in writable:
            try:
                _atomic_write_npy(candidate, offsets)
                return np.load(candidate, mmap_mode="r")
            except OSError:
                continue
        return offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def __del__(self, _close=os.close):  # os may already be torn down at interpreter exit
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            _close(fd)

    def _line_bytes(self, index: int) -> bytes:
        start, stop = int(self._offsets[index]), int(self._offsets[index + 1])
        return os.pread(self._fd, stop - start, start)

    def row(self, index: int) -> tuple[str, str]:
        """``(id, contents)`` of row ``index`` (0-based, blank lines not counted)."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {self.path} with {len(self)} rows")
        return parse_row(self._line_bytes(index), str(self.path), index + 1)

    def rows(self, indices: Sequence[int]) -> list[tuple[str, str]]:
        return [self.row(int(i)) for i in indices]

    def iter_contents(self, start: int = 0, stop: int | None = None) -> Iterator[str]:
        """Contents of rows ``[start, stop)`` in order (what indexing encodes), read sequentially."""
        stop = len(self) if stop is None else min(stop, len(self))
        if start >= stop:
            return
        with open(self._plain, "rb") as handle:
            handle.seek(int(self._offsets[start]))
            index = start
            for line in handle:
                if not line.strip():
                    continue
                yield parse_row(line, str(self.path), index + 1)[1]
                index += 1
                if index == stop:
                    return
