"""Qwen2.5-0.5B GRPO + LLDS with the paper's step structure: a cheap full-size pipeline check.

    python -m llds_jax.main --config=configs/qwen0p5b.py --config.model.source=/models/Qwen2.5-0.5B

Sized for one H100 (--mode=plan --config.plan.gpu=h100 --config.plan.devices=1: fits) and any
data-parallel mesh whose size divides 16: micro-batches of 16 trajectories with full remat (64
rows x 4,096 tokens without remat held 530 GB of activations on one device).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _paper import paper_config  # noqa: E402


def get_config():
    c = paper_config("Qwen2.5-0.5B", mesh_shape=(-1, 1, 1), micro_batch_size=16, logprob_batch_size=64)
    return c
