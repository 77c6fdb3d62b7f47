"""`Hit` and `format_docs` reproduce the text Search-R1's trainer shows the model."""

from __future__ import annotations

import pytest

from llds_jax.retrieval import Hit, format_docs
from llds_jax.retrieval.hit import check_search_args

pytestmark = pytest.mark.unit


def search_r1_passages2string(contents_list: list[str]) -> str:
    """Search-R1 search_r1/llm_agent/generation.py `_passages2string`, restated as the oracle."""
    out = ""
    for idx, content in enumerate(contents_list):
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        out += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return out


CONTENTS = [
    '"Padithal Mattum Podhuma"\nPadithal Mattum Podhuma () is a 1962 Indian Tamil language film.',
    '"Multi\nline"\nsecond line\nthird line',
    "no newline at all",
    '"Trailing"\n',
]


def test_format_docs_matches_search_r1_passages2string_byte_for_byte():
    hits = [Hit(id=str(i), contents=c, score=1.0 - i) for i, c in enumerate(CONTENTS)]
    assert format_docs(hits) == search_r1_passages2string(CONTENTS)


def test_title_keeps_quotes_like_the_reference_trainer_and_bare_title_strips_them():
    hit = Hit(id="1", contents=CONTENTS[0], score=0.0)
    assert hit.title == '"Padithal Mattum Podhuma"'
    assert hit.bare_title == "Padithal Mattum Podhuma"
    assert hit.text.startswith("Padithal Mattum Podhuma () is")
    assert format_docs([hit]).startswith('Doc 1(Title: "Padithal Mattum Podhuma") Padithal')


def test_contents_without_newline_is_all_title_and_empty_text():
    hit = Hit(id="x", contents="no newline", score=0.0)
    assert (hit.title, hit.text) == ("no newline", "")


def test_format_docs_of_no_hits_is_empty():
    assert format_docs([]) == ""


def test_hit_is_immutable():
    hit = Hit(id="1", contents="a", score=0.5)
    with pytest.raises(AttributeError):
        hit.score = 1.0


@pytest.mark.parametrize(
    ("queries", "topk", "error"),
    [("one string", 3, TypeError), (["ok", 7], 3, TypeError), (["q"], 0, ValueError), (["q"], True, ValueError),
     (["q"], 2.0, ValueError)],
)
def test_search_args_reject_bare_strings_non_strings_and_bad_topk(queries, topk, error):
    with pytest.raises(error):
        check_search_args(queries, topk)
