"""Micro-batch and data-parallel accumulation of sums/denominators is exact.

`loss_scope = "mini_batch"`: summing `micro_batch_loss` over micro-batches (with the
mini-batch's `batch_constants`) gives the whole-batch loss and gradient. `"micro_batch"`:
the sum is the mean of per-micro-batch losses (the reference's semantics). Pooled metrics
equal the whole batch's metrics either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rl_batches import rollout_batch
from rl_strategies import BATCH, rollouts

from llds_jax import rl

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

# Sliced micro-batches of one size: eager mode compiles every primitive once per shape, so shape
# variety (not example count) is what costs time. Halves already differ in token counts; any
# partition of rows is covered by the hypothesis test at the end (padding-row micro-batches).
SPLITS = {"halves": (4, 4)}
CASES = [
    (agg, "halves") for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm")
]


def make_cfg(**overrides):
    cfg = rl.default_config()
    cfg.update(overrides)
    return cfg


def whole_batch(seed):
    b = rollout_batch(seed, batch=8)
    adv = rl.compute_advantages(
        jnp.asarray(b["rewards"]), jnp.asarray(b["group_ids"]), jnp.asarray(b["row_weight"] > 0)
    )
    masks = rl.LossMasks(
        *(
            jnp.asarray(b[k])
            for k in ("action_mask", "answer_mask", "action_index", "row_weight", "num_searches")
        )
    )
    return rl.PolicyBatch(
        *(jnp.asarray(b[k]) for k in ("logp", "old_logp", "ref_logp", "entropy")), adv, masks
    )


def rows(batch: rl.PolicyBatch, start: int, stop: int) -> rl.PolicyBatch:
    return jax.tree.map(lambda x: x[start:stop], batch)


def loss_and_grads(fn, batch):
    def loss(logp, entropy):
        return fn(batch._replace(logp=logp, entropy=entropy))

    return jax.value_and_grad(loss, argnums=(0, 1))(batch.logp, batch.entropy)


def micro_batches(batch, sizes):
    bounds = np.cumsum((0,) + sizes)
    return [rows(batch, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("aggregation, split", CASES)
def test_mini_batch_scope_accumulates_to_exactly_the_whole_batch(aggregation, split):
    cfg = make_cfg(aggregation=aggregation, mask_answer=True, answer_weight=0.05, adaptive_ma=True)
    batch = whole_batch(seed=3)
    whole_loss, whole_grads = loss_and_grads(lambda b: rl.objective(*b, cfg)[0], batch)
    constants = rl.batch_constants(batch.advantages, batch.masks, cfg)
    parts = micro_batches(batch, SPLITS[split])
    total, grads, pooled = 0.0, [], None
    for part in parts:
        value, part_grads = loss_and_grads(
            lambda b: rl.micro_batch_loss(b, cfg, constants, len(parts))[0], part
        )
        total += float(value)
        grads.append(part_grads)
        terms = rl.objective_terms(part, cfg, constants)
        pooled = terms if pooled is None else rl.accumulate(pooled, terms)
    np.testing.assert_allclose(total, float(whole_loss), rtol=1e-6, atol=1e-7, err_msg="summed micro losses")
    for i, name in enumerate(("logp", "entropy")):
        np.testing.assert_allclose(
            np.concatenate([np.asarray(g[i]) for g in grads]),
            np.asarray(whole_grads[i]),
            rtol=1e-6,
            atol=1e-8,
            err_msg=f"d/d{name}",
        )
    _, pooled_metrics = rl.finalize(pooled, cfg)
    _, whole_metrics = rl.objective(*batch, cfg)
    for key, value in whole_metrics.items():
        np.testing.assert_allclose(
            float(pooled_metrics[key]), float(value), rtol=1e-5, atol=1e-6, err_msg=key
        )


@pytest.mark.parametrize("llds_denominator", ["action_tokens", "preserved_tokens"])
def test_micro_batch_scope_is_the_mean_of_micro_batch_means(llds_denominator):
    cfg = make_cfg(loss_scope="micro_batch", llds_denominator=llds_denominator)
    batch = whole_batch(seed=6)  # halves with 27 and 19 action tokens: the two semantics differ
    constants = rl.batch_constants(batch.advantages, batch.masks, cfg)
    parts = micro_batches(batch, SPLITS["halves"])
    total = sum(float(rl.micro_batch_loss(p, cfg, constants, len(parts))[0]) for p in parts)
    want = np.mean([float(rl.objective(*p, cfg)[0]) for p in parts])
    np.testing.assert_allclose(total, want, rtol=1e-6)
    whole = float(rl.objective(*batch, cfg)[0])
    assert abs(total - whole) > 1e-6, "the reference semantics should differ from the pooled token mean here"


def test_batch_constants_equal_the_objective_terms_denominators():
    cfg = make_cfg(aggregation="seq-mean-token-mean", llds_denominator="preserved_tokens")
    batch = whole_batch(seed=7)
    constants = rl.batch_constants(batch.advantages, batch.masks, cfg)
    terms = rl.objective_terms(batch, cfg)
    for key, value in constants.denominators.items():
        assert float(value) == float(terms.denoms[key]), key


def test_data_parallel_shard_map_with_psummed_constants_equals_the_whole_batch():
    cfg = make_cfg(mask_answer=True, answer_weight=0.05, adaptive_ma=True)
    batch = whole_batch(seed=11)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.P("data")
    batch_specs = jax.tree.map(lambda _: spec, batch)

    def per_shard(b):
        constants = rl.batch_constants(b.advantages, b.masks, cfg, axis_name="data")

        def local_loss(logp):
            return rl.micro_batch_loss(b._replace(logp=logp), cfg, constants, 1)[0]

        loss, grad = jax.value_and_grad(local_loss)(b.logp)
        terms = rl.all_reduce(rl.objective_terms(b, cfg, constants), "data")
        return jax.lax.psum(loss, "data"), grad, terms

    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec)), batch)
        step = jax.jit(jax.shard_map(per_shard, in_specs=(batch_specs,), out_specs=(jax.P(), spec, jax.P())))
        loss, grad, terms = step(sharded)
    want_loss, want_metrics = rl.objective(*batch, cfg)
    want_grad = jax.grad(lambda logp: rl.objective(logp, *batch[1:], cfg)[0])(batch.logp)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-9)
    _, metrics = rl.finalize(terms, cfg)
    for key in ("llds/loss", "llds/answer_coef", "ratio/max", "ratio/min", "llds/gate_frac_actions"):
        np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-6, err_msg=key)


def test_jitted_objective_on_batch_sharded_arrays_under_an_explicit_mesh():
    """The trainer's path: global arrays sharded on `data`, explicit axes (sharding errors fail at trace)."""
    cfg = make_cfg()
    batch = whole_batch(seed=11)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda x: jax.device_put(x, jax.NamedSharding(mesh, jax.P("data"))), batch)
        step = jax.jit(jax.value_and_grad(lambda logp, b: rl.objective(logp, *b[1:], cfg)[0]))
        value, grad = step(sharded.logp, sharded)
    want_value, want_grad = jax.value_and_grad(lambda logp: rl.objective(logp, *batch[1:], cfg)[0])(
        batch.logp
    )
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-9)
    assert grad.sharding.spec[0] == "data", grad.sharding


