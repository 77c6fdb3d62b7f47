"""SPEC §3: EM of the model's last <answer>, the normaliser, F1 and substring-EM."""

from __future__ import annotations

import json
import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llds_jax.rollout.reward import (
    em_reward,
    em_rewards,
    exact_match,
    extract_answer,
    f1_reward,
    normalize_answer,
    substring_em_reward,
    token_f1,
)

pytestmark = pytest.mark.unit


def spec_normalize(text: str) -> str:
    """SPEC §3 written out independently: the steps in the stated order, as separate passes."""
    lowered = text.lower()
    no_punct = lowered.translate(str.maketrans("", "", string.punctuation))
    no_articles = re.sub(r"\b(a|an|the)\b", " ", no_punct)
    return re.sub(r"\s+", " ", no_articles).strip()


def _eval_golds(shared_dir):
    for path in sorted((shared_dir / "data" / "eval").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            yield path.name, row["id"], row["golden_answers"]


def test_em_agrees_with_spec_normalisation_on_every_shared_golden_answer(shared_dir):
    checked = 0
    for source, row_id, golds in _eval_golds(shared_dir):
        for gold in golds:
            assert normalize_answer(gold) == spec_normalize(gold), (source, row_id, gold)
            assert em_reward(f"<think>x</think><answer> {gold} </answer>", golds) == 1.0, (source, row_id, gold)
            decorated = f"<answer>The  {gold}.</answer>"  # article, extra space, punctuation
            assert em_reward(decorated, [gold]) == 1.0, (source, row_id, gold, normalize_answer(decorated))
            checked += 1
    assert checked > 1000, f"only {checked} golden answers found under {shared_dir}/data/eval"


@pytest.mark.parametrize(
    "response, golds, expected",
    [
        ("<answer> Beijing </answer>", ["beijing"], 1.0),
        ("<answer>U.S.A.</answer>", ["USA"], 1.0),                               # ASCII punctuation dropped
        ("<answer>the Beatles</answer>", ["Beatles"], 1.0),                       # leading article
        ("<answer>Theatre</answer>", ["atre"], 0.0),                              # 'the' only as a whole word
        ("<answer>A  Tale of Two   Cities</answer>", ["tale of two cities"], 1.0),
        ("<answer>Wilhelm Conrad Röntgen</answer>", ["wilhelm conrad röntgen"], 1.0),  # unicode lowercased
        ("<answer>Wilhelm Conrad Rontgen</answer>", ["Wilhelm Conrad Röntgen"], 0.0),  # no accent folding
        ("<answer>MFSK</answer>", ["Olivia", "MFSK"], 1.0),                       # any of several golds
        ("<answer>Paris</answer>", "Paris", 1.0),                                 # a bare string gold
        ("I think it is Paris.", ["Paris"], 0.0),                                 # no answer block
        ("<answer> Paris", ["Paris"], 0.0),                                       # unclosed block
        ("<answer>London</answer> wait <answer>Paris</answer>", ["Paris"], 1.0),  # the last block counts
        ("<answer>Paris</answer> wait <answer>London</answer>", ["Paris"], 0.0),
        ("<answer>\nParis\n</answer>", ["Paris"], 1.0),                           # DOTALL, stripped
        ("<answer></answer>", ["Paris"], 0.0),
    ],
)
def test_em_reward_edge_cases(response, golds, expected):
    assert em_reward(response, golds) == expected, (response, golds, extract_answer(response))


def test_prompt_example_answer_is_not_the_models_answer():
    from llds_jax.rollout.protocol import user_prompt

    prompt = user_prompt("what is the capital of china")
    assert "<answer> Beijing </answer>" in prompt
    model_text = "<think>I do not know.</think>"
    assert extract_answer(model_text) is None
    assert em_reward(model_text, ["Beijing"]) == 0.0


def test_f1_and_substring_em_are_metrics_on_the_last_answer():
    assert f1_reward("<answer>the city of Paris</answer>", ["Paris"]) == pytest.approx(2 * (1 / 3) / (1 + 1 / 3))
    assert token_f1("Paris France", ["France Paris"]) == 1.0
    assert substring_em_reward("<answer>the city of Paris</answer>", ["Paris"]) == 1.0
    assert substring_em_reward("<answer>Par</answer>", ["Paris"]) == 0.0
    assert f1_reward("no answer", ["Paris"]) == 0.0


def test_em_rewards_scores_extracted_answers_per_row():
    rewards = em_rewards(["Paris", None, "london"], [["paris"], ["paris"], ["London", "UK"]])
    assert rewards.tolist() == [1.0, 0.0, 1.0]


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)


@given(_text)
def test_normalize_is_idempotent_and_matches_spec(text):
    once = normalize_answer(text)
    assert normalize_answer(once) == once
    assert once == spec_normalize(text)


@given(st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=30),
       st.text(alphabet=string.punctuation, max_size=5))
def test_em_ignores_case_ascii_punctuation_and_spacing(text, punct):
    noisy = f"  {punct}{text.upper()}{punct}  "
    assert exact_match(noisy, [text]) == 1.0


@given(_text.filter(lambda s: "</answer>" not in s), _text.filter(lambda s: "<answer>" not in s))
def test_extract_answer_returns_the_last_block_stripped(inner, trailing):
    text = f"<answer>decoy</answer> {trailing} <answer>{inner}</answer>"
    assert extract_answer(text) == inner.strip()


def test_the_trainer_scores_with_this_em_and_no_copy_of_it():
    from llds_jax.train import loop

    assert loop.em_rewards is em_rewards
