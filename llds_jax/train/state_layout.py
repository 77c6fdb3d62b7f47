"""The one builder of a train state's layout on a mesh: (graphdef, abstract state, shardings).

The learner, the SFT warm-up, the planner and resume all call :func:`train_state_layout`. It reads
only shapes: the parameters' shardings come from their declared logical axes through the ambient
rules table (``parallel.rules.current_rules``), the Adam moments', counters' and π_ref's from
``train.state.train_state_shardings``, and every leaf of ``abstract`` is a
``jax.ShapeDtypeStruct`` carrying its sharding. So the same call serves a model that exists
(``StateLayout.fresh`` then builds step 0's state with one jitted call) and one that does not
(``nnx.eval_shape``: the planner compiles against ``abstract``; resume restores straight into it,
never building a fresh state just to read its shapes — at 3B that fresh state is ≈ 99 GB across
the mesh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from llds_jax.parallel.rules import current_rules
from llds_jax.train.state import TrainState, init_train_state, train_state_shardings
from llds_jax.train.step_settings import needs_reinforce_pp_reference


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a train state on ``mesh`` looks like before any of its arrays exist."""

    graphdef: Any
    abstract: TrainState   # jax.ShapeDtypeStruct leaves, each with its sharding (a restore target)
    shardings: TrainState
    init: Callable[[Any, Any], TrainState]  # (params, π_ref params or None) → step 0's state

    @property
    def with_reference(self) -> bool:
        return self.abstract.ref_params is not None

    def fresh(self, params, ref_params=None) -> TrainState:
        """Step 0's state from concrete ``params`` (and π_ref's source params), laid out as :attr:`shardings`."""
        if (ref_params is not None) != self.with_reference:
            raise ValueError(f"this layout {'has' if self.with_reference else 'has no'} π_ref: pass "
                             f"{'its' if self.with_reference else 'no'} ref_params")
        return jax.jit(self.init, out_shardings=self.shardings)(params, ref_params)


def abstract_params(model: nnx.Module, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """(graphdef, params) with every parameter a ``ShapeDtypeStruct`` on its rules-table sharding.

    ``model`` may be concrete or abstract (``nnx.eval_shape``): only shapes, dtypes and the
    parameters' ``logical_axes`` are read.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    rules = current_rules()

    def attach(var: nnx.Variable) -> nnx.Variable:
        sharding = rules.sharding(var.get_metadata()["logical_axes"], mesh, var.shape)
        return var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding))

    return graphdef, jax.tree.map(attach, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def train_state_layout(model: nnx.Module, config, mesh: jax.sharding.Mesh, *, optim=None,
                       with_reference: bool | None = None) -> StateLayout:
    """The layout of ``model``'s train state on ``mesh``: the RL learner's by default.

    ``optim``: the optimizer section (default ``config.optim``; SFT passes its own lr, the moments'
    tree is the same). ``with_reference``: keep a π_ref (default: when the RL objective reads
    one — ``rl.kl_coef > 0`` or REINFORCE++'s baseline); its dtype is ``model.ref_dtype``.
    """
    optim = config.optim if optim is None else optim
    if with_reference is None:
        with_reference = config.rl.kl_coef > 0 or needs_reinforce_pp_reference(config.rl)
    ref_dtype = None if config.model.ref_dtype == config.model.param_dtype else config.model.ref_dtype
    graphdef, params = abstract_params(model, mesh)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)

    def init(p, r):
        return init_train_state(p, optim, config.seed, r, ref_dtype, config.rl.llds_coef)

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init, params, params if with_reference else None)
    shardings = train_state_shardings(abstract, param_shardings, mesh, optim)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    return StateLayout(graphdef, abstract, shardings, init)
