"""Reading a compiled program's HLO text in product tests: the real decode loop compiled ahead of time
through the planner's front-end (``plan.aot``), its while-loop bodies, and the ops outside fusions
(what touches memory). The roofline tool keeps a fuller reader of its own."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_NOT_MEMORY = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple", "while", "call", "conditional"}


def while_bodies(hlo: str) -> set[str]:
    """Names of the computations that are while-loop bodies."""
    return set(re.findall(r" while\(.*?body=%([\w.\-]+)", hlo))


def ops_outside_fusions(hlo: str) -> list[dict]:
    """Every instruction of an unfused computation with an array result: name, opcode, shape
    (``f32[8,2,256,16]``), the computation holding it, and the tail of its ``op_name``."""
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.\-]+)", hlo))
    computation, found = "", []
    for line in hlo.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header[1]
        elif computation not in fused and (match := _INSTRUCTION.match(line)) and match[4] not in _NOT_MEMORY:
            op_name = re.search(r'op_name="([^"]*)"', line)
            found.append(dict(name=match[1], opcode=match[4], shape=f"{match[2]}[{match[3]}]",
                              computation=computation, op_name=op_name[1][-90:] if op_name else ""))
    return found


def compiled_decode_loop(decoder_cfg, target: str, *, batch: int, slots: int, width: int) -> str:
    """Optimised HLO of ``sampling.decode_loop.decode`` for ``batch`` rows and a ``slots``-slot cache on one
    device of ``target`` ("cpu", or "tpu": a compile-only v5e), weights in the compute dtype."""
    from llds_jax.config import base_config
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.rules import DEFAULT as rules
    from llds_jax.plan.aot import abstract_cache, abstract_train_state, compile_ahead
    from llds_jax.plan.targets import tpu_target
    from llds_jax.sampling.decode_loop import MAX_STOP_IDS, SamplingParams, decode

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: claim no chip
    device = jax.devices("cpu")[0] if target == "cpu" else tpu_target("v5e:2x2").devices[0]
    mesh = make_mesh((1, 1, 1), [device])
    config = base_config()
    config.model.param_dtype = config.model.ref_dtype = decoder_cfg.param_dtype
    graphdef, state, _ = abstract_train_state(config, decoder_cfg, mesh, rules)
    cache = abstract_cache(decoder_cfg, batch, slots, mesh, rules)

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, jax.P()))

    compute = jnp.dtype(decoder_cfg.dtype)  # the sampler's copy of the weights (models.params_in_compute_dtype)
    params = jax.tree.map(lambda x: arr(x.shape, compute if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
                          state.params)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    stop_table = arr((2, 16, decoder_cfg.vocab_size), jnp.int8)  # two stop strings, one state bucket
    sampling = SamplingParams(arr((), jnp.float32), arr((), jnp.int32), arr((), jnp.float32),
                              arr((MAX_STOP_IDS,), jnp.int32), stop_table)
    with jax.set_mesh(mesh):
        compiled, _ = compile_ahead(decode, graphdef, params, arr((batch, decoder_cfg.vocab_size), jnp.float32),
                                    cache, arr((batch,), jnp.bool_), arr((batch,), jnp.int32),
                                    arr(keys.shape, keys.dtype), arr((batch,), jnp.int32), sampling,
                                    platform=device.platform, width=width)
    return compiled.as_text()
