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
    return paper_config("Qwen2.5-3B", mesh_shape=(1, -1, 1), micro_batch_size=64, logprob_batch_size=128)
