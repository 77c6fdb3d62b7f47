"""The lab's spiral setting transferred to real weights: SmolLM2-135M on the bundled corpus, GRPO arm.

    python -m llds_jax.main --config=configs/lab_transfer_smollm2.py                           # GRPO
    python -m llds_jax.main --config=configs/lab_transfer_smollm2.py --config.rl.llds_coef=0.1  # LLDS arm

Issue 17 item 5: the structure of ``configs/lab_spiral.py`` (groups of 8, four sequential
updates per step, a warm-up then a constant lr) on the default job's model, data, retriever and
format warm-up (``configs/cpu_smoke.py``). Only the step's shape and the lr schedule differ from
the default job. One RL step is ≈ 100 s on two CPU cores, so this is a run measured in tens of
steps, not hundreds; it checkpoints every 10 steps and resumes where it stopped.

The lr is not the lab's: 3e-4 is for a 2-layer model trained from scratch. 1e-5 is 5× the default
job's (and 10× the paper's 3B lr); it was chosen before the run, not tuned on it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from cpu_smoke import get_config as smoke_config  # noqa: E402

WARMUP_STEPS = 10


def get_config():
    c = smoke_config()
    c.workdir = "runs/lab_transfer_smollm2"
    c.rl.llds_coef = 0.0  # vanilla GRPO, as lab_spiral.py
    c.rollout.n_samples = 8  # the default job's 2 prompts × 8 = 16 trajectories
    c.train.mini_batch_size = 4  # 4 sequential updates per step, as in the lab
    c.train.total_steps = 200
    c.train.save_every = 10
    c.optim.lr = 1e-5
    c.optim.warmup_ratio = WARMUP_STEPS / c.train.total_steps  # then constant
    return c
