"""The trainer's state pytree, its optimizer, and the learning-rate schedule.

``TrainState`` is the one object the update step donates and returns, and the one the
checkpointer (``llds_jax.train.checkpoint``) saves. Its contract:

* ``params``     — ``nnx.State`` of the policy's ``nnx.Param`` leaves, fp32 master weights
  (``nnx.split(model, nnx.Param, ...)``); merged with the model's graphdef to run it.
* ``opt_state``  — optax state of ``make_optimizer``: Adam moments (same tree and shardings as
  ``params``) plus scalar counters (replicated).
* ``ref_params`` — the frozen reference policy π_ref (the params RL started from: after the SFT
  warm-up, if any), possibly cast to bf16; ``None`` when the KL coefficient is 0. Saved
  because after a warm-up it is *not* the pretrained checkpoint any more.
* ``step``       — int32 scalar, completed *training* steps (one rollout batch each). The LR
  schedule is indexed by it, not by the optimizer's update count, as in the reference
  (verl steps its scheduler once per rollout, so the 10 mini-batch updates of a step share an lr).
* ``updates`` / ``skipped_updates`` — int32 counts of optimizer updates applied, and skipped
  because the loss or a gradient was non-finite (the step keeps params and moments unchanged).
* ``llds_coef``  — fp32 scalar λ of the LLDS term, read by the update step at run time (a
  traced value, so changing it does not recompile): the death-spiral monitor's
  ``raise_lambda`` action sets it, and a checkpoint carries the raised value into a resumed run.
* ``rng``        — raw ``uint32`` key data (``jax.random.key_data``), not a typed key, so it
  saves and restores as a plain array; ``state.key()`` rebuilds the typed key.

The data iterator's position is *not* in here (it is host-side JSON, see
``llds_jax.data.prompts.PromptIterator.state_dict``); the checkpointer saves both.

Why the lr is not inside the optax chain: the clip needs the pre-clip norm for metrics and the
non-finite guard needs the norm before any update, so clip/guard/lr-scale are done explicitly by
:func:`apply_update` — the one optimizer step of both the RL update and the SFT warm-up — and the
optax part is only ``scale_by_adam`` + decoupled weight decay.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.models.reductions import target_platform

# Platforms whose compiler updates the optimizer state in place around a select skip, and copies
# it around a cond (see apply_update).
_SELECT_SKIP_PLATFORMS = ("gpu", "cuda", "rocm")


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    ref_params: Any
    rng: jax.Array
    updates: jax.Array
    skipped_updates: jax.Array
    llds_coef: jax.Array

    def key(self) -> jax.Array:
        return jax.random.wrap_key_data(self.rng)


def make_optimizer(optim_cfg) -> optax.GradientTransformation:
    """AdamW *direction* (moments + decoupled weight decay), without lr and clipping.

    ``add_decayed_weights`` runs before the (external) lr scale, so the decay is ``lr·wd·p`` as
    in ``torch.optim.AdamW``; both use the pre-update params.
    """
    return optax.chain(
        optax.scale_by_adam(b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps),
        optax.add_decayed_weights(optim_cfg.weight_decay),
    )


def learning_rate(step: jax.Array | int, optim_cfg, total_steps: int) -> jax.Array:
    """Linear warmup over ``warmup_ratio·total_steps`` training steps, then constant.

    ``lr_first_step_zero`` (reference default) reproduces verl's
    ``get_constant_schedule_with_warmup``: factor ``step / warmup`` so the very first step
    trains at lr 0; without it the factor is ``(step + 1) / warmup``.
    """
    warmup = int(optim_cfg.warmup_ratio * total_steps)
    step = jnp.asarray(step, jnp.float32)
    if warmup <= 0:
        return jnp.asarray(optim_cfg.lr, jnp.float32)
    progress = step if optim_cfg.lr_first_step_zero else step + 1.0
    return optim_cfg.lr * jnp.minimum(1.0, progress / warmup)


def global_norm(tree) -> jax.Array:
    """The fp32 global L2 norm of a pytree (the clip's and the non-finite guard's norm)."""
    return optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), tree))


def apply_update(state: TrainState, grads, loss: jax.Array, lr: jax.Array, tx: optax.GradientTransformation,
                 clip_norm: float) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step: clip by global norm, skip if non-finite, AdamW direction × lr, counters.

    When the loss or the pre-clip norm is non-finite the step keeps params and Adam moments
    unchanged (``skipped_updates`` counts it; ``updates`` counts applied steps). ``state.step``
    is not touched: the RL step advances it once per rollout batch, SFT once per update.
    Returns the new state and ``grad/norm_preclip``, ``grad/clip_scale``, ``update/skipped``.
    """
    grad_norm = global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))

    def step(params, opt_state):
        direction, new_opt_state = tx.update(jax.tree.map(lambda g: g * scale, grads), opt_state, params)
        return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, direction), new_opt_state

    # How the skip is written decides which compiler copies the state (measured on each one's
    # update with two mini-batches): XLA:CPU copies every moment and parameter per update around a
    # select, which keeps the old values alive beside the new (2.2 GB of copies and temp pages per
    # SmolLM2 RL step), and runs a cond's branches in place; XLA:GPU copies them around a cond
    # (Qwen2.5-3B-shaped: 39.9 GB an update against 29.1 with the select, which it fuses into the
    # AdamW arithmetic); XLA:TPU runs both in place (the cond 4 % fewer bytes).
    if target_platform() in _SELECT_SKIP_PLATFORMS:
        new_params, new_opt_state = step(state.params, state.opt_state)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (new_params, new_opt_state), (state.params, state.opt_state))
    else:
        params, opt_state = jax.lax.cond(finite, step, lambda p, o: (p, o), state.params, state.opt_state)
    state = state.replace(
        params=params,
        opt_state=opt_state,
        updates=state.updates + finite.astype(jnp.int32),
        skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
    )
    return state, {"grad/norm_preclip": grad_norm, "grad/clip_scale": scale,
                   "update/skipped": (~finite).astype(jnp.float32)}


