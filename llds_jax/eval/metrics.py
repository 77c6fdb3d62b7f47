"""Scores of evaluated responses, per data source and averaged, in the paper's table layout.

EM, F1 and substring-EM are :mod:`llds_jax.rollout.reward`'s functions applied to the
last answer the *model* wrote (the rollout keeps it apart from the prompt's example and
the retrieved documents), so evaluation and the training reward agree by construction.
A response without a complete ``<answer>`` scores 0 on all three.

The average ("Avg") is the unweighted mean over the data sources evaluated, as in the
paper's Tables 1–2 (Bamboogle's 125 questions weigh as much as TriviaQA's 11,313).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from llds_jax.data.benchmarks import BENCHMARKS, DISPLAY_NAMES, GENERAL_QA, benchmark_sort_key
from llds_jax.rollout.reward import exact_match, substring_match, token_f1

# (key, row label in the table, digits)
TABLE_ROWS = (
    ("em", "EM", 3),
    ("f1", "F1", 3),
    ("subem", "substring EM", 3),
    ("searches_per_question", "searches / question", 2),
    ("valid_action_rate", "valid-action rate", 3),
    ("finished_rate", "finished rate", 3),
    ("mean_response_length", "mean response length (tokens)", 1),
)


@dataclasses.dataclass(frozen=True)
class EvalResponse:
    """One evaluated question: what the model answered and how it got there."""

    id: str
    data_source: str
    question: str
    golden_answers: tuple[str, ...]
    answer: str | None  # content of the model's last complete <answer>, None if it gave none
    searches: int
    valid_actions: int
    actions: int
    finished: bool
    response_length: int  # response tokens, feedback included
    response_text: str = ""


@dataclasses.dataclass(frozen=True)
class Scores:
    em: float
    f1: float
    subem: float


def score_response(response: EvalResponse) -> Scores:
    if response.answer is None:
        return Scores(0.0, 0.0, 0.0)
    gold = response.golden_answers
    return Scores(exact_match(response.answer, gold), token_f1(response.answer, gold),
                  substring_match(response.answer, gold))


def summarize(responses: Iterable[EvalResponse]) -> dict[str, dict[str, float]]:
    """``{data_source: metrics}`` in paper order, plus ``"average"`` over the sources present."""
    grouped: dict[str, list[EvalResponse]] = {}
    for response in responses:
        grouped.setdefault(response.data_source, []).append(response)
    per_source = {source: _source_metrics(grouped[source]) for source in sorted(grouped, key=benchmark_sort_key)}
    if per_source:
        keys = [key for key, _, _ in TABLE_ROWS]
        per_source["average"] = {key: sum(m[key] for m in per_source.values()) / len(per_source) for key in keys}
        per_source["average"]["n"] = sum(m["n"] for source, m in per_source.items() if source != "average")
    return per_source


def _source_metrics(responses: Sequence[EvalResponse]) -> dict[str, float]:
    scores = [score_response(r) for r in responses]
    n = len(responses)
    actions = sum(r.actions for r in responses)
    return {
        "n": n,
        "em": sum(s.em for s in scores) / n,
        "f1": sum(s.f1 for s in scores) / n,
        "subem": sum(s.subem for s in scores) / n,
        "searches_per_question": sum(r.searches for r in responses) / n,
        "valid_action_rate": sum(r.valid_actions for r in responses) / actions if actions else math.nan,
        "finished_rate": sum(r.finished for r in responses) / n,
        "mean_response_length": sum(r.response_length for r in responses) / n,
    }


def markdown_table(summary: Mapping[str, Mapping[str, float]], *, title: str = "", decoding: str = "") -> str:
    """Rows = metrics, columns = NQ, TriviaQA, PopQA | HotpotQA, 2Wiki, Musique, Bamboogle | Avg.

    All seven benchmark columns always appear (``—`` when not evaluated) so tables from
    different runs line up with each other and with the paper's Tables 1–2.
    """
    columns = [DISPLAY_NAMES[s] for s in BENCHMARKS]
    extra = [s for s in summary if s not in BENCHMARKS and s != "average"]
    lines = []
    if title:
        lines += [f"### {title}", ""]
    if decoding:
        lines += [f"Decoding: {decoding}.", ""]
    general = ", ".join(DISPLAY_NAMES[s] for s in GENERAL_QA)
    multi_hop = ", ".join(DISPLAY_NAMES[s] for s in BENCHMARKS[len(GENERAL_QA):])
    lines += [f"General QA: {general}; multi-hop QA: {multi_hop}.", ""]
    header = ["metric", *columns, *extra, "Avg"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    counts = ["n"] + [str(int(summary[s]["n"])) if s in summary else "—" for s in [*BENCHMARKS, *extra]]
    counts.append(str(int(summary["average"]["n"])) if "average" in summary else "—")
    lines.append("| " + " | ".join(counts) + " |")
    for key, label, digits in TABLE_ROWS:
        cells = [label] + [_cell(summary.get(s, {}).get(key), digits) for s in [*BENCHMARKS, *extra, "average"]]
        lines.append("| " + " | ".join(cells) + " |")
    evaluated = [s for s in summary if s != "average"]
    if 0 < len(evaluated) < len(BENCHMARKS):
        lines += ["", f"Avg is over the {len(evaluated)} evaluated data source(s) only."]
    return "\n".join(lines) + "\n"


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"
