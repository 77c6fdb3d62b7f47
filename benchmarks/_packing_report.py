"""``bench_train_step.py --packing-report``: what packing saves the training passes (``train.packing``).

Two numbers per question:

* **Computed over useful tokens** for the paper config (``configs/qwen3b.py`` shapes: 2,560
  trajectories per step, mini-batches of 256, rows of ``rollout.max_context`` = 4,096) on the
  lengths of Search-R1's released 3B policy (``data.lengths.reference_lengths``: the bundled copy of
  ``../shared/data/searchr1/reference_rollout_lengths.jsonl``, the same 3,250 trajectories in its order;
  length = first prompt + actions + feedback, action targets = action tokens). "Computed" is what
  the decoder stack runs per training pass: padded, every trajectory × 4,096; packed, every row of every
  used micro-batch (``train.packing.computed_tokens``), which depends on the data-parallel shards
  a micro-batch's rows split over (one row per shard at ``train.micro_batch_tokens = 0``): the
  update's ("packed", each mini-batch in whole micro-batches) and a no-grad pass's ("packed_passes",
  the same rows as one group: π_old, π_ref and Δ).
  The first 2,560 reference trajectories, in file order, make the step.
* **CPU wall time** of π_old + the update on a mixed-length batch: the default job's shapes
  (``configs/cpu_smoke.py``: 8 trajectories, mini-batches of 4, micro-batches of 2, rows of 512)
  with reference lengths scaled by 512 / 4,096 (every piece of a trajectory), packed vs padded,
  alternating A, B, A, B (``_harness.alternate``).
"""

from __future__ import annotations

import jax
import numpy as np

from llds_jax.data.lengths import TrajectoryLengths


def computed_over_useful(pieces: list[TrajectoryLengths], config, shards: int) -> dict:
    """Padded and packed decoder tokens ÷ real tokens for one step of ``config`` on ``pieces``."""
    from llds_jax.train.batch import padded_length, scored_positions_per_row  # noqa: PLC0415
    from llds_jax.train.packing import computed_tokens, one_group, packing_sizes, plan_rows  # noqa: PLC0415

    n = int(config.train.prompts_per_step) * int(config.rollout.n_samples)
    if len(pieces) < n:
        raise ValueError(f"{len(pieces)} reference trajectories, the step needs {n}")
    step = pieces[:n]
    lengths = np.array([p.total for p in step])
    actions = np.array([p.decode_tokens for p in step])
    width = padded_length(config)
    sizes = packing_sizes(config, width, scored_positions_per_row(config, width), shards)
    plan = plan_rows(np.minimum(lengths, width), actions, sizes)
    useful = int(lengths.sum())
    return {"padded": n * width / useful, "packed": computed_tokens(plan, sizes) / useful,
            "packed_passes": computed_tokens(one_group(plan, sizes), sizes.whole_batch()) / useful,
            "rows": int(plan.rows_per_mini.sum()), "row_fill": useful / (int(plan.rows_per_mini.sum()) * width),
            "rows_per_micro_batch": sizes.rows, "micro_batches": int(plan.slots_per_mini.sum()),
            "trajectories": n, "mean_length": float(lengths.mean()), "max_length": int(lengths.max())}


def scaled_batch(pieces: list[TrajectoryLengths], n: int, context: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout-shaped batch of ``n`` reference trajectories drawn at random, every piece scaled by
    ``context`` / 4,096 (at least one token each): prompt, action, feedback, …, action."""
    rng = np.random.default_rng(seed)
    scale = context / 4096
    ids = rng.integers(3, vocab, (n, context)).astype(np.int32)
    attention = np.zeros((n, context), bool)
    action = np.zeros((n, context), np.float32)
    action_index = np.full((n, context), -1, np.int32)
    answer = np.zeros((n, context), np.float32)
    for j, k in enumerate(rng.choice(len(pieces), n, replace=False)):
        p = pieces[k]
        at = max(1, round(p.prompt * scale))
        for a, act in enumerate(p.actions):
            size = max(1, round(act * scale))
            action[j, at:at + size], action_index[j, at:at + size] = 1, a
            at += size
            if a < len(p.feedback):
                at += max(1, round(p.feedback[a] * scale))
        answer[j, max(0, at - 3):at] = action[j, max(0, at - 3):at]
        attention[j, :at] = True
    ids[~attention] = 0
    return dict(input_ids=ids, attention_mask=attention, action_mask=action, action_index=action_index,
                answer_mask=answer, num_searches=np.ones(n, np.float32), rewards=(rng.random(n) < 0.5).astype(np.float32),
                group_ids=np.repeat(np.arange(n // 4), 4))


def smoke_config(packing: bool):
    """The default job's trainer shapes (configs/cpu_smoke.py), on one device, fp32."""
    from llds_jax.config import base_config  # noqa: PLC0415

    c = base_config()
    c.mesh.shape = (1, 1, 1)
    c.model.logprob_chunk_size = 144
    c.rollout.update(dict(max_turns=2, max_action_tokens=48, n_samples=4, max_context=512))
    c.train.update(dict(prompts_per_step=2, mini_batch_size=4, micro_batch_size=2, logprob_batch_size=2,
                        total_steps=1000, packing=packing))
    c.optim.update(dict(warmup_ratio=0.0, lr_first_step_zero=False))
    return c


def step_fn(model, arrays, packing: bool):
    """One call = π_old, π_ref and the update of ``Learner.update`` on the uploaded batch (no host work timed)."""
    from llds_jax.parallel.mesh import make_mesh  # noqa: PLC0415
    from llds_jax.train.batch import TrainBatch  # noqa: PLC0415
    from llds_jax.train.learner import Learner  # noqa: PLC0415

    learner = Learner.create(model, smoke_config(packing), make_mesh((1, 1, 1)))
    batch = learner.upload(TrainBatch.from_arrays(arrays, length=learner.seq_len))

    def run():
        with jax.set_mesh(learner.mesh):
            old = learner.fns.policy_logprobs(learner.state.params, *batch.logprob_inputs)
            ref = learner.fns.reference_logprobs(learner.state.ref_params, *batch.logprob_inputs)
            learner.state, per_mini, outputs = learner.fns.update(learner.state,
                                                                  batch._replace(old_logp=old, ref_logp=ref))
            jax.block_until_ready((learner.state, per_mini, outputs))

    return run, learner
