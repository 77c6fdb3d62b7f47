"""A small sharded training problem (linear regression + AdamW + typed PRNG key) for scale tests.

It stands in for the trainer's state where a test needs a generic pytree: params sharded over
both mesh axes, optax AdamW moments with the params' shardings, replicated counters and a
typed key, and a jitted update step whose result can be compared across meshes and hosts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

IN_DIM, OUT_DIM, BATCH = 32, 16, 64
MESH_AXES = ("data", "fsdp")
PARAM_SPECS = {"w": P("data", "fsdp"), "b": P("fsdp")}
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.01)


def make_mesh(shape, devices=None) -> jax.sharding.Mesh:
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=auto, devices=devices)


def state_shardings(mesh):
    replicated = NamedSharding(mesh, P())
    params = {k: NamedSharding(mesh, spec) for k, spec in PARAM_SPECS.items()}
    abstract = jax.eval_shape(init_state_host, 0)
    opt = optax.tree_map_params(OPTIMIZER, lambda _, s: s, abstract["opt_state"], params,
                                transform_non_params=lambda _: replicated,
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"params": params, "opt_state": opt, "step": replicated, "rng": replicated}


def init_state_host(seed: int):
    key = jax.random.key(seed)
    kw, kb, kr = jax.random.split(key, 3)
    params = {"w": jax.random.normal(kw, (IN_DIM, OUT_DIM)) * 0.1,
              "b": jax.random.normal(kb, (OUT_DIM,)) * 0.1}
    return {"params": params, "opt_state": OPTIMIZER.init(params), "step": jnp.int32(0), "rng": kr}


def init_state(seed: int, mesh):
    shardings = state_shardings(mesh)
    return jax.jit(init_state_host, static_argnums=0, out_shardings=shardings)(seed)


def batch(step: int):
    """Deterministic data for ``step`` (host numpy, identical on every host)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, IN_DIM)).astype(np.float32)
    y = (x[:, :OUT_DIM] * 0.5 + 0.1).astype(np.float32)
    return x, y


def _loss(params, x, y, key):
    noise = 0.01 * jax.random.normal(key, y.shape)
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y - noise) ** 2)


def train_step(state, x, y):
    key, next_key = jax.random.split(state["rng"])
    loss, grads = jax.value_and_grad(_loss)(state["params"], x, y, key)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": next_key}, loss


def jit_train_step(mesh):
    shardings = state_shardings(mesh)
    data = NamedSharding(mesh, P(MESH_AXES))
    return jax.jit(train_step, in_shardings=(shardings, data, data),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
