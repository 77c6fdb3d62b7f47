"""Properties of the LLDS family that must hold on every batch (hypothesis, one shape).

Each property is checked under all three gates; each (test, gate) pair jits once and every
hypothesis example reuses that compilation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from rl_strategies import rollouts
from rl_torch_reference import action_runs

from llds_jax import rl
from llds_jax.rl.aggregation import aggregate
from llds_jax.rl.kl import KL_ESTIMATORS
from llds_jax.rl.policy_losses import POLICY_LOSSES

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

GATES = ("token", "response", "action")
PROPERTY_SETTINGS = settings(max_examples=15, deadline=None)


def make_cfg(**overrides):
    cfg = rl.default_config()
    cfg.update(overrides)
    return cfg


@functools.cache
def llds_only_grad(gate: str, mask_answer: bool = False, preserve: str = "non_negative"):
    """d(LLDS term)/d(logp): lambda-weighted LLDS sum over its denominator, nothing else."""
    cfg = make_cfg(llds_gate=gate, mask_answer=mask_answer, answer_weight=0.0, llds_preserve=preserve)

    def llds_term(logp, old_logp, ref_logp, entropy, advantages, masks):
        terms = rl.objective_terms(rl.PolicyBatch(logp, old_logp, ref_logp, entropy, advantages, masks), cfg)
        return terms.sums["llds"] / terms.denoms["llds"]

    return jax.jit(jax.value_and_grad(llds_term))


@functools.cache
def full_objective(gate: str, llds_coef: float):
    cfg = make_cfg(llds_gate=gate, llds_coef=llds_coef)

    def loss(logp, entropy, old_logp, ref_logp, advantages, masks):
        return rl.objective(logp, old_logp, ref_logp, entropy, advantages, masks, cfg)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@functools.cache
def grpo_only():
    """The GRPO loss assembled directly from the registered pieces, with no LLDS code path."""
    cfg = make_cfg()

    def loss(logp, entropy, old_logp, ref_logp, advantages, masks):
        adv = jnp.broadcast_to(advantages[:, None], logp.shape)
        mask, weight = masks.action_mask, masks.row_weight
        mean = lambda x: (lambda s, d: s / d)(*aggregate(x, mask, weight, "token-mean"))
        pg = POLICY_LOSSES.get("ppo")(logp, old_logp, adv, mask, cfg).loss
        kl = KL_ESTIMATORS.get("low_var_kl")(logp, ref_logp)
        return mean(pg) + cfg.kl_coef * mean(kl) - cfg.entropy_coef * mean(entropy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def gate_reference(logp, old_logp, masks, gate):
    """[B, T] 0/1: is this token's gate on (loop over rows and runs; independent of the JAX code)."""
    d = np.asarray(old_logp) - np.asarray(logp)
    mask, index = np.asarray(masks.action_mask), np.asarray(masks.action_index)
    out = np.zeros_like(d)
    for b in range(d.shape[0]):
        runs = action_runs(mask[b], index[b])
        for run in runs:
            if gate == "token":
                on = True
            elif gate == "response":
                on = sum(d[b, t] for r in runs for t in r) > 0
            else:
                on = sum(d[b, t] for t in run) > 0
            out[b, run] = float(on)
    return out


