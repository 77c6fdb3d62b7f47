"""The ahead-of-time front-end: abstract inputs carrying the run's shardings, and one compile step.

``--mode=plan`` and the HLO-reading roofline tool both compile the project's own jitted
programs against ``jax.ShapeDtypeStruct`` arguments on a mesh of real or compile-only devices. They
share these functions so that what the tool reads is what the planner measures: the same abstract
train state (as ``Learner.create`` would build it), the same KV cache, and the same handling of
XLA:TPU's refusal of a program that overflows one chip's HBM.
"""

from __future__ import annotations

import jax
from flax import nnx


class TooLargeToCompile(Exception):
    """XLA:TPU refused the program even with ``xla_tpu_no_crash_on_oom``: one buffer alone exceeds the HBM.
    ``messages`` are both refusals in full (they name the sizes)."""

    def __init__(self, *messages: str):
        super().__init__(" | ".join(" ".join(m.split())[:240] for m in messages))
        self.messages = messages


def compile_ahead(jitted, *abstract_args, platform: str = "cpu", **static):
    """Lower ``jitted`` on abstract arguments (under the caller's mesh) and compile it.

    Returns ``(executable, refusal)``. XLA:TPU's refusal for lack of HBM does not stop it: the
    program is compiled again with ``xla_tpu_no_crash_on_oom`` (layouts, temporaries and costs do
    not depend on fit) and the refusal returned, "" when there was none; :class:`TooLargeToCompile`
    when even that fails.
    """
    lowered = jitted.lower(*abstract_args, **static)
    try:
        return lowered.compile(), ""
    except jax.errors.JaxRuntimeError as err:
        if platform != "tpu" or "RESOURCE_EXHAUSTED" not in str(err):
            raise
        refused = str(err)
    try:
        return lowered.compile(compiler_options={"xla_tpu_no_crash_on_oom": True}), " ".join(refused.split())[:240]
    except jax.errors.JaxRuntimeError as again:
        if "RESOURCE_EXHAUSTED" not in str(again):
            raise
        raise TooLargeToCompile(refused, str(again)) from again


def abstract_train_state(config, decoder_cfg, mesh, rules):
    """``(graphdef, train state, its shardings)``: the learner's state as ``train.state_layout`` lays it
    out (the one builder of train-state shardings), from an abstract model (no weights)."""
    from llds_jax.models import Decoder  # noqa: PLC0415
    from llds_jax.parallel.rules import use_rules  # noqa: PLC0415
    from llds_jax.train.state_layout import train_state_layout  # noqa: PLC0415

    model = nnx.eval_shape(lambda: Decoder(decoder_cfg, rngs=nnx.Rngs(0)))
    with use_rules(rules):
        layout = train_state_layout(model, config, mesh)
    return layout.graphdef, layout.abstract, layout.shardings
