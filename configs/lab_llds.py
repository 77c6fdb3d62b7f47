"""The death-spiral lab, LLDS arm: ``configs/lab_grpo.py`` with λ = 0.1 and the action gate (SPEC §5).

    python -m llds_jax.main --config=configs/lab_llds.py

Everything else — world, tokenizer, policy, seed, batch and optimiser — is the GRPO arm's, so
the two runs differ only in the regulariser.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lab_grpo import get_config as grpo_config  # noqa: E402


def get_config():
    c = grpo_config()
    c.workdir = "runs/lab_llds"
    c.rl.llds_coef = 0.1  # paper λ
    c.rl.llds_gate = "action"  # A-gate, the official code's default
    return c