@pytest.mark.parametrize("gate,preserve", [(gate, "non_negative") for gate in GATES] + [("action", "positive")])
@PROPERTY_SETTINGS
@given(batch=rollouts())
def test_llds_gradient_is_zero_exactly_where_the_regulariser_must_not_act(gate, preserve, batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    _, grad = llds_only_grad(gate, preserve=preserve)(logp, old_logp, ref_logp, entropy, advantages, masks)
    grad = np.asarray(grad)
    mask = np.asarray(masks.action_mask) * np.asarray(masks.row_weight)[:, None]
    # rl.llds_preserve: the official A ≥ 0 set, or only A > 0 (zero-advantage rows left alone).
    preserved = np.asarray(advantages)[:, None] >= 0 if preserve == "non_negative" else np.asarray(advantages)[:, None] > 0
    gate_on = gate_reference(logp, old_logp, masks, gate)
    reducing = (np.asarray(old_logp) - np.asarray(logp)) > 0
    should_act = (mask > 0) & preserved & (gate_on > 0) & reducing
    assert np.all(grad[~should_act] == 0.0), (
        f"nonzero LLDS gradient off the active set at {np.argwhere((grad != 0) & ~should_act).tolist()}"
    )
    n_tokens = mask.sum()
    np.testing.assert_allclose(grad[should_act], -0.1 / n_tokens, rtol=1e-6, err_msg="active-token gradient")


@pytest.mark.parametrize("gate", GATES)
@PROPERTY_SETTINGS
@given(batch=rollouts())
def test_answer_tokens_get_no_llds_gradient_under_ma_with_zero_answer_weight(gate, batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    _, grad = llds_only_grad(gate, mask_answer=True)(logp, old_logp, ref_logp, entropy, advantages, masks)
    answer = np.asarray(masks.answer_mask) > 0
    assert np.all(np.asarray(grad)[answer] == 0.0), np.asarray(grad)[answer]


@pytest.mark.parametrize("gate", GATES)
@PROPERTY_SETTINGS
@given(batch=rollouts())
def test_lambda_zero_gives_exactly_the_grpo_loss_and_gradient(gate, batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    value, grads = full_objective(gate, 0.0)(logp, entropy, old_logp, ref_logp, advantages, masks)
    want_value, want_grads = grpo_only()(logp, entropy, old_logp, ref_logp, advantages, masks)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-7, atol=1e-8)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("gate", GATES)
@PROPERTY_SETTINGS
@given(batch=rollouts(same_policy=True))
def test_llds_term_and_gradient_vanish_when_policy_equals_old_policy(gate, batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    value, grad = llds_only_grad(gate)(logp, old_logp, ref_logp, entropy, advantages, masks)
    assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0), (float(value), np.abs(grad).max())


@PROPERTY_SETTINGS
@given(batch=rollouts(single_action=True))
def test_action_gate_equals_response_gate_when_every_response_has_one_action(batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    a_value, a_grad = llds_only_grad("action")(logp, old_logp, ref_logp, entropy, advantages, masks)
    r_value, r_grad = llds_only_grad("response")(logp, old_logp, ref_logp, entropy, advantages, masks)
    # Same gates; only XLA's summation order may differ (1 ulp).
    np.testing.assert_allclose(float(a_value), float(r_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(a_grad), np.asarray(r_grad), rtol=1e-6, atol=1e-9)


@PROPERTY_SETTINGS
@given(batch=rollouts())
def test_loss_has_no_gradient_through_old_or_reference_logprobs_or_advantages(batch):
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    grads = _grad_wrt_constants()(old_logp, ref_logp, advantages, logp, entropy, masks)
    for name, grad in zip(("old_logp", "ref_logp", "advantages"), grads):
        assert np.all(np.asarray(grad) == 0.0), f"gradient leaks into {name}: max {np.abs(grad).max()}"


@functools.cache
def _grad_wrt_constants():
    cfg = make_cfg()

    def loss(old_logp, ref_logp, advantages, logp, entropy, masks):
        return rl.objective(logp, old_logp, ref_logp, entropy, advantages, masks, cfg)[0]

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("gate", GATES)
@PROPERTY_SETTINGS
@given(batch=rollouts())
def test_feedback_prompt_and_padding_tokens_never_receive_gradient(gate, batch):
    """The whole objective (pg + KL + entropy + LLDS), not just LLDS: masked tokens are inert."""
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    _, (grad_logp, grad_entropy) = full_objective(gate, 0.2)(
        logp, entropy, old_logp, ref_logp, advantages, masks
    )
    inert = (np.asarray(masks.action_mask) * np.asarray(masks.row_weight)[:, None]) == 0
    for name, grad in (("logp", grad_logp), ("entropy", grad_entropy)):
        leaked = np.asarray(grad)[inert]
        assert np.all(leaked == 0.0), f"d/d{name} nonzero on masked tokens: max {np.abs(leaked).max()}"
