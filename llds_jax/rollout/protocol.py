"""The Search-R1 text protocol (SPEC §2): the prompt, action parsing and the feedback messages.

Every string here is copied from the reference (``scripts/data_process/nq_search.py`` and
``search_r1/llm_agent/generation.py``) because the policy is trained on these exact words:
a changed space changes the tokens the model conditions on. All tags are plain text.

This module is pure text ↔ ids; the rollout loop decides *when* each piece is used and
builds the masks from the ids it appends, never by re-tokenising the result.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

from llds_jax.retrieval import format_docs

INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)

# The reference's message after an action with no complete <search>/<answer> block (masked from the loss).
INVALID_ACTION_FEEDBACK = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

ACTION_PATTERN = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

# The closing tags the reference cuts a decoded turn at, in order of preference. Decoding stops
# by the rule in llds_jax/rollout/action_stop.py, not at the first of these (see there).
ACTION_STOP_STRINGS: tuple[str, ...] = ("</search>", "</answer>")

ActionKind = Literal["search", "answer", "invalid"]


def format_question(question: str) -> str:
    """Strip the question and append ``?`` when missing, as the reference's data script does."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return question


def user_prompt(question: str) -> str:
    """The single user message: the instruction followed by ``Question: {q}\\n``."""
    return INSTRUCTION.format(question=format_question(question))


def prompt_text(tokenizer, question: str) -> str:
    """The full prompt text: the user message through the chat template when the tokenizer has one.

    The generation prompt (``<|im_start|>assistant\\n`` for Qwen) is included, so the
    first sampled token is the assistant's first token.
    """
    message = user_prompt(question)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return message


def encode_prompt(tokenizer, question: str, max_prompt_tokens: int) -> list[int]:
    """Prompt ids, keeping the *last* ``max_prompt_tokens`` (the reference's ``[:, -max_start_length:]``)."""
    ids = tokenizer.encode(prompt_text(tokenizer, question), add_special_tokens=False)
    return ids[-max_prompt_tokens:] if max_prompt_tokens > 0 else ids


@dataclasses.dataclass(frozen=True)
class Action:
    """What one action asked for: a search with its query, a final answer, or nothing valid."""

    kind: ActionKind
    content: str = ""

    @property
    def is_valid(self) -> bool:
        return self.kind != "invalid"


def reference_cut_end(text: str | bytes) -> int:
    """Where the reference cuts a decoded turn (``_postprocess_responses``): after the first
    ``</search>`` if the text has one *anywhere*, else after the first ``</answer>``, else
    the end. Works on ``str`` and on UTF-8 ``bytes`` alike (the tags are ASCII)."""
    for tag in ACTION_STOP_STRINGS:
        tag_ = tag if isinstance(text, str) else tag.encode()
        position = text.find(tag_)
        if position >= 0:
            return position + len(tag_)
    return len(text)


def parse_action(action_text: str) -> Action:
    """The reference's parse (``postprocess_predictions``) of one action: cut the text as
    :func:`reference_cut_end` does, then take the first ``<(search|answer)>(.*?)</\\1>``
    block (DOTALL), content stripped. The cut matters: ``<answer> a </search> b </answer>`` is
    invalid (cut after ``</search>``, nothing closes the answer)."""
    match = ACTION_PATTERN.search(action_text[: reference_cut_end(action_text)])
    if match is None:
        return Action("invalid")
    return Action(match.group(1), match.group(2).strip())  # type: ignore[arg-type]


def search_feedback(docs_text: str) -> str:
    """``\\n\\n<information>{docs}</information>\\n\\n`` with the docs stripped, as the reference writes it."""
    return f"\n\n<information>{docs_text.strip()}</information>\n\n"


def encode_feedback(tokenizer, feedback: str, max_obs_tokens: int) -> list[int]:
    """Feedback ids cut to ``max_obs_tokens`` (the reference cuts the id tensor, so a tag may be lost)."""
    ids = tokenizer.encode(feedback, add_special_tokens=False)
    return ids[:max_obs_tokens] if max_obs_tokens > 0 else ids


def batch_search_feedback(retriever, queries: Sequence[str], topk: int) -> list[str]:
    """One batched retriever call for all of a turn's queries → one feedback string per query."""
    if not queries:
        return []
    results = retriever.search(list(queries), topk)
    if len(results) != len(queries):
        raise ValueError(f"retriever returned {len(results)} result lists for {len(queries)} queries")
    return [search_feedback(format_docs(hits)) for hits in results]
