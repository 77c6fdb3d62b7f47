"""The Gram probe (``--config.probe.gram=True``, issue 61): can a group's wrong answers push its correct ones down?

Why: to first order, one isolated GRPO step along g = Σ_j A_j g_j (g_j = ∇ Σ_t log π(y_j,t), the
response's summed action log-prob) changes correct response i's log-prob by η·(K A)_i with
K = G Gᵀ the responses' Gram matrix. With binary rewards, k correct of n and the group's
standardised advantages, the summed change over the correct responses is
η·k²(n − k)/(nσ)·(m₊₊ − m₊₋), where m₊₊ is the mean of K over correct × correct pairs (the
diagonal included) and m₊₋ over correct × wrong. So the update lowers the correct responses
only when m₊₋ > m₊₊. With k = 1, m₊₊ = ‖g₊‖², which a wrong answer's gradient almost never
beats: natural groups (≈ 73 % of the lab's mixed groups hold one correct answer) read 0
whatever the mechanism. This probe draws more responses per question (``probe.gram_samples``,
16) and reads the margin on random 8-member subsets with exactly k correct, k ∈ {1, 2, 4, 6}:
the strata the paper's late-training groups live in.

First order is checked on the natural groups: the sign of (K A) averaged over the correct
responses must agree with the SGD probe's Δ(x) in ≥ 90 % of groups, or the test is void
(``first_order_ok`` False). The criteria that read this output are in ``lab/criteria.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

STRATA = (1, 2, 4, 6)
SUBSET_SIZE = 8
AGREEMENT_MIN = 0.9


class ResponseGrads:
    """Jitted per-response, per-action gradients of the summed action log-prob, flattened: [n, slots, P]."""

    def __init__(self, graphdef, temperature: float, slots: int):
        def action_logp(params, ids, attn, mask, index):  # one response: [slots] summed log-probs
            model = nnx.merge(graphdef, params)
            logits = model.logits_from_hidden(model.hidden_states(ids[None], attn[None])).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits[0, :-1] / temperature, axis=-1)
            target = jnp.take_along_axis(logp, ids[1:, None], axis=-1)[:, 0]
            on = mask[1:] * (index[1:][None, :] == jnp.arange(slots)[:, None])  # [slots, T-1], token-aligned
            return (on * target[None]).sum(axis=1)

        def grads(params, ids, attn, mask, index):
            jac = jax.vmap(jax.jacrev(action_logp), in_axes=(None, 0, 0, 0, 0))(params, ids, attn, mask, index)
            leaves = [x.reshape(x.shape[0], slots, -1).astype(jnp.float32) for x in jax.tree.leaves(jac)]
            return jnp.concatenate(leaves, axis=-1)

        self.grads = jax.jit(grads)

    def __call__(self, params, ids, attn, mask, index, chunk: int = 4) -> np.ndarray:
        """[n, slots, P] in chunks of ``chunk`` responses (memory: chunk × slots × P floats per call)."""
        parts = [np.asarray(self.grads(params, *(jnp.asarray(x[s:s + chunk]) for x in (ids, attn, mask, index))))
                 for s in range(0, len(ids), chunk)]
        return np.concatenate(parts)


def gram_matrices(grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per action [slots, n, n], total [n, n]) Gram matrices of [n, slots, P] gradients (float64)."""
    g = np.asarray(grads, np.float64)
    per_action = np.einsum("isp,jsp->sij", g, g)
    total = g.sum(axis=1)
    return per_action, total @ total.T


def subset_stats(gram: np.ndarray, correct: np.ndarray, members: np.ndarray) -> dict:
    """m₊₋ − m₊₊ (m₊₊ with the diagonal), ‖g₋‖/‖g₊‖ (mean norms) and mean cosines of one subset."""
    k = gram[np.ix_(members, members)]
    pos, neg = correct[members], ~correct[members]
    norms = np.sqrt(np.maximum(np.diag(k), 0.0))
    cos = k / np.maximum(np.outer(norms, norms), 1e-30)
    m_pm, m_pp = k[np.ix_(pos, neg)].mean(), k[np.ix_(pos, pos)].mean()
    off = np.ix_(pos, pos)
    pp = cos[off][~np.eye(int(pos.sum()), dtype=bool)]
    return {"margin": float(m_pm - m_pp), "m_pm": float(m_pm), "m_pp": float(m_pp),
            "norm_ratio": float(norms[neg].mean() / max(norms[pos].mean(), 1e-30)),
            "cos_pm": float(cos[np.ix_(pos, neg)].mean()), "cos_pp": float(pp.mean()) if pp.size else None}


def stratified_subsets(gram: np.ndarray, correct, rng: np.random.Generator, strata=STRATA,
                       size: int = SUBSET_SIZE, max_subsets: int = 50) -> dict[int, list[dict]]:
    """Up to ``max_subsets`` distinct random ``size``-member subsets per k with exactly k correct."""
    correct = np.asarray(correct, bool)
    pos, neg = np.flatnonzero(correct), np.flatnonzero(~correct)
    out = {}
    for k in strata:
        if len(pos) < k or len(neg) < size - k:
            continue
        seen, records = set(), []
        for _ in range(20 * max_subsets):  # distinct draws; small pools run out before the cap
            members = np.sort(np.r_[rng.choice(pos, k, replace=False), rng.choice(neg, size - k, replace=False)])
            if (key := tuple(members.tolist())) in seen:
                continue
            seen.add(key)
            records.append({"members": members.tolist(), **subset_stats(gram, correct, members)})
            if len(records) == max_subsets:
                break
        out[k] = records
    return out


def first_order_delta(gram: np.ndarray, advantages) -> float:
    """First-order Δ(x) of one SGD step (up to η > 0): mean over A > 0 rows of (K A)_i."""
    a = np.asarray(advantages, np.float64)
    return float((gram @ a)[a > 0].mean())


def sign_agreement(first_order: list[float], sgd: list[float]) -> dict:
    """Share of natural groups where first order and the SGD probe agree on the sign of Δ(x)."""
    pairs = [(f, s) for f, s in zip(first_order, sgd) if f is not None and s is not None]
    share = float(np.mean([(f < 0) == (s < 0) for f, s in pairs])) if pairs else None
    return {"groups": len(pairs), "agreement": share,
            "first_order_ok": share is not None and share >= AGREEMENT_MIN}


def question_strata(grads: np.ndarray, rewards, question: int, rng, max_subsets: int) -> dict[int, list[dict]]:
    """One question's subsets per stratum on the total Gram, each tagged with ``question`` and its
    margin per action (the same members scored on that action's Gram)."""
    per_action, total = gram_matrices(grads)
    correct = np.asarray(rewards) > 0
    out = stratified_subsets(total, correct, rng, max_subsets=max_subsets)
    for records in out.values():
        for record in records:
            members = np.asarray(record["members"])
            record["question"] = int(question)
            record["margin_by_action"] = [subset_stats(k, correct, members)["margin"] for k in per_action]
    return out
