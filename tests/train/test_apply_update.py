"""The optimizer step shared by the RL update and the SFT warm-up: its skip, its numbers, and no weight copies."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from llds_jax.train import state as train_state
from llds_jax.train.state import apply_update, init_train_state, make_optimizer

pytestmark = pytest.mark.unit

OPTIM = ml_collections.ConfigDict(dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, lr=1e-3))
EPS = float(np.finfo(np.float32).eps)
SHAPES = {"stack": (3, 64, 96), "table": (128, 64), "norm": (64,)}


def _state(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    params = {name: jax.random.normal(key, shape) for key, (name, shape) in zip(keys, SHAPES.items())}
    return init_train_state(params, OPTIM, seed)


def _grads(params, scale: float = 1.0):
    return jax.tree.map(lambda p: scale * jnp.cos(p), params)


@pytest.fixture(params=["cond", "select"])
def skip_form(request, monkeypatch):
    """Run a test through both ways of writing the skip (apply_update picks one per platform:
    the select is XLA:GPU's), here on this host."""
    if request.param == "select":
        monkeypatch.setattr(train_state, "_SELECT_SKIP_PLATFORMS", (jax.default_backend(),))
    return request.param


@pytest.mark.codegen_sensitive
def test_a_finite_step_is_clipped_adamw(skip_form):
    state, tx = _state(), make_optimizer(OPTIM)
    grads = _grads(state.params, scale=10.0)  # norm well above the clip
    lr, clip = jnp.float32(1e-3), 1.0
    new, metrics = jax.jit(lambda s, g: apply_update(s, g, jnp.float32(0.5), lr, tx, clip))(state, grads)

    norm = optax.tree.norm(grads)
    clipped = jax.tree.map(lambda g: g * min(1.0, clip / (float(norm) + 1e-6)), grads)
    direction, moments = tx.update(clipped, state.opt_state, state.params)
    for got, want in zip(jax.tree.leaves(new.params), jax.tree.leaves(jax.tree.map(
            lambda p, u: p - lr * u, state.params, direction))):
        # p − lr·u rounds once (≤ 1 ulp of p: rtol 2ε); u may round differently in a few places,
        # each ≤ ε·|u| with |u| ≤ 1 + wd·|p| in a first Adam step, scaled by lr
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2 * EPS, atol=float(lr) * 8 * EPS)
    for got, want in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(moments)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=4 * EPS)  # a few roundings of g, g²
    assert float(metrics["grad/norm_preclip"]) == pytest.approx(float(norm), rel=1e-6)
    assert (int(new.updates), int(new.skipped_updates), float(metrics["update/skipped"])) == (1, 0, 0.0)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_leaves_params_and_moments_bit_identical(poison, skip_form):
    tx = make_optimizer(OPTIM)
    state = apply_update(_state(), _grads(_state().params), jnp.float32(1.0), jnp.float32(1e-3), tx, 1.0)[0]
    grads, loss = _grads(state.params), jnp.float32(1.0)
    if poison == "loss":
        loss = jnp.float32(jnp.nan)
    else:
        grads = {**grads, "norm": grads["norm"].at[3].set(jnp.inf)}
    new, metrics = jax.jit(lambda s, g, v: apply_update(s, g, v, jnp.float32(1e-3), tx, 1.0))(state, grads, loss)

    for got, want in zip(jax.tree.leaves((new.params, new.opt_state)), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (int(new.updates), int(new.skipped_updates), float(metrics["update/skipped"])) == (1, 1, 1.0)


@pytest.mark.parametrize("platform", ["cpu", *(pytest.param(p, marks=pytest.mark.integration)  # compile-only targets
                                              for p in ("gpu", "tpu"))])
def test_updates_in_a_loop_copy_no_weight_or_moment(platform):
    """Inside the update's mini-batch loop the step must write params and moments in place, on
    each compiler (GPU and TPU compiled from this host, as ``--mode=plan`` does).

    The non-finite skip decides it: XLA:CPU copies every moment and parameter once per update
    around a select (it keeps the old values alive beside the new: 2.2 GB per SmolLM2 RL step),
    XLA:GPU around a cond (a Qwen2.5-3B-shaped update: 39.9 GB against 29.1).
    """
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.targets import gpu_target, target_installed, tpu_target

    if platform != "cpu" and (missing := target_installed(platform)):
        pytest.skip(missing)
    device = {"cpu": lambda: jax.devices("cpu")[0], "gpu": lambda: gpu_target("h100", 1, 1).devices[0],
              "tpu": lambda: tpu_target("v5e:2x2").devices[0]}[platform]()
    mesh = make_mesh((1, 1, 1), [device])
    tx = make_optimizer(OPTIM)

    def updates(state):
        def one(_, s):
            return apply_update(s, _grads(s.params), jnp.float32(1.0), jnp.float32(1e-3), tx, 1.0)[0]
        return jax.lax.fori_loop(0, 2, one, state)

    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, jax.P())),
                         _state())
    with jax.set_mesh(mesh):
        hlo = jax.jit(updates, donate_argnums=0).lower(state).compile().as_text()
    # Copies per update: those inside the loop (its body and the computations it calls), i.e. outside
    # ENTRY, which runs once per call (XLA:TPU converts the 64-wide table to its tiled layout there).
    weight_shapes = {",".join(map(str, shape)) for shape in SHAPES.values()}
    copies, in_entry, entry_loops = [], False, 0
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line != "}":
            in_entry = line.startswith("ENTRY ")
        entry_loops += in_entry and " while(" in line
        m = re.search(r"= f32\[([\d,]+)\]\S* copy(?:-start)?\(", line)
        if m and m[1] in weight_shapes and not in_entry:
            copies.append(line.strip()[:160])
    assert entry_loops == 1 and not copies, copies