def init_train_state(params, optim_cfg, seed: int, ref_params=None,
                     ref_dtype: str | None = None, llds_coef: float = 0.0) -> TrainState:
    """A fresh state at step 0; ``ref_params`` is copied (cast to ``ref_dtype`` if given).

    Always a copy: the update step donates the whole state, and a reference that aliases the
    policy's buffers would be donated twice.
    """
    if ref_params is not None:
        ref_params = jax.tree.map(lambda x: jnp.array(x, dtype=ref_dtype or x.dtype, copy=True), ref_params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=make_optimizer(optim_cfg).init(params),
        ref_params=ref_params,
        rng=jax.random.key_data(jax.random.key(seed)),
        updates=jnp.zeros((), jnp.int32),
        skipped_updates=jnp.zeros((), jnp.int32),
        llds_coef=jnp.asarray(llds_coef, jnp.float32),
    )


def train_state_shardings(abstract_state: TrainState, param_shardings, mesh: jax.sharding.Mesh,
                          optim_cfg) -> TrainState:
    """Shardings for every leaf of ``abstract_state``, derived from the params' shardings.

    Adam moments take their parameter's sharding; counters, step and rng are replicated; the
    reference params take the policy's layout (bf16 or not, same shapes).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        make_optimizer(optim_cfg),
        lambda _leaf, sharding: sharding,
        abstract_state.opt_state,
        param_shardings,
        transform_non_params=lambda _leaf: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding | nnx.Variable),
    )
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt_shardings,
        ref_params=None if abstract_state.ref_params is None else param_shardings,
        rng=replicated,
        updates=replicated,
        skipped_updates=replicated,
        llds_coef=replicated,
    )
