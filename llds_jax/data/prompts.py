"""Training questions and the resumable iterator that hands them out one rollout batch at a time.

Sources are FlashRAG JSONL or Search-R1 parquet files (read by ``llds_jax.data.benchmarks``,
the same loader evaluation uses) or ``bundled:<name>`` for the package data cut by
``llds_jax.data.make_bundle`` (so the default job never needs ``../shared``).

The iterator's state is three integers — ``epoch``, ``position`` and the shuffle ``seed`` — and
the order of an epoch is a pure function of ``(seed, epoch)``. Resuming therefore *restores*
the state instead of fast-forwarding through batches, and is exact.

Every prompt carries a ``uid`` (its row in the concatenated dataset). GRPO groups are keyed by
prompt, not by a per-dataset index as in the reference (which merged an NQ and a HotpotQA
question sharing an index into one group; SPEC §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llds_jax.data.benchmarks import QARecord, load_qa_file

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
BUNDLED_PREFIX = "bundled:"


def bundled_path(name: str) -> Path:
    """``bundled:nq_train`` → the JSONL file shipped inside the package."""
    path = BUNDLED_DIR / f"{name}.jsonl"
    if name == "corpus":
        return path
    if not path.exists():
        known = sorted(p.stem for p in BUNDLED_DIR.glob("*.jsonl") if p.stem != "corpus")
        raise FileNotFoundError(f"no bundled question file {name!r}; bundled: {known}")
    return path


def resolve_source(source: str) -> Path:
    if source.startswith(BUNDLED_PREFIX):
        return bundled_path(source[len(BUNDLED_PREFIX):])
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"training data file {source!r} does not exist")
    return path


def load_questions(sources: Sequence[str], limit_per_source: int | None = None) -> list[QARecord]:
    """All records of all sources, in order; fails naming the source if one is empty."""
    if isinstance(sources, str):
        sources = [sources]
    records: list[QARecord] = []
    for source in sources:
        rows = load_qa_file(resolve_source(source), limit=limit_per_source)
        if not rows:
            raise ValueError(f"data.train source {source!r} has no rows")
        records.extend(rows)
    return records


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    records: tuple[QARecord, ...]
    uids: np.ndarray  # int64 [B]: row of each prompt in the concatenated dataset
    epoch: int


class PromptIterator:
    """Endless, shuffled, drop-last batches of ``batch_size`` questions with exact resume."""

    def __init__(self, records: Sequence[QARecord], batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be ≥ 1")
        if batch_size > len(records):
            raise ValueError(f"batch_size={batch_size} prompts per step but the training set has only "
                             f"{len(records)} questions")
        self.records = list(records)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch:
        if self.position + self.batch_size > len(self.records):
            self.epoch, self.position = self.epoch + 1, 0
        uids = self._order(self.epoch)[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return PromptBatch(tuple(self.records[i] for i in uids), uids.astype(np.int64), self.epoch)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.records) // self.batch_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_records": len(self.records), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved position; refuses a state saved for a different dataset size."""
        if state["num_records"] != len(self.records):
            raise ValueError(f"iterator state was saved for {state['num_records']} questions, "
                             f"this training set has {len(self.records)}")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
