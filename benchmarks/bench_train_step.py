"""Update throughput of our jitted GRPO + LLDS step vs the same step in PyTorch (transformers model).

Both sides run the *same* step on the *same* weights and batch, fp32 on CPU:
sequential mini-batches (no shuffle), micro-batch gradient accumulation with mini-batch
denominators (token-mean), PPO-clip (ε 0.2) + k3 KL to a frozen reference (0.001) − entropy
bonus (0.001) + LLDS with the action gate (λ 0.1), global-norm clip 1.0, AdamW (lr 1e-6,
wd 0.01). π_old and π_ref log-probs are computed beforehand and excluded from the timing on
both sides: what is timed is the update phase, reported as tokens/s (every non-padding token
of the batch goes through forward + backward once per step). The two sides alternate (A, B, A, B
per step) after one untimed step each; refuses to run on a loaded machine unless
``--allow-noisy`` (benchmarks/_harness.py); ``--json`` prints one JSON object.

    python benchmarks/bench_train_step.py                      # tiny + SmolLM2-135M, 16×256 tokens
    python benchmarks/bench_train_step.py --models=tiny --steps=5
    python benchmarks/bench_train_step.py --packing-report --json   # packed vs padded (benchmarks/_packing_report.py)

The PyTorch side is a straightforward eager implementation (transformers ``LlamaForCausalLM``
built from the same config + safetensors export); it materialises [B, T, V] logits per
micro-batch, which at these sizes is the fast path for torch, and, like verl's actor, projects
every position. Ours scores each row's 80 action targets (``train.max_action_tokens_per_row``,
the trainer's default behaviour); ``--positions=all`` times it projecting every position too.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
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


ACTION_TOKENS = 80  # per row of ``batch_arrays``: two actions of 40


def jax_config(positions: str = "actions"):
    """The trainer config of this batch; ``positions="actions"`` scores each row's 80 action targets
    (the trainer's default for a rollout of 2 actions × 40 tokens), ``"all"`` every position."""
    from llds_jax.config import base_config

    c = base_config()
    c.train.max_action_tokens_per_row = ACTION_TOKENS if positions == "actions" else T
    c.mesh.shape = (1, 1, 1)
    c.train.update(dict(prompts_per_step=N // 4, mini_batch_size=MINI, micro_batch_size=MICRO,
                        logprob_batch_size=N, total_steps=1000))
    c.rollout.update(dict(n_samples=4, max_context=T, pad_to_multiple=T))
    c.optim.update(dict(warmup_ratio=0.0, lr_first_step_zero=False))
    c.model.logprob_chunk_size = 128
    return c


def jax_update_fn(model, arrays, positions: str = "actions"):
    """One call = the jitted update phase of ``Learner.update`` (advantages inside; π_old/π_ref computed once, outside)."""
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.batch import TrainBatch
    from llds_jax.train.learner import Learner

    learner = Learner.create(model, jax_config(positions), make_mesh((1, 1, 1)))
    batch = learner.upload(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    with jax.set_mesh(learner.mesh):
        old_logp = learner.fns.policy_logprobs(learner.state.params, *batch.logprob_inputs)
        ref_logp = None
        if learner.fns.reference_logprobs is not None:
            ref_logp = learner.fns.reference_logprobs(learner.state.ref_params, *batch.logprob_inputs)
        batch = jax.block_until_ready(batch._replace(old_logp=old_logp, ref_logp=ref_logp))

    def update():
        with jax.set_mesh(learner.mesh):
            learner.state, per_mini, outputs = learner.fns.update(learner.state, batch)  # donates the old state
            jax.block_until_ready((learner.state, per_mini, outputs))

    return update


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


def torch_update_fn(hf_dir, arrays, advantages):
    """One call = one PyTorch GRPO + LLDS update on the same batch (π_old = π_ref precomputed)."""
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
    return lambda: torch_step(model, old.clone(), old.clone(), arrays, advantages, optimizer)


def load_model(name: str):
    from llds_jax import models
    from llds_jax.models.testing import tiny_model

    if name == "tiny":
        return tiny_model("llama", vocab_size=4096, remat=jax_config().model.remat)
    if name == "smollm2":
        from llds_jax.utils.assets import smollm2_gguf_path

        # The trainer builds its model with the config's remat policy (models.loading); so does this.
        return models.from_pretrained(smollm2_gguf_path(), dtype="float32", remat=jax_config().model.remat)
    raise ValueError(f"--models entry {name!r}: expected tiny or smollm2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one untimed step)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--positions", choices=("actions", "all"), default="actions",
                        help="what our step scores: each row's action targets (the trainer's default) or every "
                             "position (as the PyTorch step, like verl, always does)")
    parser.add_argument("--packing-report", action="store_true",
                        help="decoder tokens computed ÷ real tokens, padded vs packed, for the paper config on the "
                             "reference lengths, and π_old + update CPU wall time packed vs padded on a mixed-length "
                             "batch of the default job's shapes (model: the first of --models)")
    _harness.add_arguments(parser)
    args = parser.parse_args()
    session = _harness.start("bench_train_step", args)
    if args.packing_report:
        packing_report(session, args)
        return
    torch.set_num_threads(args.threads)
    from llds_jax.models import save_pretrained
    from llds_jax.rl.advantages import compute_advantages

    for name in args.models.split(","):
        model = load_model(name)
        arrays = batch_arrays(model.config.vocab_size)
        tokens = int(arrays["attention_mask"].sum())
        params = sum(x.size for x in jax.tree.leaves(model))
        adv = np.asarray(compute_advantages(arrays["rewards"], arrays["group_ids"].astype(np.int32),
                                            np.ones(N, bool)))
        session.log(f"{name}: params={params / 1e6:.1f}M, batch {N}x{T} ({tokens} tokens) ...")
        with tempfile.TemporaryDirectory() as hf_dir:
            save_pretrained(model, hf_dir)
            theirs = torch_update_fn(hf_dir, arrays, adv.astype(np.float32))
        ours = jax_update_fn(model, arrays, args.positions)
        times = _harness.alternate({_harness.OURS: ours, "torch": theirs}, args.steps)
        scored = f"ours scores {ACTION_TOKENS if args.positions == 'actions' else T - 1} positions/row"
        session.add_case(f"{name} GRPO+LLDS update {N}x{T}, {N // MINI} mini-batches x {MINI // MICRO} micro, {scored}",
                         times, tokens=tokens, params=params)
    session.finish()


def packing_report(session, args) -> None:
    """``--packing-report``: one record whose top level holds ``computed_over_useful_padded`` / ``_packed``."""
    import json
    import sys

    import _packing_report as report

    from llds_jax.app.sweep import load_config_file
    from llds_jax.data.lengths import reference_lengths
    from llds_jax.train.batch import padded_length

    paper = load_config_file(str(_harness.REPO / "configs" / "qwen3b.py"))
    pieces = reference_lengths()
    shards = {"8xH100 (fsdp 8)": 8, "one device": 1, "v5e:8x8 (fsdp 64)": 64}
    ratios = {name: report.computed_over_useful(pieces, paper, n) for name, n in shards.items()}
    finest = paper.copy_and_resolve_references()  # micro-batches of one row per shard: the least rounding
    finest.train.micro_batch_tokens = padded_length(finest)
    ratios.update({f"{name}, one row per shard": report.computed_over_useful(pieces, finest, n)
                   for name, n in shards.items()})
    session.results["computed_over_useful"] = ratios
    # The width choice of configs/_paper.py: computed ÷ useful at 8 shards per rows per micro-batch.
    sweep = {}
    for rows in (8, 16, 24, 32, 48, 64):
        wide = paper.copy_and_resolve_references()
        wide.train.micro_batch_tokens = rows * padded_length(wide)
        sweep[rows] = report.computed_over_useful(pieces, wide, shards["8xH100 (fsdp 8)"])["packed"]
    session.results["rows_sweep"] = sweep
    name = args.models.split(",")[0]
    model = load_model(name)
    arrays = report.scaled_batch(pieces, 8, 512, model.config.vocab_size)
    tokens = int(arrays["attention_mask"].sum())
    packed, learner = report.step_fn(model, arrays, packing=True)
    padded, _ = report.step_fn(load_model(name), arrays, packing=False)
    session.log(f"{name}: 8 trajectories, {tokens} real tokens in rows of 512; packed rows "
                f"{learner.packing.rows} per micro-batch ...")
    times = _harness.alternate({_harness.OURS: packed, "padded": padded}, args.steps)
    session.add_case(f"{name} π_old + π_ref + update, 8 mixed-length trajectories (reference lengths × 512/4096), "
                     "packed (llds_jax) vs padded", times, tokens=tokens)
    record = session.record()
    headline = ratios["8xH100 (fsdp 8)"]
    record.update(computed_over_useful_padded=headline["padded"], computed_over_useful_packed=headline["packed"],
                  computed_over_useful_packed_passes=headline["packed_passes"],
                  rows_per_micro_batch=headline["rows_per_micro_batch"],
                  packed_speedup_vs_padded=times["padded"].median_s / times[_harness.OURS].median_s)
    if args.json:
        print(json.dumps(record))
    else:
        print(_harness.format_table(record))
        print(json.dumps({k: record[k] for k in ("computed_over_useful_padded", "computed_over_useful_packed",
                                                  "computed_over_useful_packed_passes", "packed_speedup_vs_padded")}),
              file=sys.stdout)


if __name__ == "__main__":
    main()
