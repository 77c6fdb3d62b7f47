"""Question-answer records from FlashRAG JSONL and Search-R1 parquet files (SPEC §7).

Both formats reduce to one record: ``id``, ``question``, ``golden_answers`` and
``data_source`` (one of the seven benchmark names below). Training and evaluation read
the same loader, so a bad row is reported the same way everywhere: a
:class:`DataRowError` naming the file, the 1-based line (JSONL) or row (parquet) and the
field, raised before any model work starts.

Search-R1 parquet rows keep the question inside the chat prompt and the gold answers in
``reward_model.ground_truth.target``; the FlashRAG-derived slices add plain ``question``
and ``golden_answers`` columns. Plain columns win when present, otherwise the nested
ones are used. The prompt text is never kept: the rollout rebuilds it (SPEC §2), so one
protocol applies to both formats.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llds_jax.errors import InputError

# Paper table order (Table 1): general QA, then multi-hop QA.
GENERAL_QA = ("nq", "triviaqa", "popqa")
MULTI_HOP_QA = ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
BENCHMARKS = GENERAL_QA + MULTI_HOP_QA
DISPLAY_NAMES = {
    "nq": "NQ",
    "triviaqa": "TriviaQA",
    "popqa": "PopQA",
    "hotpotqa": "HotpotQA",
    "2wikimultihopqa": "2Wiki",
    "musique": "Musique",
    "bamboogle": "Bamboogle",
}
_ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "natural_questions": "nq", "tqa": "triviaqa"}
_QUESTION_IN_PROMPT = re.compile(r"Question:\s*(.+?)\s*$", re.DOTALL)


class DataRowError(InputError):
    """A row that cannot become a :class:`QARecord`; says where and which field."""

    def __init__(self, path: str | Path, line: int, field: str, problem: str, *, unit: str = "line"):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        super().__init__(f"{path}:{unit} {line}: field {field!r}: {problem}")


@dataclasses.dataclass(frozen=True)
class QARecord:
    """One question with every accepted gold answer (EM against any of them counts)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str


def canonical_data_source(name: str) -> str | None:
    """The benchmark name for ``name`` (case and alias tolerant), or None if unknown."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in BENCHMARKS else None


def data_source_from_filename(path: str | Path) -> str | None:
    """``nq.dev200.jsonl`` → ``nq``; FlashRAG directories name files after the benchmark."""
    path = Path(path)
    for candidate in (path.name.split(".")[0], path.name.split("_")[0], path.parent.name):
        source = canonical_data_source(candidate)
        if source is not None:
            return source
    return None


def load_qa_file(path: str | Path, *, data_source: str | None = None, limit: int | None = None) -> list[QARecord]:
    """Load a FlashRAG ``.jsonl`` or Search-R1 ``.parquet`` file by its suffix.

    ``data_source`` overrides the per-row column and the file-name guess; ``limit`` keeps
    the first ``limit`` rows (every kept row is still validated).
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return load_flashrag_jsonl(path, data_source=data_source, limit=limit)
    if path.suffix == ".parquet":
        return load_searchr1_parquet(path, data_source=data_source, limit=limit)
    raise ValueError(f"{path}: unknown QA file type {path.suffix!r} (expected .jsonl or .parquet)")


