"""Update throughput of our jitted GRPO + LLDS step vs the same step in PyTorch (transformers model).

Both sides run the *same* step on the *same* weights and batch, fp32 on CPU:
sequential mini-batches (no shuffle), micro-batch gradient accumulation with mini-batch
denominators (token-mean), PPO-clip (ε 0.2) + k3 KL to a frozen reference (0.001) − entropy
bonus (0.001) + LLDS with the action gate (λ 0.1), global-norm clip 1.0, AdamW (lr 1e-6,
wd 0.01). π_old and π_ref log-probs are computed beforehand and excluded from the timing on
both sides: what is timed is the update phase, reported as tokens/s (every non-padding token
of the batch goes through forward + backward once per step).

    python benchmarks/bench_train_step.py                      # tiny + SmolLM2-135M, 16×256 tokens
    python benchmarks/bench_train_step.py --models=tiny --steps=5

The PyTorch side is a straightforward eager implementation (transformers ``LlamaForCausalLM``
built from the same config + safetensors export); it materialises [B, T, V] logits per
micro-batch, which at these sizes is the fast path for torch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

N, T, MINI, MICRO = 16, 256, 8, 4


def batch_arrays(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rollout-shaped batch: prompt 96, action 0 (40), feedback 60 (masked), action 1 (40), padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (N, T)).astype(np.int32)
    attention = np.zeros((N, T), bool)
    attention[:, :236] = True
    action = np.zeros((N, T), np.float32)
    action_index = np.full((N, T), -1, np.int32)
    for k, (a, b) in enumerate(((96, 136), (196, 236))):
        action[:, a:b] = 1
        action_index[:, a:b] = k
    answer = np.zeros((N, T), np.float32)
    answer[:, 226:236] = 1
    rewards = (rng.random(N) < 0.5).astype(np.float32)
    return dict(input_ids=ids, attention_mask=attention, action_mask=action, action_index=action_index,
                answer_mask=answer, num_searches=np.ones(N, np.float32), rewards=rewards,
                group_ids=np.repeat(np.arange(N // 4), 4))


def jax_config():
    from llds_jax.app.config import base_config

    c = base_config()
    c.mesh.shape = (1, 1, 1)
    c.train.update(dict(prompts_per_step=N // 4, mini_batch_size=MINI, micro_batch_size=MICRO,
                        logprob_batch_size=N, total_steps=1000))
    c.rollout.update(dict(n_samples=4, max_context=T, pad_to_multiple=T))
    c.optim.update(dict(warmup_ratio=0.0, lr_first_step_zero=False))
    c.model.logprob_chunk_size = 128
    return c


def bench_jax(model, arrays, steps: int) -> dict:
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.learner import Learner

    config = jax_config()
    learner = Learner.create(model, config, make_mesh((1, 1, 1)))
    times = []
    for _ in range(steps + 1):
        metrics, _ = learner.update(arrays, arrays["rewards"], arrays["group_ids"])
        times.append(metrics["time/update_s"])
    return {"compile_and_first_s": times[0], "update_s": float(np.median(times[1:])),
            "loss": metrics["loss/total"], "llds": metrics["llds/value"]}


def torch_step(model, ref_logp, old_logp, arrays, advantages, optimizer, clip=0.2, kl_coef=1e-3, ent_coef=1e-3,
               lam=0.1):
    ids = torch.from_numpy(arrays["input_ids"]).long()
    attn = torch.from_numpy(arrays["attention_mask"]).long()
    mask = torch.from_numpy(arrays["action_mask"][:, 1:])
    index = torch.from_numpy(arrays["action_index"][:, 1:]).long()
    adv = torch.from_numpy(advantages)
    for start in range(0, N, MINI):
        rows = slice(start, start + MINI)
        denom = mask[rows].sum()
        optimizer.zero_grad(set_to_none=True)
        for m0 in range(start, start + MINI, MICRO):
            r = slice(m0, m0 + MICRO)
            logits = model(input_ids=ids[r], attention_mask=attn[r]).logits[:, :-1].float()
            logprobs = torch.log_softmax(logits, -1)
            logp = logprobs.gather(-1, ids[r, 1:, None]).squeeze(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
            m, a = mask[r], adv[r, None]
            ratio = torch.exp(torch.clamp(logp - old_logp[r], -20, 20))
            pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
            x = torch.clamp(ref_logp[r] - logp, -20, 20)
            kl = torch.clamp(torch.exp(x) - x - 1, -10, 10)
            d = old_logp[r] - logp
            d_const = d.detach()
            runs = torch.where(m > 0, index[r], 0)
            run_sum = torch.zeros(MICRO, 8).scatter_add_(1, runs, torch.where(m > 0, d_const, 0.0))
            gate = (run_sum.gather(1, runs) > 0).float()
            preserved = (a >= 0).float()
            llds = m * preserved * gate * torch.where(d_const > 0, d, torch.zeros_like(d))
            loss = ((pg + kl_coef * kl - ent_coef * entropy) * m).sum() / denom + lam * llds.sum() / denom
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def bench_torch(hf_dir, arrays, advantages, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    with torch.no_grad():
        ids = torch.from_numpy(arrays["input_ids"]).long()
        attn = torch.from_numpy(arrays["attention_mask"]).long()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        old = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)
    times = []
    for _ in range(steps + 1):
        clock = time.perf_counter()
        torch_step(model, old.clone(), old.clone(), arrays, advantages, optimizer)
        times.append(time.perf_counter() - clock)
    return {"first_s": times[0], "update_s": float(np.median(times[1:]))}


def load_model(name: str):
    from llds_jax import models
    from llds_jax.models.testing import tiny_model

    if name == "tiny":
        return tiny_model("llama", vocab_size=4096)
    if name == "smollm2":
        from llds_jax.utils.assets import smollm2_gguf_path

        return models.from_pretrained(smollm2_gguf_path(), dtype="float32")
    raise ValueError(f"--models entry {name!r}: expected tiny or smollm2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llds_jax.models import save_pretrained

    results = {}
    for name in args.models.split(","):
        model = load_model(name)
        arrays = batch_arrays(model.config.vocab_size)
        tokens = int(arrays["attention_mask"].sum())
        params = sum(x.size for x in jax.tree.leaves(model))
        with tempfile.TemporaryDirectory() as hf_dir:
            save_pretrained(model, hf_dir)
            from llds_jax.rl.advantages import compute_advantages

            adv = np.asarray(compute_advantages(arrays["rewards"], arrays["group_ids"].astype(np.int32),
                                                np.ones(N, bool)))
            ours = bench_jax(model, arrays, args.steps)
            theirs = bench_torch(hf_dir, arrays, adv.astype(np.float32), args.steps)
        row = {"params": params, "tokens_per_step": tokens, "jax_update_s": ours["update_s"],
               "torch_update_s": theirs["update_s"], "jax_tokens_per_s": tokens / ours["update_s"],
               "torch_tokens_per_s": tokens / theirs["update_s"], "speedup": theirs["update_s"] / ours["update_s"],
               "jax_compile_and_first_s": ours["compile_and_first_s"]}
        results[name] = row
        print(f"{name:8s} params={params / 1e6:.1f}M  batch {N}×{T} ({tokens} tokens), {N // MINI} mini-batches × "
              f"{MINI // MICRO} micro | JAX {row['jax_tokens_per_s']:.0f} tok/s ({ours['update_s']:.2f}s) | "
              f"torch {row['torch_tokens_per_s']:.0f} tok/s ({theirs['update_s']:.2f}s) | "
              f"JAX/torch = {row['speedup']:.2f}×", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
