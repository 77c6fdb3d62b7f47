"""The free-form lab world's writing: stochastic thoughts and paraphrased queries (issue 43).

Why: in the first lab world every trajectory's first action is one fixed thought plus the
entity's name copied verbatim, so all members of a GRPO group write the same first action. GRPO
advantages sum to zero in a group, so tokens whose prefix every member shares get no net
on-policy gradient, and the policy sits at p ≈ 0.98 per token where the paper's
prediction-error similarity ⟨e_y − π, e_y′ − π′⟩ ≤ 2(1 − p⁺)(1 − p⁻) is ≈ 10⁻³. The paper's
mechanism needs near-duplicates that are never duplicates (its first action decays first).

Here the pre-training trajectories are written with

* a thought drawn from a seeded Markov chain over a small reasoning lexicon (:data:`CHAIN`),
  with the entity's name inserted at a random word boundary with probability ``entity_prob``;
* a search query drawn from paraphrase templates (:data:`QUERY_TEMPLATES`) around the entity's
  name — every template keeps the full name, so BM25's top hit stays the entity's passage
  (``tests/lab/test_freeform.py`` checks every variant over a world).

So a policy pre-trained on them samples group members that differ in wording but agree in
substance, with token entropy well above the fixed world's ≈ 0.1 nat.
"""

from __future__ import annotations

import numpy as np

# Reasoning lexicon as a Markov chain: word -> successors. "<e>" is where an entity may go; "</>"
# ends the thought. Successor weights are drawn per world from the policy seed (see thought()).
CHAIN: dict[str, tuple[str, ...]] = {
    "<s>": ("I", "Let", "First", "The", "To", "Okay"),
    "I": ("need", "should", "will", "must"),
    "Let": ("me",),
    "me": ("search", "check", "find", "look"),
    "First": ("I", "let"),
    "let": ("me",),
    "The": ("question", "answer"),
    "To": ("answer", "find"),
    "Okay": ("I", "let", "the"),
    "the": ("question", "answer", "passage", "name", "facts"),
    "need": ("to",),
    "should": ("search", "check", "find", "look"),
    "will": ("search", "check", "find", "look"),
    "must": ("search", "check", "find"),
    "to": ("search", "find", "check", "look", "answer"),
    "search": ("for", "the", "</>"),
    "check": ("the", "this", "</>"),
    "find": ("the", "out", "this", "</>"),
    "look": ("up", "for"),
    "up": ("the", "this", "</>"),
    "for": ("the", "this", "</>"),
    "out": ("the", "more", "</>"),
    "this": ("first", "now", "</>"),
    "first": ("</>",),
    "now": ("</>",),
    "more": ("</>",),
    "question": ("asks", "is", "needs"),
    "asks": ("about", "for"),
    "is": ("about", "simple", "</>"),
    "needs": ("a", "one", "the"),
    "a": ("search", "passage", "fact"),
    "one": ("search", "fact"),
    "about": ("the", "this", "</>"),
    "simple": ("</>",),
    "answer": ("is", "needs", "the", "</>"),
    "passage": ("</>", "first", "now"),
    "name": ("first", "</>"),
    "facts": ("first", "</>"),
    "fact": ("</>",),
}
ANSWER_STARTS = ("I found the answer.", "The passage says it.", "Now I know.", "The answer is clear.",
                 "I have it now.", "That is the answer.")
# Every template keeps the whole name: BM25 scores the name's rare words, so the top hit stays put.
QUERY_TEMPLATES = ("{e}", "{e}", "about {e}", "{e} facts", "who or what is {e}", "information on {e}",
                   "{e} details", "search {e}")
MAX_THOUGHT_WORDS = 12
# The first world's fixed thoughts (``lab.policy.writing = "fixed"``).
SEARCH_THOUGHT = "<think> I need to search. </think>\n"
BRIDGE_THOUGHT = "<think> I need to search {bridge}. </think>\n"
ANSWER_THOUGHT = "<think> I found the answer. </think>\n"


def chain_weights(seed: int) -> dict[str, np.ndarray]:
    """Per-word successor probabilities, drawn once from ``seed`` (Dirichlet(1): uneven, never degenerate)."""
    rng = np.random.default_rng(seed + 7)
    return {word: rng.dirichlet(np.ones(len(nexts))) for word, nexts in CHAIN.items()}


def thought(rng: np.random.Generator, weights: dict[str, np.ndarray], entity: str, entity_prob: float) -> str:
    """One ``<think> … </think>`` line: a walk of the chain (≤ MAX_THOUGHT_WORDS words), the entity
    inserted at a random word boundary with probability ``entity_prob``."""
    words, word = [], "<s>"
    while len(words) < MAX_THOUGHT_WORDS:
        word = CHAIN[word][rng.choice(len(CHAIN[word]), p=weights[word])]
        if word == "</>":
            break
        words.append(word)
    if entity and rng.random() < entity_prob:
        words.insert(int(rng.integers(0, len(words) + 1)), entity)
    return f"<think> {' '.join(words)}. </think>\n"


def answer_thought(rng: np.random.Generator) -> str:
    return f"<think> {ANSWER_STARTS[rng.integers(len(ANSWER_STARTS))]} </think>\n"


def query(rng: np.random.Generator, entity: str) -> str:
    return QUERY_TEMPLATES[rng.integers(len(QUERY_TEMPLATES))].format(e=entity)



class Writing:
    """How pre-training trajectories word their thoughts and queries (``lab.policy.writing``).

    ``fixed``: the first world's one thought per action kind and the bare entity name as the
    query (no randomness: its cached policies stay valid). ``freeform``: :func:`thought`,
    :func:`answer_thought` and :func:`query`, drawn from ``rng``.
    """

    def __init__(self, mode: str = "fixed", rng: np.random.Generator | None = None, seed: int = 0,
                 entity_prob: float = 0.3):
        if mode not in ("fixed", "freeform"):
            raise ValueError(f"lab.policy.writing={mode!r}: expected 'fixed' or 'freeform'")
        self.mode, self.rng, self.entity_prob = mode, rng or np.random.default_rng(seed), entity_prob
        self.weights = chain_weights(seed) if mode == "freeform" else None

    def search_thought(self, entity: str) -> str:
        if self.mode == "fixed":
            return SEARCH_THOUGHT
        return thought(self.rng, self.weights, entity, self.entity_prob)

    def bridge_thought(self, bridge: str) -> str:
        if self.mode == "fixed":
            return BRIDGE_THOUGHT.format(bridge=bridge)
        return thought(self.rng, self.weights, bridge, max(self.entity_prob, 0.5))

    def answer_thought(self) -> str:
        return ANSWER_THOUGHT if self.mode == "fixed" else answer_thought(self.rng)

    def query(self, entity: str) -> str:
        return entity if self.mode == "fixed" else query(self.rng, entity)