def load_flashrag_jsonl(
    path: str | Path, *, data_source: str | None = None, limit: int | None = None
) -> list[QARecord]:
    """Rows ``{"id", "question", "golden_answers", "metadata"?}``, one JSON object per line."""
    path = Path(path)
    default_source = _resolve_default_source(path, data_source)
    records: list[QARecord] = []
    line_numbers: list[int] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, text in enumerate(handle, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataRowError(path, line_number, "<json>", f"not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataRowError(path, line_number, "<json>", f"expected an object, got {type(row).__name__}")
            records.append(_record_from_row(row, path, line_number, default_source, unit="line"))
            line_numbers.append(line_number)
    _check_unique_ids(records, line_numbers, path, unit="line")
    return records


def load_searchr1_parquet(
    path: str | Path, *, data_source: str | None = None, limit: int | None = None
) -> list[QARecord]:
    """Search-R1 rows: ``data_source``, ``prompt``, ``reward_model.ground_truth.target``, ``extra_info``."""
    import pyarrow.parquet as pq

    path = Path(path)
    table = pq.read_table(path)
    if limit is not None:
        table = table.slice(0, limit)
    default_source = _resolve_default_source(path, data_source, required=False)
    records = [
        _record_from_row(row, path, row_number, default_source, unit="row", source_forced=data_source is not None)
        for row_number, row in enumerate(table.to_pylist(), start=1)
    ]
    _check_unique_ids(records, range(1, len(records) + 1), path, unit="row")
    return records


def load_qa_files(paths: Iterable[str | Path], *, limit: int | None = None) -> dict[str, list[QARecord]]:
    """Several files grouped by data source, in the paper's benchmark order."""
    grouped: dict[str, list[QARecord]] = {}
    for path in paths:
        for record in load_qa_file(path, limit=limit):
            grouped.setdefault(record.data_source, []).append(record)
    return {source: grouped[source] for source in sorted(grouped, key=benchmark_sort_key)}


def benchmark_sort_key(source: str) -> tuple[int, str]:
    """Paper order for the seven benchmarks, then anything else alphabetically."""
    return (BENCHMARKS.index(source), source) if source in BENCHMARKS else (len(BENCHMARKS), source)


def _resolve_default_source(path: Path, data_source: str | None, *, required: bool = True) -> str | None:
    if data_source is not None:
        source = canonical_data_source(data_source)
        if source is None:
            raise ValueError(f"{path}: unknown data_source {data_source!r}; known: {', '.join(BENCHMARKS)}")
        return source
    source = data_source_from_filename(path)
    if source is None and required:
        raise ValueError(
            f"{path}: cannot tell the benchmark from the file name; pass data_source= (one of {', '.join(BENCHMARKS)})"
        )
    return source


def _record_from_row(
    row: Mapping[str, Any],
    path: Path,
    line: int,
    default_source: str | None,
    *,
    unit: str,
    source_forced: bool = False,
) -> QARecord:
    def fail(field: str, problem: str) -> DataRowError:
        return DataRowError(path, line, field, problem, unit=unit)

    source = default_source
    if not source_forced and row.get("data_source") is not None:
        source = canonical_data_source(str(row["data_source"]))
        if source is None:
            raise fail("data_source", f"unknown benchmark {row['data_source']!r}; known: {', '.join(BENCHMARKS)}")
    if source is None:
        raise fail("data_source", "missing, and the file name does not name a benchmark")

    question = _question_of(row, fail)
    answers = _golden_answers_of(row, fail)
    return QARecord(id=_id_of(row, fail, line), question=question, golden_answers=answers, data_source=source)


def _id_of(row: Mapping[str, Any], fail, line: int) -> str:
    value = row.get("id")
    if value is None:
        extra = row.get("extra_info") or {}
        if isinstance(extra, Mapping) and extra.get("index") is not None:
            return f"{extra.get('split', 'row')}_{extra['index']}"
        return f"row_{line}"
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise fail("id", f"expected a string or integer, got {type(value).__name__}")
    return str(value)


def _question_of(row: Mapping[str, Any], fail) -> str:
    if "question" in row and row["question"] is not None:
        question = row["question"]
        if not isinstance(question, str):
            raise fail("question", f"expected a string, got {type(question).__name__}")
        if not question.strip():
            raise fail("question", "empty")
        return question.strip()
    prompt = row.get("prompt")
    if prompt is None:
        raise fail("question", "missing (and no 'prompt' to take it from)")
    if not isinstance(prompt, Sequence) or not prompt or not isinstance(prompt[-1], Mapping):
        raise fail("prompt", "expected a non-empty list of chat messages")
    match = _QUESTION_IN_PROMPT.search(str(prompt[-1].get("content", "")))
    if match is None:
        raise fail("prompt", "last message has no 'Question: ...' to take the question from")
    return match.group(1)


def _golden_answers_of(row: Mapping[str, Any], fail) -> tuple[str, ...]:
    field, answers = "golden_answers", row.get("golden_answers")
    if answers is None:
        field = "reward_model.ground_truth.target"
        try:
            answers = row["reward_model"]["ground_truth"]["target"]
        except (KeyError, TypeError):
            raise fail("golden_answers", "missing (neither 'golden_answers' nor 'reward_model.ground_truth.target')") from None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, Sequence) or len(answers) == 0:
        raise fail(field, "expected a non-empty list of answers")
    for index, answer in enumerate(answers):
        if not isinstance(answer, str | int | float) or isinstance(answer, bool):
            raise fail(f"{field}[{index}]", f"expected a string, got {type(answer).__name__}")
    cleaned = tuple(str(answer).strip() for answer in answers)
    if not any(cleaned):
        raise fail(field, "every answer is empty")
    return tuple(answer for answer in cleaned if answer)


def _check_unique_ids(records: Sequence[QARecord], lines: Iterable[int], path: Path, *, unit: str) -> None:
    """Duplicate ids would merge two questions in per-question bookkeeping (GRPO groups, eval)."""
    first_seen: dict[str, int] = {}
    for position, record in zip(lines, records, strict=True):
        if record.id in first_seen:
            raise DataRowError(path, position, "id", f"duplicate id {record.id!r} (first at {unit} {first_seen[record.id]})", unit=unit)
        first_seen[record.id] = position
