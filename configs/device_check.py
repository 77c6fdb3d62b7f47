"""The one-GPU check's training job (``launch/device_check.sh``): paper-like shapes, random weights.

    python -m llds_jax.main --config=configs/device_check.py --config.model.tokenizer=<qwen2 tokenizer dir>
    python -m llds_jax.main --config=configs/device_check.py:dry_run --config.model.tokenizer=...   # CPU, tiny

Qwen2.5-0.5B's shapes with random weights (``model.source="random:Qwen2.5-0.5B"``: nothing to
download), the paper's step structure and caps (SPEC §4: max_turns 3, 500-token actions and
observations, max_context 4,096, top-p 0.95 at T = 1, π_ref in bf16, full remat, LLDS λ 0.1 with the
A-gate) at 64 prompts × 5 samples, BM25 over the bundled corpus. A random policy never closes a tag,
so every action runs to its 500-token cap: the rollout's worst case. Its logits are scaled to a trained
model's spread (``model.random_logit_std``, 5 nats), so the top-p sampler takes the path the paper's
job takes, not the full-row fallback the init's near-flat rows force on every row. ``dry_run`` keeps the
structure at a size a 2-core CPU runs in a minute (the test suite runs it so the check cannot rot).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _paper import paper_config  # noqa: E402

from llds_jax.plan.step_time import TRAINED_LIKE_LOGIT_STD  # noqa: E402


def get_config(variant: str = ""):
    c = paper_config("random:Qwen2.5-0.5B", mesh_shape=(-1, 1, 1), micro_batch_size=16, logprob_batch_size=64)
    c.model.random_logit_std = TRAINED_LIKE_LOGIT_STD
    c.workdir = "runs/device_check"
    c.data.train = ("bundled:nq_train", "bundled:hotpotqa_train")
    c.retrieval.method = "bm25"
    c.retrieval.url = ""
    c.train.total_steps = 2  # the compiling step and one to time (the check fits one 10-minute device call)
    c.train.prompts_per_step = 64
    c.train.mini_batch_size = 32  # 10 sequential updates per step, as the paper's 2,560 / 256
    c.train.warmup_sft_steps = 0
    c.train.save_every = 0        # the run still checkpoints its last step
    c.train.export_hf = False
    c.train.loggers = ()  # metrics.jsonl alone
    c.train.samples_per_step = 320  # every trajectory's lengths: the plan's length_source for this run
    c.eval.data = ""
    if variant == "dry_run":
        c.model.source = "tiny:qwen2"
        c.model.random_logit_std = 0.0  # random: sources only
        c.model.dtype = "float32"
        c.model.ref_dtype = "float32"
        c.train.total_steps = 2
        c.train.prompts_per_step = 2
        c.rollout.n_samples = 4
        c.train.mini_batch_size = 4
        c.train.micro_batch_size = 2
        c.train.logprob_batch_size = 4
        c.train.samples_per_step = 8
        c.rollout.max_context = 512
        c.train.micro_batch_tokens = c.train.micro_batch_size * c.rollout.max_context  # the dry run: 2-row micro-batches
        c.rollout.max_prompt_tokens = 256
        c.rollout.max_action_tokens = 8
        c.rollout.max_obs_tokens = 64
        c.rollout.max_turns = 2
    elif variant:
        raise ValueError(f"configs/device_check.py:{variant}: the variants are '' and 'dry_run'")
    return c
