"""Qwen2.5-7B(-Base) GRPO + LLDS (paper Table 2: GRPO 0.350 → LLDS 0.462 EM).

    python -m llds_jax.main --config=configs/qwen7b.py --config.model.source=/models/Qwen2.5-7B

FSDP × 4-way tensor parallelism: 7.6B fp32 master + Adam ≈ 122 GB; tensor=4 keeps each
device's share of the 28 query heads / 18,944 MLP columns even (4 KV heads shard evenly too).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _paper import paper_config  # noqa: E402


def get_config():
    return paper_config("Qwen2.5-7B", mesh_shape=(1, -1, 4), micro_batch_size=64, logprob_batch_size=128)
