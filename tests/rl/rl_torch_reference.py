"""An independent PyTorch statement of SPEC §4-5, written for readability, not speed.

Loops over rows and tokens on purpose: it must not share any trick (segment ops, cumsum run
ids) with the JAX code it checks. Tensors in, scalar loss out; autograd gives the gradients.
"""

from __future__ import annotations

import torch


def action_runs(action_mask_row, action_index_row=None) -> list[list[int]]:
    """Token positions of each maximal action run (split also where action_index changes)."""
    runs, current, prev_index = [], [], None
    for t, on in enumerate(action_mask_row.tolist()):
        index = None if action_index_row is None else int(action_index_row[t])
        if on and current and (action_index_row is None or index == prev_index):
            current.append(t)
        elif on:
            if current:
                runs.append(current)
            current = [t]
        elif current:
            runs.append(current)
            current = []
        prev_index = index
    if current:
        runs.append(current)
    return runs


def kl_estimate(logp, ref_logp, name):
    """Schulman's estimators as verl's `kl_penalty` names them."""
    if name in ("k1", "kl"):
        return logp - ref_logp
    if name in ("k2", "mse"):
        return 0.5 * (logp - ref_logp) ** 2
    if name == "abs":
        return (logp - ref_logp).abs()
    x = ref_logp - logp
    return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)


def policy_log_ratio(logp, old_logp, mask, policy_loss):
    """Token log-ratio (PPO) or, for GSPO, the response's mean log-ratio with a token-wise gradient."""
    if policy_loss == "ppo":
        return logp - old_logp
    length = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq = (((logp - old_logp) * mask).sum(dim=-1, keepdim=True) / length).detach()
    return logp - logp.detach() + seq


def aggregate(values, mask, row_weight, mode, norm_length=0):
    """Loss aggregation exactly as the mode names say (SPEC §4), loops over rows."""
    batch, length = values.shape
    if mode in ("token-mean", "token-sum-norm"):
        total = sum((values[b] * mask[b]).sum() * row_weight[b] for b in range(batch))
        if mode == "token-mean":
            return total / sum(mask[b].sum() * row_weight[b] for b in range(batch))
        return total / (row_weight.sum() * (norm_length or length))
    rows = [b for b in range(batch) if row_weight[b] > 0 and mask[b].sum() > 0]
    per_row = []
    for b in rows:
        row_total = (values[b] * mask[b]).sum()
        per_row.append(
            row_weight[b] * (row_total / mask[b].sum() if mode == "seq-mean-token-mean" else row_total)
        )
    return sum(per_row) / sum(row_weight[b] for b in rows)


def llds_loss(logp, old_logp, advantages, mask, answer_mask, action_index, row_weight, num_searches, cfg):
    """lambda-weighted LLDS term of SPEC §5 (already multiplied by the coefficients)."""
    lam = cfg.llds_coef
    answer_coef = lam
    if cfg.mask_answer:
        w = cfg.answer_weight
        if cfg.adaptive_ma:
            mean_searches = (num_searches * row_weight).sum() / row_weight.sum()
            w = w * max(float(mean_searches) - 1.0, 0.0)
        answer_coef = min(w, lam)
    batch = logp.shape[0]
    valid = [b for b in range(batch) if row_weight[b] > 0]
    if cfg.llds_denominator == "action_tokens":
        n_tokens = sum(mask[b].sum() for b in valid)
    else:
        n_tokens = sum(mask[b].sum() for b in valid if advantages[b] >= 0)
    total = logp.new_zeros(())
    for b in valid:
        if advantages[b] < 0:
            continue
        d = old_logp[b] - logp[b]
        d_const = d.detach()
        in_gate = [
            bool(mask[b, t]) and (cfg.answer_in_gate or not cfg.mask_answer or not answer_mask[b, t])
            for t in range(logp.shape[1])
        ]
        runs = action_runs(mask[b], None if action_index is None else action_index[b])
        if cfg.llds_gate == "token":
            groups = [(run, True) for run in runs]
        elif cfg.llds_gate == "response":
            signed = sum(float(d_const[t]) for run in runs for t in run if in_gate[t])
            groups = [(run, signed > 0) for run in runs]
        else:
            groups = [(run, sum(float(d_const[t]) for t in run if in_gate[t]) > 0) for run in runs]
        for run, gate_on in groups:
            if not gate_on:
                continue
            for t in run:
                coef = answer_coef if answer_mask[b, t] else lam
                total = total + row_weight[b] * coef * torch.relu(d[t])
    return total / n_tokens


def reference_loss(
    logp,
    old_logp,
    ref_logp,
    entropy,
    advantages,
    mask,
    answer_mask,
    action_index,
    row_weight,
    num_searches,
    cfg,
):
    """Total loss of SPEC §4-5: clipped surrogate (+ dual clip), KL, entropy bonus, LLDS."""
    adv = advantages[:, None].expand_as(logp)
    log_ratio = policy_log_ratio(logp, old_logp, mask, cfg.policy_loss)
    if cfg.log_ratio_clamp > 0:
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    if cfg.ratio_max > 0:  # the official LLDS code: torch.clamp(ratio, max=100)
        ratio = torch.clamp(ratio, max=cfg.ratio_max)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.where(clipped > unclipped, clipped, unclipped)
    if cfg.dual_clip_c > 0:
        floor = -adv * cfg.dual_clip_c
        pg = torch.where((adv < 0) & (floor < pg), floor, pg)
    agg = lambda x: aggregate(x, mask, row_weight, cfg.aggregation, cfg.token_sum_norm_length)
    kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
    loss = agg(pg) + cfg.kl_coef * agg(kl) - cfg.entropy_coef * agg(entropy)
    return loss + llds_loss(
        logp, old_logp, advantages, mask, answer_mask, action_index, row_weight, num_searches, cfg
    )
