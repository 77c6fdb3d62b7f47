"""The Search-R1 reward: exact match of the model's last ``<answer>`` (SPEC §3), plus F1 and substring-EM.

Normalisation follows the SQuAD/Search-R1 ``normalize_answer`` in its exact order —
lowercase, drop ASCII punctuation, replace the whole words a/an/the by a space, collapse
whitespace — because the order changes results: ``"the-end"`` becomes ``"theend"`` here, but
``"end"`` if articles were removed before punctuation.

Only text the model wrote may be passed here. The reference scores the whole decoded
sequence (prompt included) and therefore has to skip the prompt's example
``<answer> Beijing </answer>`` by requiring two matches; the rollout instead keeps the
model's actions apart from the prompt and the tool feedback and calls these functions on
action text only, so the rule here is simply "the last complete answer span".
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np

ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SPEC §3 normaliser (SQuAD order: lower → punctuation → articles → whitespace)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of every complete ``<answer>…</answer>``, tags included."""
    return [m.span() for m in ANSWER_PATTERN.finditer(text)]


def extract_answer(response_text: str) -> str | None:
    """The content of the last complete ``<answer>…</answer>`` in the model's text, stripped.

    ``None`` when there is no complete answer span (an unclosed ``<answer>`` does not count).
    """
    matches = ANSWER_PATTERN.findall(response_text)
    if not matches:
        return None
    return matches[-1].strip()


def _as_list(golden_answers: str | Sequence[str]) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in golden_answers]


def exact_match(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golden_answers)))


def substring_match(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """1.0 when any normalised gold answer occurs inside the normalised prediction (Search-R1 ``subem``)."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in _as_list(golden_answers)))


def token_f1(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """SQuAD token F1 over normalised whitespace tokens, the best over the gold answers."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in _as_list(golden_answers):
        gold_tokens = normalize_answer(gold).split()
        common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision = overlap / len(pred_tokens)
        recall = overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def em_reward(response_text: str, golden_answers: str | Sequence[str]) -> float:
    """SPEC §3 reward: EM of the last ``<answer>`` in ``response_text``; 0.0 when there is none.

    No format reward: a well-formed wrong answer and a missing answer both score 0.
    """
    answer = extract_answer(response_text)
    return 0.0 if answer is None else exact_match(answer, golden_answers)


def em_rewards(answers: Sequence[str | None], golden_answers_per_row: Sequence[str | Sequence[str]]) -> np.ndarray:
    """``[N]`` float32 EM rewards from already-extracted answers (``None`` scores 0)."""
    if len(answers) != len(golden_answers_per_row):
        raise ValueError(f"{len(answers)} answers for {len(golden_answers_per_row)} gold lists")
    return np.array([0.0 if a is None else exact_match(a, g) for a, g in zip(answers, golden_answers_per_row)],
                    np.float32)


def f1_reward(response_text: str, golden_answers: str | Sequence[str]) -> float:
    """Token F1 of the last ``<answer>``; 0.0 when there is none (a metric, not the training reward)."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else token_f1(answer, golden_answers)


def substring_em_reward(response_text: str, golden_answers: str | Sequence[str]) -> float:
    """Substring-EM of the last ``<answer>``; 0.0 when there is none (a metric, not the training reward)."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else substring_match(answer, golden_answers)
