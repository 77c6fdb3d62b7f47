"""The objective is shape-polymorphic code: one jit per shape, no Python loops over rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import rollout_batch

from llds_jax import rl

pytestmark = pytest.mark.unit


def inputs(batch: int, length: int, seed: int = 0):
    b = rollout_batch(seed, batch=batch, length=length)
    masks = rl.LossMasks(
        *(
            jnp.asarray(b[k])
            for k in ("action_mask", "answer_mask", "action_index", "row_weight", "num_searches")
        )
    )
    adv = jnp.asarray(b["rewards"] - 0.5)
    return tuple(jnp.asarray(b[k]) for k in ("logp", "old_logp", "ref_logp", "entropy")) + (adv, masks)


def test_objective_jits_once_per_shape():
    cfg = rl.default_config()
    step = jax.jit(
        jax.value_and_grad(lambda lp, old, ref, ent, adv, m: rl.objective(lp, old, ref, ent, adv, m, cfg)[0])
    )
    for seed in range(3):
        step(*inputs(8, 24, seed))
    assert step._cache_size() == 1


def test_traced_program_size_does_not_grow_with_batch_or_length():
    """A Python loop over rows, groups or actions would add equations per row."""
    cfg = rl.default_config()
    fn = lambda *args: rl.objective(*args, cfg)
    sizes = {
        shape: len(jax.make_jaxpr(fn)(*inputs(*shape)).jaxpr.eqns) for shape in [(4, 16), (16, 16), (4, 64)]
    }
    assert len(set(sizes.values())) == 1, sizes


@pytest.mark.codegen_sensitive
def test_metrics_are_finite_on_an_all_padding_batch():
    cfg = rl.default_config()
    *arrays, adv, masks = inputs(8, 24)
    masks = masks._replace(row_weight=jnp.zeros(8))
    loss, metrics = rl.objective(*arrays, adv, masks, cfg)
    assert float(loss) == 0.0
    bad = {k: float(v) for k, v in metrics.items() if not np.isfinite(float(v))}
    assert not bad, bad


@pytest.mark.codegen_sensitive
def test_lambda_passed_through_batch_constants_changes_without_recompiling():
    """A monitor may raise lambda mid-run: a traced lambda must equal the static one, one compile."""
    cfg = rl.default_config()
    logp, old, ref, ent, adv, masks = inputs(8, 24)

    @jax.jit
    def loss_with(lam, logp):
        constants = rl.batch_constants(adv, masks, cfg, llds_coef=lam)
        return rl.micro_batch_loss(rl.PolicyBatch(logp, old, ref, ent, adv, masks), cfg, constants, 1)[0]

    for lam in (0.0, 0.1, 0.3):
        static_cfg = rl.default_config()
        static_cfg.llds_coef = lam
        want = rl.objective(logp, old, ref, ent, adv, masks, static_cfg)[0]
        np.testing.assert_allclose(
            float(loss_with(lam, logp)), float(want), rtol=1e-6, atol=1e-7, err_msg=f"lambda={lam}"
        )
    assert loss_with._cache_size() == 1
