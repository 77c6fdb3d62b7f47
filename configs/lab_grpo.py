"""The death-spiral lab, vanilla GRPO arm (λ = 0): a tiny policy on a synthetic search world.

    python -m llds_jax.main --config=configs/lab_grpo.py

On first use ``llds_jax.lab.prepare`` generates the world (fictional people, cities, countries
and companies as wiki-18-format passages; one- and two-hop questions), trains a byte-level BPE
tokenizer on it and pre-trains a 2-layer Qwen2-family decoder with the SFT step on
protocol-following trajectories; all three are cached under ``<LLDS_JAX_CACHE>/lab``. The run
itself is the ordinary trainer: same rollout, BM25 retriever, EM reward, loss and metrics as a
real run — only data, model size and hyperparameters differ. ``configs/lab_llds.py`` is this
config with LLDS switched on. See docs/death_spiral_lab.md.
"""

from llds_jax.config import base_config
from llds_jax.lab.prepare import default_lab_config
from llds_jax.lab.probe import default_probe_config


def get_config():
    c = base_config()
    c.workdir = "runs/lab_grpo"
    c.lab = default_lab_config()
    c.model.source = "lab:policy"  # lab:* values are filled in by llds_jax.lab.prepare
    c.model.logprob_chunk_size = 128
    c.mesh.shape = (-1, 1, 1)
    c.data.train = ("lab:train",)
    c.retrieval.method = "bm25"
    c.retrieval.corpus_path = "lab:corpus"
    c.lab.policy.min_build_em = 0.3  # fail the build if the pre-trained policy does not read (one-hop greedy EM)
    # One passage per search: the entity's own passage (BM25 on a fictional name finds it), so the
    # answer is the one name of the asked type in the context, and a sequence is ≤ 260 tokens.
    c.rollout.topk = 1
    c.rollout.max_turns = 2  # two searches: enough for a two-hop question, then the answer turn
    c.rollout.max_action_tokens = 32
    c.rollout.max_obs_tokens = 96
    c.rollout.max_prompt_tokens = 256
    c.rollout.max_context = 384  # prompt ≈130 + 3 actions ≤ 32 + 2 feedbacks ≤ 96 (SFT trajectories 187–259)
    c.rollout.pad_to_multiple = 64
    c.rollout.n_samples = 5
    c.rl.llds_coef = 0.0  # vanilla GRPO
    c.rl.llds_gate = "action"
    # A from-scratch 2-layer model needs far larger steps than a pretrained 3B at 1e-6 to move at all;
    # 2e-4 with 4 updates per step is the aggressive end the paper blames for the spiral (5e-5 moved little).
    c.optim.lr = 2e-4
    c.optim.warmup_ratio = 0.0
    c.optim.lr_first_step_zero = False
    c.train.total_steps = 100  # ≈10 min here at ≈5 s per step
    c.train.prompts_per_step = 8
    c.train.mini_batch_size = 10  # 40 trajectories → 4 sequential updates per step (π_θ ≠ π_old)
    c.train.micro_batch_size = 10
    c.train.logprob_batch_size = 20
    c.train.warmup_sft_steps = 0  # the lab policy is already pre-trained on the protocol
    c.train.save_every = 100
    c.train.loggers = ()  # metrics.jsonl alone
    c.sft.data = ("lab:train",)
    c.eval.data = "lab:dev"
    c.eval.limit = 32
    c.eval.batch_size = 16
    c.eval.greedy = True
    c.probe = default_probe_config()  # --mode=probe on this run's checkpoints (llds_jax.lab.probe)
    return c
