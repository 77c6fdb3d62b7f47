"""The lab's death-spiral setting (the dated lab log, "Group size 8 at lr 3e-4": git show 575e402:docs/lab/log.md), GRPO arm.

    python -m llds_jax.main --config=configs/lab_spiral.py                           # GRPO, seed 0, 300 steps
    python -m llds_jax.main --config=configs/lab_spiral.py --config.rl.llds_coef=0.1  # LLDS arm
    python -m llds_jax.main --mode=sweep --config=configs/sweep_lab_spiral.py --config.sweep.launch=True

``configs/lab_grpo.py`` is the ≤ 10-minute default, where 100 steps at lr 2e-4 learn and do not
collapse. This is the setting where vanilla GRPO came closest to the paper's three phases on the
synthetic world: groups of 8 (more groups with a non-zero advantage), four sequential updates per
step, lr 3e-4 after a 20-step warm-up, 300 steps (≈ 20 min per arm on two quiet cores). Only
hyperparameters differ from the default lab run; world, tokenizer and policy are the same cached
build.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lab_grpo import get_config as lab_config  # noqa: E402

WARMUP_STEPS = 20


def get_config():
    c = lab_config()
    c.workdir = "runs/lab_spiral"
    c.rollout.n_samples = 8  # 8 prompts × 8 = 64 trajectories
    c.train.mini_batch_size = 16  # 4 sequential updates per step, as in the default lab run
    c.train.micro_batch_size = 16
    c.train.logprob_batch_size = 32
    c.train.total_steps = 300
    c.train.save_every = 50
    c.optim.lr = 3e-4
    c.optim.warmup_ratio = WARMUP_STEPS / c.train.total_steps  # then constant
    return c
