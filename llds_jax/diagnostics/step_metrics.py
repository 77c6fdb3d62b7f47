"""The per-step death-spiral diagnostics of SPEC §8, as pure functions of per-response arrays.

Everything here runs on host numpy arrays the trainer already holds after a step (no
extra rollout); the only optional extra cost is Δ, which needs one forward pass of the
updated policy over the step's rollouts. The result is a flat ``{key: float}`` dict with
the keys documented in :mod:`llds_jax.diagnostics`; a statistic with no samples this step
(e.g. no correct response) is ``nan`` so every step has the same keys. Behaviour statistics
(searches, lengths, valid-action and finished rates) are the rollout's own (``rollout/*``), and
the entropy the update's (``policy/entropy``): each metric has one name
(:mod:`llds_jax.diagnostics.keys`).

Definitions (paper §4–5, SPEC §8):

- *correct* response: advantage ``A > 0``; *incorrect*: ``A < 0``. Responses of uniform
  groups (``A = 0``) are neither — they carry no GRPO signal and the paper's per-sample
  analysis (Eq. 3) discards them too.
- *likelihood* of an action: its mean token log-probability under π_old,
  ``Σ_t logπ_old / n_tokens`` in nats per token, averaged over responses. Per token so
  that long and short actions are comparable; ``all`` pools every action of a response.
- *Δ* of a response (or action): ``Σ_t (logπ_new − logπ_old)`` over its action tokens
  after the step's updates, in nats per response (Definition 4.1 is on sequence
  likelihood). The *LLD rate* is the share of correct responses with ``Δ ≤ 0``
  (Eq. 2 with ε = 0); per action it is the share of correct responses' actions.
- *log-odds* of an action (issue 43): the token mean of ``log p − log(1 − p)``, each token's
  value clipped to ±:data:`LOGODDS_CLIP`. Log-probs saturate: a margin m gives
  ``log p = −log(1 + e^−m)``, so a margin falling steadily from 4 looks flat in nats for tens
  of steps and then breaks; the log-odds fall linearly with it (phase II becomes visible).
- *official likelihood* (``diag/ll_official_pos``): the official LLDS code's
  ``pos_avg_old_log_prob`` — Σ log π_old over action tokens of responses with A ≥ 0 divided by
  *all* action tokens of the batch (so its size also moves with the share of A ≥ 0 tokens).
- *identical first actions*: the share of mixed groups (a response with A > 0 and one with
  A < 0) whose members' first actions are the same token ids. GRPO advantages sum to zero in a
  group, so a token whose prefix every member shares gets no net on-policy gradient: where this
  share is high, the first action cannot carry the paper's near-duplicate displacement.
- *first-action correctness* (§5.3): an incorrect response whose first search retrieved
  the same documents as some correct response of the same group. The rate is over the
  incorrect responses of groups that contain a correct response (only those can match).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

ArrayLike = np.ndarray
# Per-token log-odds are clipped here: float32 log-softmax resolves log p only to ≈ 1e-7 near 0,
# i.e. log-odds ≈ 16, so larger values are rounding, not margin (and p = 1 would be +inf).
LOGODDS_CLIP = 15.0


def token_logodds(logp: ArrayLike) -> np.ndarray:
    """``log p − log(1 − p)`` of token log-probs, clipped to ±LOGODDS_CLIP (exact near p = 1 via expm1)."""
    logp = np.minimum(np.asarray(logp, np.float64), 0.0)
    with np.errstate(divide="ignore"):
        value = logp - np.log(-np.expm1(logp))
    return np.clip(value, -LOGODDS_CLIP, LOGODDS_CLIP)


@dataclasses.dataclass(frozen=True)
class ResponseBatch:
    """One step's per-response arrays: ``B`` responses, ``A`` action slots (max_turns + 1).

    Per-action arrays hold sums over that action's tokens; an action a response never
    took has ``tokens_per_action == 0`` and is ignored. Optional fields left ``None``
    drop their metrics instead of faking them.
    """

    advantage: ArrayLike  # [B] GRPO advantage
    reward: ArrayLike  # [B]
    old_logp_per_action: ArrayLike  # [B, A] Σ logπ_old over the action's tokens
    tokens_per_action: ArrayLike  # [B, A] action-token counts
    delta_logp_per_action: ArrayLike | None = None  # [B, A] Σ (logπ_new − logπ_old), after the updates
    group_id: ArrayLike | None = None  # [B] prompt id; GRPO group membership
    # [B] identities (doc ids, or one feedback-ids tuple) of what the first search retrieved; None = no search
    first_search_docs: Sequence[Sequence[object] | None] | None = None
    logodds_per_action: ArrayLike | None = None  # [B, A] Σ clipped per-token log-odds under π_old
    first_action_ids: Sequence[Sequence[int]] | None = None  # [B] token ids of each response's first action

    def __post_init__(self):
        batch = np.shape(self.advantage)[0]
        slots = np.shape(self.tokens_per_action)
        if len(slots) != 2 or slots[0] != batch or np.shape(self.old_logp_per_action) != slots:
            raise ValueError(
                f"per-action arrays must be [B={batch}, A]: tokens {slots}, "
                f"old_logp {np.shape(self.old_logp_per_action)}"
            )
        if self.delta_logp_per_action is not None and np.shape(self.delta_logp_per_action) != slots:
            raise ValueError(f"delta_logp_per_action {np.shape(self.delta_logp_per_action)} != {slots}")
        if self.logodds_per_action is not None and np.shape(self.logodds_per_action) != slots:
            raise ValueError(f"logodds_per_action {np.shape(self.logodds_per_action)} != {slots}")
        for name in ("reward", "group_id", "first_search_docs", "first_action_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != batch:
                raise ValueError(f"{name} has {len(value)} rows, advantage has {batch}")

    @property
    def num_action_slots(self) -> int:
        return int(np.shape(self.tokens_per_action)[1])


def step_diagnostics(batch: ResponseBatch) -> dict[str, float]:
    """All SPEC §8 per-response diagnostics of one step as a flat metrics dict."""
    metrics: dict[str, float] = {}
    advantage = np.asarray(batch.advantage, np.float64)
    correct, incorrect = advantage > 0, advantage < 0
    metrics["diag/frac_correct"] = float(correct.mean()) if advantage.size else np.nan
    metrics["diag/frac_incorrect"] = float(incorrect.mean()) if advantage.size else np.nan
    metrics.update(likelihood_by_action(batch.old_logp_per_action, batch.tokens_per_action, correct, "correct"))
    metrics.update(likelihood_by_action(batch.old_logp_per_action, batch.tokens_per_action, incorrect, "incorrect"))
    metrics["diag/ll_official_pos"] = official_positive_likelihood(batch.old_logp_per_action,
                                                                   batch.tokens_per_action, advantage)
    if batch.logodds_per_action is not None:
        for name, selected in (("correct", correct), ("incorrect", incorrect)):
            metrics.update(logodds_by_action(batch.logodds_per_action, batch.tokens_per_action, selected, name))
    if batch.first_action_ids is not None and batch.group_id is not None:
        metrics["diag/identical_first_action_frac"] = identical_first_action_frac(
            batch.first_action_ids, batch.group_id, advantage)
    if batch.delta_logp_per_action is not None:
        metrics.update(lld_rates(batch.delta_logp_per_action, batch.tokens_per_action, correct))
        delta = np.asarray(batch.delta_logp_per_action, np.float64).sum(axis=1)
        metrics["diag/delta_correct/all"] = _mean(delta[correct])
        metrics["diag/delta_incorrect/all"] = _mean(delta[incorrect])
    if batch.first_search_docs is not None and batch.group_id is not None:
        rate, eligible = first_action_correctness(batch.first_search_docs, batch.group_id, advantage)
        metrics["diag/first_action_correct_rate"] = rate
        metrics["diag/first_action_correct/eligible"] = float(eligible)
    return metrics


def likelihood_by_action(
    old_logp_per_action: ArrayLike, tokens_per_action: ArrayLike, selected: ArrayLike, name: str
) -> dict[str, float]:
    """Mean token log-likelihood under π_old of the ``selected`` responses, per action index.

    Keys ``diag/ll_{name}/action{k}`` for each slot, ``…/later`` pooling actions ≥ 1
    (per response first, so a response with three later actions still counts once), and
    ``…/all`` over every action token of the response.
    """
    logp = np.asarray(old_logp_per_action, np.float64)
    tokens = np.asarray(tokens_per_action, np.float64)
    selected = np.asarray(selected, bool)
    out: dict[str, float] = {}
    for k in range(logp.shape[1]):
        present = selected & (tokens[:, k] > 0)
        out[f"diag/ll_{name}/action{k}"] = _mean(logp[present, k] / tokens[present, k])
    later_tokens = tokens[:, 1:].sum(axis=1)
    present = selected & (later_tokens > 0)
    out[f"diag/ll_{name}/later"] = _mean(logp[present, 1:].sum(axis=1) / later_tokens[present])
    all_tokens = tokens.sum(axis=1)
    present = selected & (all_tokens > 0)
    out[f"diag/ll_{name}/all"] = _mean(logp[present].sum(axis=1) / all_tokens[present])
    out[f"diag/num_{name}"] = float(selected.sum())
    return out


def logodds_by_action(logodds_per_action: ArrayLike, tokens_per_action: ArrayLike, selected: ArrayLike,
                      name: str) -> dict[str, float]:
    """``diag/logodds_{name}/action{k}``: token-mean clipped log-odds of the selected responses' action k,
    averaged over responses (as :func:`likelihood_by_action` averages log-probs)."""
    odds = np.asarray(logodds_per_action, np.float64)
    tokens = np.asarray(tokens_per_action, np.float64)
    selected = np.asarray(selected, bool)
    out = {}
    for k in range(odds.shape[1]):
        present = selected & (tokens[:, k] > 0)
        out[f"diag/logodds_{name}/action{k}"] = _mean(odds[present, k] / tokens[present, k])
    return out


def official_positive_likelihood(old_logp_per_action: ArrayLike, tokens_per_action: ArrayLike,
                                 advantage: ArrayLike) -> float:
    """Σ log π_old over action tokens of A ≥ 0 responses / all action tokens (dp_actor.py's
    ``pos_avg_old_log_prob``); nan for a batch without action tokens."""
    tokens = np.asarray(tokens_per_action, np.float64).sum()
    keep = np.asarray(advantage, np.float64) >= 0
    total = np.asarray(old_logp_per_action, np.float64)[keep].sum()
    return float(total / tokens) if tokens > 0 else np.nan


def identical_first_action_frac(first_action_ids: Sequence[Sequence[int]], group_id: ArrayLike,
                                advantage: ArrayLike) -> float:
    """Share of mixed groups (some A > 0 and some A < 0) whose members' first actions are all the
    same token ids; nan when the step has no mixed group."""
    group_id = np.asarray(group_id)
    advantage = np.asarray(advantage, np.float64)
    mixed = identical = 0
    for g in np.unique(group_id):
        rows = np.flatnonzero(group_id == g)
        if not ((advantage[rows] > 0).any() and (advantage[rows] < 0).any()):
            continue
        mixed += 1
        identical += len({tuple(int(t) for t in first_action_ids[r]) for r in rows}) == 1
    return identical / mixed if mixed else np.nan


def lld_rates(delta_logp_per_action: ArrayLike, tokens_per_action: ArrayLike, correct: ArrayLike) -> dict[str, float]:
    """Share of correct responses (and of their actions) whose likelihood did not rise: Δ ≤ 0.

    ``diag/lld_rate`` is the response-level rate (Eq. 2 with ε = 0); ``…/action{k}`` the
    rate over correct responses that took action ``k``; ``diag/delta_correct/action{k}``
    the mean Δ of those actions (nats).
    """
    delta = np.asarray(delta_logp_per_action, np.float64)
    tokens = np.asarray(tokens_per_action, np.float64)
    correct = np.asarray(correct, bool) & (tokens.sum(axis=1) > 0)
    out = {"diag/lld_rate": _mean(delta[correct].sum(axis=1) <= 0)}
    for k in range(delta.shape[1]):
        present = correct & (tokens[:, k] > 0)
        out[f"diag/lld_rate/action{k}"] = _mean(delta[present, k] <= 0)
        out[f"diag/delta_correct/action{k}"] = _mean(delta[present, k])
    return out


def first_action_correctness(
    first_search_docs: Sequence[Sequence[object] | None], group_id: ArrayLike, advantage: ArrayLike
) -> tuple[float, int]:
    """(rate, eligible count): incorrect responses whose first search found a correct one's documents.

    Documents compare as sets (the same query returns the same top-k; order is the
    retriever's business). A response with no first search (``None`` or empty) never
    matches. Eligible = incorrect responses in groups with at least one correct response.
    """
    group_id = np.asarray(group_id)
    advantage = np.asarray(advantage, np.float64)
    docs = [frozenset(d) if d else None for d in first_search_docs]
    correct_docs: dict[object, set[frozenset]] = {}
    for g, a, d in zip(group_id.tolist(), advantage, docs):
        if a > 0:
            bucket = correct_docs.setdefault(g, set())
            if d is not None:
                bucket.add(d)
    eligible = matched = 0
    for g, a, d in zip(group_id.tolist(), advantage, docs):
        if a < 0 and g in correct_docs:
            eligible += 1
            matched += d is not None and d in correct_docs[g]
    return (matched / eligible if eligible else np.nan), eligible


def _mean(values: ArrayLike) -> float:
    values = np.asarray(values, np.float64)
    return float(values.mean()) if values.size else np.nan
