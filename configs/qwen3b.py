"""Qwen2.5-3B(-Base) GRPO + LLDS, the paper's main setting (Table 1).

    python -m llds_jax.main --config=configs/qwen3b.py --config.model.source=/models/Qwen2.5-3B

FSDP over every device (3B fp32 master + Adam ≈ 49 GB spread over the pod); micro-batches of
64 trajectories (a multiple of the device count on v5e-64 / 8×H100 hosts).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _paper import paper_config  # noqa: E402


def get_config():
    c = paper_config("Qwen2.5-3B", mesh_shape=(1, -1, 1), micro_batch_size=64, logprob_batch_size=128)
    # The update's remat, measured by the plan's compiled update (XLA memory_analysis, peak GB per device,
    # 16-row packed micro-batches): 8 x H100 full 12.19 / minimal 29.06 / dots_saveable 32.67 / none 62.86
    # of 80 GB; v5e:8x8 full 6.94 / minimal 16.74 (refused) / minimal_no_gate 13.50 of 16 GB. On a GPU
    # "minimal" keeps every matmul output (the backward reruns norms, RoPE, SiLU and cuDNN's attention
    # forward: 3.07 forwards an update instead of full's 4.00) with 44 GB to spare; "none" saves only the
    # attention rerun for 34 GB more. Elsewhere (a v5e chip) "minimal_no_gate" also reruns the MLP gate
    # projection (3.34 forwards) and peaks at 84 % of the chip.
    c.model.remat = "minimal_no_gate"
    c.model.remat_gpu = "minimal"
    return c
