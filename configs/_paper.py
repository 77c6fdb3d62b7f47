"""Shared paper settings (SPEC §4, arXiv 2512.04220 §5) for the Qwen2.5 configs.

NQ+HotpotQA training, 512 prompts × 5 samples, mini-batches of 256 (10 updates per step),
AdamW lr 1e-6 with 28.5% linear warmup (first step at lr 0), max_turns 3, top-3 E5
retrieval, LLDS λ = 0.1 with the action gate. Not a config file itself (no ``get_config``
arguments): ``configs/qwen*.py`` call ``paper_config(...)`` with the model-specific parts.
"""

from llds_jax.config import base_config

# Rows per packed micro-batch (see the micro_batch_tokens line below for the arithmetic).
PACKED_ROWS = 16


def paper_config(model_dir: str, mesh_shape, micro_batch_size: int, logprob_batch_size: int):
    c = base_config()
    c.workdir = f"runs/{model_dir.rstrip('/').split('/')[-1]}-llds"
    c.model.source = model_dir  # an HF directory (config.json + safetensors); override on the command line
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.ref_dtype = "bfloat16"
    c.model.remat = "full"
    c.mesh.shape = tuple(mesh_shape)
    # Search-R1's nq_hotpotqa_train parquet (169,615 rows), made by its data_process/qa_search_train_merge.py.
    c.data.train = ("data/nq_hotpotqa_train/train.parquet",)
    # The E5 (Flat) wiki-18 service: python -m llds_jax.main --mode=serve --config=configs/retriever.py
    c.retrieval.method = "dense"
    c.retrieval.url = "http://127.0.0.1:8000/retrieve"
    c.rollout.topk = 3
    c.rollout.max_turns = 3
    c.rollout.temperature = 1.0
    c.rollout.top_p = 0.95
    # The continuous engine over the paged cache (rollout/engine.py): on GPU its decode step is one Pallas
    # kernel per layer with no host round trip (bench_rollout.py --decode-program); every local device holds rows.
    c.rollout.engine = "continuous"
    c.rollout.sampler_devices = -1
    c.rl.llds_coef = 0.1
    c.rl.llds_gate = "action"
    c.rl.ratio_max = 100.0  # the official LLDS code's clamp(ρ, max=100), not newer verl's ±20 log-ratio clamp
    c.rl.log_ratio_clamp = 0.0
    c.optim.lr = 1e-6
    c.optim.warmup_ratio = 0.285
    c.optim.lr_first_step_zero = True
    c.train.total_steps = 1005
    c.train.prompts_per_step = 512
    c.rollout.n_samples = 5
    c.train.mini_batch_size = 256
    c.train.micro_batch_size = micro_batch_size
    c.train.logprob_batch_size = logprob_batch_size
    c.rollout.max_context = 4096
    # Packed micro-batches of 16 rows of 4,096 (the padded micro_batch_size only bounds the padded fallback).
    # A mini-batch of 256 reference trajectories fills ≈ 47.5 rows (475 over 10), and its last micro-batch
    # is padded up to whole rows: at 8 shards 8 / 16 / 24 / 32 / 48 / 64 rows compute 1.13 / 1.15 / 1.17 /
    # 1.48 / 1.22 / 1.48× the real tokens (bench_train_step.py --packing-report, rows_sweep). 16 is the
    # narrowest width ≥ the 16 rows the H100 ran efficiently (one row per shard ran 2.5× slower) and a
    # multiple of 8 shards; on 64 shards (v5e:8x8) rows round up to one per shard = 64 (1.48×).
    c.train.micro_batch_tokens = PACKED_ROWS * c.rollout.max_context
    c.rollout.max_prompt_tokens = 2048
    c.rollout.max_action_tokens = 500
    c.rollout.max_obs_tokens = 500
    c.train.save_every = 50
    c.eval.data = "data/nq_test.jsonl"
    c.eval.limit = 0
    return c
