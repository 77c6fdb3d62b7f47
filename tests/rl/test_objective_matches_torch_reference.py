"""The JAX objective equals an independent PyTorch statement of SPEC §4-5, value and gradient.

Randomised rollout-shaped batches (several actions per row separated by masked feedback,
answer spans, padding rows, all-correct / all-wrong groups) under every LLDS flag
combination the issue lists. Tolerance 1e-6 (absolute and relative) in fp32.

The flag matrix runs the JAX side op-by-op (eager): every config would otherwise be its own
~1 s XLA compile, while eager primitives are compiled once and shared by all configs. The
default config is also checked under `jax.jit`, the way the trainer calls it.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from rl_batches import rollout_batch
from rl_torch_reference import reference_loss

from llds_jax import rl

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

SEEDS = (0, 1)
TOL = 1e-6


def make_cfg(**overrides):
    cfg = rl.default_config()
    cfg.update(overrides)
    rl.validate(cfg)
    return cfg


def jax_value_and_grad(cfg, *, jit: bool):
    def loss_fn(logp, entropy, old_logp, ref_logp, advantages, masks):
        return rl.objective(logp, old_logp, ref_logp, entropy, advantages, masks, cfg)[0]

    value_and_grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
    return jax.jit(value_and_grad) if jit else value_and_grad


def advantages_of(batch):
    return np.asarray(
        rl.compute_advantages(
            jnp.asarray(batch["rewards"]),
            jnp.asarray(batch["group_ids"]),
            jnp.asarray(batch["row_weight"] > 0),
        )
    )


def check_against_reference(cfg, seed, value_and_grad):
    batch = rollout_batch(seed)
    advantages = advantages_of(batch)
    masks = rl.LossMasks(
        action_mask=jnp.asarray(batch["action_mask"]),
        answer_mask=jnp.asarray(batch["answer_mask"]),
        action_index=jnp.asarray(batch["action_index"]),
        row_weight=jnp.asarray(batch["row_weight"]),
        num_searches=jnp.asarray(batch["num_searches"]),
    )
    value, (grad_logp, grad_entropy) = value_and_grad(
        jnp.asarray(batch["logp"]),
        jnp.asarray(batch["entropy"]),
        jnp.asarray(batch["old_logp"]),
        jnp.asarray(batch["ref_logp"]),
        jnp.asarray(advantages),
        masks,
    )
    t = {k: torch.tensor(v) for k, v in batch.items()}
    logp = t["logp"].clone().requires_grad_(True)
    entropy = t["entropy"].clone().requires_grad_(True)
    ref_value = reference_loss(
        logp,
        t["old_logp"],
        t["ref_logp"],
        entropy,
        torch.tensor(advantages),
        t["action_mask"],
        t["answer_mask"],
        t["action_index"],
        t["row_weight"],
        t["num_searches"],
        cfg,
    )
    ref_value.backward()
    ref_value = ref_value.detach()
    shown = ("llds_gate", "mask_answer", "answer_weight", "adaptive_ma", "llds_coef", "aggregation")
    context = f"cfg={ {k: cfg[k] for k in shown} } seed={seed}"
    np.testing.assert_allclose(float(value), float(ref_value), atol=TOL, rtol=TOL, err_msg=f"loss, {context}")
    np.testing.assert_allclose(
        np.asarray(grad_logp), logp.grad.numpy(), atol=TOL, rtol=TOL, err_msg=f"d/dlogp, {context}"
    )
    np.testing.assert_allclose(
        np.asarray(grad_entropy), entropy.grad.numpy(), atol=TOL, rtol=TOL, err_msg=f"d/dentropy, {context}"
    )


MA_SETTINGS = [
    dict(mask_answer=False),
    dict(mask_answer=True, answer_weight=0.0, adaptive_ma=False),
    dict(mask_answer=True, answer_weight=0.05, adaptive_ma=False),
    dict(mask_answer=True, answer_weight=0.0, adaptive_ma=True),
    dict(mask_answer=True, answer_weight=0.05, adaptive_ma=True),
]
FLAG_MATRIX = [
    dict(llds_gate=gate, llds_coef=lam, **ma)
    for gate, ma, lam in itertools.product(("token", "response", "action"), MA_SETTINGS, (0.0, 0.1, 0.2))
]


@pytest.mark.parametrize("flags", FLAG_MATRIX, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_objective_and_gradients_match_torch_for_every_llds_flag(flags):
    cfg = make_cfg(**flags)
    value_and_grad = jax_value_and_grad(cfg, jit=False)
    for seed in SEEDS:
        check_against_reference(cfg, seed, value_and_grad)


OTHER_VARIANTS = [
    dict(aggregation="seq-mean-token-mean"),
    dict(aggregation="seq-mean-token-sum"),
    dict(aggregation="token-sum-norm"),
    dict(aggregation="token-sum-norm", token_sum_norm_length=40),
    dict(llds_denominator="preserved_tokens"),
    dict(mask_answer=True, answer_weight=0.05, answer_in_gate=False),
    dict(log_ratio_clamp=0.0, clip_low=0.1, clip_high=0.28),
    dict(dual_clip_c=1.05),
    dict(policy_loss="gspo", aggregation="seq-mean-token-mean", clip_low=0.02, clip_high=0.03),
    dict(kl_estimator="k1", kl_coef=0.05),
    dict(kl_estimator="k2", kl_coef=0.05),
    dict(kl_estimator="abs", kl_coef=0.05),
]


@pytest.mark.parametrize("flags", OTHER_VARIANTS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_objective_and_gradients_match_torch_for_aggregations_and_variants(flags):
    cfg = make_cfg(**flags)
    value_and_grad = jax_value_and_grad(cfg, jit=False)
    for seed in SEEDS:
        check_against_reference(cfg, seed, value_and_grad)


def test_jitted_default_objective_matches_torch():
    cfg = make_cfg()
    value_and_grad = jax_value_and_grad(cfg, jit=True)
    for seed in SEEDS:
        check_against_reference(cfg, seed, value_and_grad)
