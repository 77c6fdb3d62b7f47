"""Mesh and sharding: one rules table from logical axis names to mesh axes.

    from llds_jax.parallel import (make_mesh, MESH_AXES, ShardingRules, DEFAULT_RULES,
                                   logical_to_sharding, constrain, use_rules, current_rules,
                                   param_specs, param_shardings, shard_model)

    mesh = make_mesh((data, fsdp, tensor))      # axes ("data", "fsdp", "tensor"), AxisType.Auto
    rules = ShardingRules.from_mapping(None, mlp=None)   # default table with overrides
    rules.spec(("batch", "seq"), shape, mesh) -> PartitionSpec   # drops size-1 / non-dividing axes
    logical_to_sharding(("batch", "seq"), mesh, rules=None, shape=None) -> NamedSharding
    constrain(x, ("batch", "seq", "act_embed"))  # identity without jax.set_mesh(mesh)
    with use_rules(rules): ...                    # table for constraints traced in the block
    shard_model(model, mesh, rules=None)          # in place, from each Param's logical_axes
    param_specs(model_or_abstract_model, mesh, rules=None) -> {dotted path: PartitionSpec}

Logical names: activations batch, seq, act_embed, act_heads, act_kv_heads, act_mlp,
act_vocab, cache_seq; parameters layers, vocab, embed, q_heads, kv_heads, head_dim, mlp,
norm. Batches are sharded with "batch" -> ("data", "fsdp"). Run jitted code under
``with jax.set_mesh(mesh):`` so the model's activation constraints apply.
"""

from llds_jax.parallel.mesh import MESH_AXES, make_mesh
from llds_jax.parallel.placement import param_shardings, param_specs, shard_model
from llds_jax.parallel.rules import (
    DEFAULT_RULES,
    ShardingRules,
    constrain,
    current_rules,
    logical_to_sharding,
    use_rules,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "ShardingRules",
    "constrain",
    "current_rules",
    "logical_to_sharding",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "shard_model",
    "use_rules",
]