@functools.cache
def _micro_and_whole(aggregation: str):
    cfg = make_cfg(aggregation=aggregation, mask_answer=True, answer_weight=0.05, adaptive_ma=True)

    def micro(logp, entropy, batch, constants):
        return rl.micro_batch_loss(batch._replace(logp=logp, entropy=entropy), cfg, constants, 1)[0]

    def whole(logp, entropy, batch):
        return rl.objective(logp, *batch[1:3], entropy, *batch[4:], cfg)[0]

    constants = jax.jit(lambda adv, masks: rl.batch_constants(adv, masks, cfg))
    return (
        jax.jit(jax.value_and_grad(micro, argnums=(0, 1))),
        jax.jit(jax.value_and_grad(whole, argnums=(0, 1))),
        constants,
    )


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@settings(max_examples=15, deadline=None)
@given(batch=rollouts(), assignment=st.lists(st.integers(0, 2), min_size=BATCH, max_size=BATCH))
def test_any_partition_of_rows_into_micro_batches_accumulates_exactly(aggregation, batch, assignment):
    """Micro-batch k = the batch with every row outside k turned into a padding row (same shape, one jit)."""
    logp, old_logp, ref_logp, entropy, advantages, masks = batch
    whole_batch_ = rl.PolicyBatch(logp, old_logp, ref_logp, entropy, advantages, masks)
    micro, whole, constants_fn = _micro_and_whole(aggregation)
    constants = constants_fn(advantages, masks)
    total, grad_logp, grad_entropy = 0.0, 0.0, 0.0
    for k in set(assignment):
        keep = jnp.asarray(np.asarray(assignment) == k, jnp.float32)
        part = whole_batch_._replace(masks=masks._replace(row_weight=masks.row_weight * keep))
        value, (g_logp, g_entropy) = micro(logp, entropy, part, constants)
        total, grad_logp, grad_entropy = total + float(value), grad_logp + g_logp, grad_entropy + g_entropy
    want, (want_logp, want_entropy) = whole(logp, entropy, whole_batch_)
    # the loss sums O(1) terms (ratio x advantage, KL, entropy) that can cancel to a small total: its rounding is
    # ulps of the terms, not of the total (a 0.029 total once came 1.5e-7 apart), so 8 fp32 ulps of 1.0
    np.testing.assert_allclose(total, float(want), rtol=1e-6, atol=8 * np.finfo(np.float32).eps)
    np.testing.assert_allclose(np.asarray(grad_logp), np.asarray(want_logp), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(np.asarray(grad_entropy), np.asarray(want_entropy), rtol=1e-6, atol=1e-8)
