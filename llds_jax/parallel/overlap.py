"""XLA options that let the training programs' FSDP collectives run behind their layers' compute.

Every pass over a micro-batch gathers each layer's weights (sharded over ``fsdp``) before the layer
multiplies them, and the update reduce-scatters each layer's gradient after its backward. XLA:GPU's
defaults start a layer's gather a few ops before that layer, inside the same trip of the layer loop, and
finish a gradient's reduce-scatter before the trip ends: the link and the SMs take turns. XLA's collective
pipeliner moves them across loop trips instead — the gather of layer i + 1 is issued in trip i and waits
behind that trip's attention and MLP, the reduce-scatter of layer i's gradient runs behind trip i + 1's
backward matmuls — the FSDP settings of NVIDIA's JAX-Toolbox GPU guide and MaxText's GPU recipes.

What the compiled programs do with them (XLA:GPU, tiny FSDP-8 bf16 programs compiled from a CPU host:
``tests/scale/test_plan_collectives.py`` checks it, ``plan.collectives`` charges it):

* the forward's layer gathers are pipelined: only the first layer's (peeled before the loop) is exposed;
* the update's backward gathers its layers' weights again inside each trip, just before that trip's
  recompute: these stay exposed (the pipeliner leaves the reversed scan's gathers where they are);
* the gradients' reduce-scatters are pipelined: only the last trip's (drained after the loop) is exposed.

The LM head's table is outside the layer loop (``models.logprobs`` gathers it before its chunks): its
moves stay exposed either way.

``xla_gpu_enable_pipelined_all_reduce`` is needed for the reduce-scatter to move at all: with the other
two alone the compiled backward trip still starts and finishes its reduce-scatter back to back (it shares
the trip with a small bf16 all-reduce of the replicated biases' and norms' gradients). The cost: the
pipeliner also peels one mini-batch of the update's outer loop, which doubles the update program's size
and about doubles its compile time (once a run), and the programs hold the next
layer's gathered weights beside the current ones (qwen3b's update 29.06 → 31.05 GB a device, from the
plan). Double buffering (``xla_gpu_enable_while_loop_double_buffering``) was tried and not kept: it
unrolls every loop twice and leaves the backward's gathers exposed all the same.

Options a compiler does not read are ignored: the CPU compiler and XLA:TPU accept these and change nothing
(XLA:TPU overlaps its collectives through its own async collective fusions).
"""

from __future__ import annotations

TRAINING_COMPILER_OPTIONS = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}
