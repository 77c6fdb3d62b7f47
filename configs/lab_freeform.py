"""The free-form lab world (issue 43), GRPO arm: the conditions the paper's LLD mechanism needs.

    python -m llds_jax.main --config=configs/lab_freeform.py                               # GRPO, seed 0
    python -m llds_jax.main --config=configs/lab_freeform.py --config.rl.llds_coef=0.1     # LLDS arm
    python -m llds_jax.main --config=configs/lab_freeform.py --config.optim.warmup_ratio=0  # constant-lr control
    python -m llds_jax.main --mode=probe --config=configs/lab_freeform.py --config.probe.from_step=50

Same world and tokenizer as ``configs/lab_grpo.py`` (the first world, kept unchanged); what differs:

* the policy is pre-trained on free-form writing (``lab.policy.writing = "freeform"``,
  ``llds_jax.lab.freeform``): Markov-chain thoughts that name the entity 30 % of the time and
  paraphrased queries, so group members are near-duplicates, never identical, and tokens are
  not saturated (the first world's policy sits at ≈ 0.1 nat/token);
* sampling at temperature 1 with top-p 1 (the paper's rollouts; the first world used 0.95);
* 48-token actions (a thought plus a query fits; the SFT trajectories' longest action is 46);
* 8 prompts × 8 samples, 8 sequential mini-batch updates per step (π_θ moves away from π_old
  within a step, as with the paper's 512 / 256 … mini-batches);
* the paper's schedule: lr ramps linearly from 0 at step 0 over the whole run (Search-R1's
  phases all happen while its lr is still rising); ``--config.optim.warmup_ratio=0`` is the
  constant-lr control;
* checkpoints every 10 steps (20 kept) for ``--mode=probe``.

≈ 20–25 min per arm on two shared cores, the policy build (≈ 6 min) included once.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lab_grpo import get_config as lab_config  # noqa: E402


def get_config():
    c = lab_config()
    c.workdir = "runs/lab_freeform"
    c.lab.policy.writing = "freeform"
    c.lab.policy.thought_entity_prob = 0.3
    # After the first world's 400 SFT steps the free-form policy reads less (greedy EM one-hop 0.25,
    # two-hop 0.0 against 0.38 / 0.69): the gate is lowered rather than the build lengthened (≈ 8 min here).
    c.lab.policy.min_build_em = 0.2
    c.lab.policy.sft_max_seq_len = 320  # free-form trajectories run up to ≈ 290 tokens (fixed: 259)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.max_action_tokens = 48
    c.rollout.max_context = 448  # prompt ≈ 130 + 3 actions ≤ 48 + 2 feedbacks ≤ 96 = 466 worst case; SFT max 228
    c.rollout.n_samples = 8
    c.train.prompts_per_step = 8  # 64 trajectories
    c.train.mini_batch_size = 8  # 8 sequential updates per step
    c.train.micro_batch_size = 8
    c.train.logprob_batch_size = 32
    c.train.total_steps = 150
    c.train.save_every = 10
    c.train.keep_checkpoints = 20
    c.optim.lr = 8e-4  # the ramp's end; it passes the first world's collapse range (4e-4–5e-4) mid-run
    c.optim.warmup_ratio = 1.0  # linear ramp over the whole run ...
    c.optim.lr_first_step_zero = True  # ... from lr 0 at step 0 (verl's schedule)
    return c
