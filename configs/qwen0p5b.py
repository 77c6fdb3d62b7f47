"""Qwen2.5-0.5B GRPO + LLDS with the paper's step structure: a cheap full-size pipeline check.

    python -m llds_jax.main --config=configs/qwen0p5b.py --config.model.source=/models/Qwen2.5-0.5B
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _paper import paper_config  # noqa: E402


def get_config():
    c = paper_config("Qwen2.5-0.5B", mesh_shape=(-1, 1, 1), micro_batch_size=64, logprob_batch_size=128)
    c.model.remat = "none"
    return c
