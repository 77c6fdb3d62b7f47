"""``--mode=probe``: the paper's per-sample LLD measurement (Eq. 3, Fig. 3) on a run's checkpoints.

Why: the trainer's ``diag/lld_rate`` is a batch rate after a *joint* update of many groups
over several mini-batches; the paper's 0.5 threshold (Fig. 3) is per question, each with one
*isolated* GRPO update. This mode measures that quantity. For each chosen checkpoint of
``<workdir>/checkpoints``:

1. restore θ (params, Adam moments, step — so the run's lr schedule gives the run's lr);
2. sample ``rollout.n_samples`` responses for each of ``probe.questions`` training questions
   (the same questions, drawn with ``probe.seed``, at every checkpoint) and keep the mixed
   groups (some reward differs);
3. for each mixed group alone, from the same restored θ:

   * **optimizer probe** — one update through the trainer's own jitted step (the run's
     objective, optimizer state and lr, the group as the only mini-batch), then
     Δ(x) = mean over the correct (A > 0) responses of Σ_t (log π_θ′ − log π_θ) (Eq. 3),
     per action and in total;
   * **fresh-Adam probe** — the same update from zeroed Adam moments (the run's lr): its first
     step is ≈ lr·sign(g), the group's own direction, where the optimizer probe's restored
     first moment holds 90 % of the run's recent direction (β₁ = 0.9);
   * **SGD probe** — θ′ = θ − η g with g the on-policy GRPO gradient
     (−Σ A·∇log π / action tokens) and η chosen so the mean |Δ log p| over the group's
     action tokens is ``probe.sgd_mean_abs_dlogp``: the direction of the update, with its size
     fixed, so checkpoints compare without the optimizer's moments or the lr ramp;
   * CHES (Razin et al., arXiv 2410.08847, length-normalised): ⟨h̄⁺, h̄⁻⟩ − ‖h̄⁺‖², averaged
     over correct/incorrect pairs, with h̄ a response's mean final hidden state over the
     positions that predict its action tokens: high CHES = near-duplicate negatives, whose
     push-down drags the positives down;
   * the mean token log π_θ of the incorrect responses (low-likelihood negatives amplify the
     displacement, the paper's App. A).

4. with ``probe.gram=True``, the Gram probe (``lab/gram.py``): the first-order Δ(x) of each
   natural group from its responses' gradient Gram matrix (checked against the SGD probe's
   sign), then ``probe.gram_samples`` fresh responses per question and the k-stratified subset
   statistics (``probe.json["gram"]``; set ``probe.questions=64`` for issue 61's runs);
5. write ``<workdir>/probe/<step>/probe.json`` (the checkpoint directory itself carries an
   integrity manifest and is deleted by keep-N; the probe stays). ``lld_share`` is the share of
   mixed groups with Δ(x) < 0 under the optimizer probe; ``lld_share_sgd`` under the SGD probe.

    python -m llds_jax.main --mode=probe --config=configs/lab_spiral.py --config.workdir=RUN \\
        --config.probe.from_step=150

The command line must give the run's config (the same overrides): the probe rebuilds the
trainer's step for one group from it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from llds_jax.errors import InputError

DEFAULT_PROBE = dict(
    steps="",  # comma-separated checkpoint steps; "" = every checkpoint from from_step on
    from_step=0,
    questions=32,  # training questions sampled per checkpoint (mixed groups are the ones measured)
    seed=0,  # which questions and the sampling key (same at every checkpoint)
    sgd_mean_abs_dlogp=0.02,  # the SGD probe's step size, as mean |Δ log p| over the group's action tokens
    overwrite=False,  # redo checkpoints that already have a probe.json
    gram=False,  # the Gram probe (lab/gram.py): per-response gradients, k-stratified subsets
    gram_samples=16,  # responses drawn per question for the Gram probe's subsets
    gram_subsets=50,  # at most this many random 8-member subsets per question and stratum
)


def default_probe_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(DEFAULT_PROBE)


def probe_settings(config) -> dict:
    section = config.get("probe") if hasattr(config, "get") else None
    merged = {**DEFAULT_PROBE, **(section.to_dict() if section is not None else {})}
    if unknown := set(merged) - set(DEFAULT_PROBE):
        raise InputError(f"probe has unknown fields {sorted(unknown)}; known: {sorted(DEFAULT_PROBE)}")
    if not isinstance(merged["questions"], int) or merged["questions"] < 1:
        raise InputError(f"probe.questions={merged['questions']!r} must be a positive integer")
    if not merged["sgd_mean_abs_dlogp"] > 0:
        raise InputError(f"probe.sgd_mean_abs_dlogp={merged['sgd_mean_abs_dlogp']!r} must be > 0")
    if not isinstance(merged["gram_samples"], int) or merged["gram_samples"] < 8:
        raise InputError(f"probe.gram_samples={merged['gram_samples']!r} must be an integer ≥ 8 (8-member subsets)")
    if not isinstance(merged["gram_subsets"], int) or merged["gram_subsets"] < 1:
        raise InputError(f"probe.gram_subsets={merged['gram_subsets']!r} must be a positive integer")
    return merged


def group_config(config):
    """The run's config with one GRPO group per step and one mini-batch: the trainer's update, isolated."""
    c = ml_collections.ConfigDict(config.to_dict())
    g = int(config.rollout.n_samples)
    c.train.prompts_per_step = 1
    c.train.mini_batch_size = g
    c.train.micro_batch_size = g
    c.train.logprob_batch_size = g
    c.mesh.shape = (1, 1, 1)
    return c


# -- pure pieces (tested on hand-built arrays) -------------------------------------------------

def per_action_delta(new_logp, old_logp, action_mask, action_index, slots: int) -> np.ndarray:
    """[G, slots] Σ (log π_new − log π_old) over each action's tokens (token-aligned arrays)."""
    width = np.shape(action_mask)[1]
    mask = np.asarray(action_mask)[:, :width] > 0
    diff = np.where(mask, np.asarray(new_logp, np.float64)[:, :width] - np.asarray(old_logp, np.float64)[:, :width], 0.0)
    index = np.asarray(action_index)[:, :width]
    return np.stack([np.where(index == k, diff, 0.0).sum(axis=1) for k in range(slots)], axis=1)


def eq3_delta(delta_per_action: np.ndarray, action_tokens: np.ndarray, advantages: np.ndarray) -> dict:
    """Δ(x) of Eq. 3: mean over correct (A > 0) responses of their summed Δ; per action over the
    correct responses that took it (None where none did)."""
    correct = np.asarray(advantages) > 0
    total = float(delta_per_action[correct].sum(axis=1).mean())
    by_action = []
    for k in range(delta_per_action.shape[1]):
        took = correct & (np.asarray(action_tokens)[:, k] > 0)
        by_action.append(float(delta_per_action[took, k].mean()) if took.any() else None)
    return {"total": total, "by_action": by_action}


def ches(mean_hidden: np.ndarray, advantages: np.ndarray) -> float:
    """Length-normalised CHES of a group: mean over (correct i, incorrect j) of ⟨h̄_i, h̄_j⟩ − ‖h̄_i‖²."""
    h = np.asarray(mean_hidden, np.float64)
    pos, neg = h[np.asarray(advantages) > 0], h[np.asarray(advantages) < 0]
    return float((pos @ neg.T).mean() - (pos * pos).sum(axis=1).mean())


def summarise(groups: list[dict], slots: int) -> dict:
    """Probe-level numbers over the mixed groups: shares with Δ(x) < 0 and means."""
    def mean(values):
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    if not groups:
        return {"mixed_groups": 0, "lld_share": None, "lld_share_sgd": None}
    return {
        "mixed_groups": len(groups),
        "lld_share": float(np.mean([g["delta"]["total"] < 0 for g in groups])),
        "lld_share_sgd": float(np.mean([g["delta_sgd"]["total"] < 0 for g in groups])),
        "lld_share_fresh_adam": mean(g["delta_fresh_adam"]["total"] < 0 for g in groups if "delta_fresh_adam" in g),
        "delta_mean": mean(g["delta"]["total"] for g in groups),
        "delta_sgd_mean": mean(g["delta_sgd"]["total"] for g in groups),
        "delta_by_action": [mean(g["delta"]["by_action"][k] for g in groups) for k in range(slots)],
        "delta_sgd_by_action": [mean(g["delta_sgd"]["by_action"][k] for g in groups) for k in range(slots)],
        "lld_share_by_action": [mean((g["delta"]["by_action"][k] < 0) if g["delta"]["by_action"][k] is not None
                                     else None for g in groups) for k in range(slots)],
        "ches_mean": mean(g["ches"] for g in groups),
        "incorrect_logp_mean": mean(g["incorrect_logp"] for g in groups),
    }


# -- the model pieces (the decoder directly: differentiable, independent of the trainer's packing) --

class GroupModel:
    """Jitted token-aligned log π_θ, final hidden states and the on-policy GRPO gradient for one group."""

    def __init__(self, graphdef, temperature: float):
        def logp_and_hidden(params, ids, attn):
            model = nnx.merge(graphdef, params)
            hidden = model.hidden_states(ids, attn)
            logits = model.logits_from_hidden(hidden).astype(jnp.float32) / temperature
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            target = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            aligned = jnp.pad(target, ((0, 0), (1, 0)))  # token-aligned: position 0 holds 0
            return aligned, hidden.astype(jnp.float32)

        def pg_loss(params, ids, attn, mask, advantages):
            logp, _ = logp_and_hidden(params, ids, attn)
            return -(advantages[:, None] * mask * logp).sum() / jnp.maximum(mask.sum(), 1.0)

        self.logp_and_hidden = jax.jit(logp_and_hidden)
        self.grad = jax.jit(jax.grad(pg_loss))
        self.step = jax.jit(lambda params, g, eta: jax.tree.map(lambda p, d: p - eta * d.astype(p.dtype), params, g))


def sgd_probe(model: GroupModel, params, ids, attn, mask, advantages, target: float, iterations: int = 4):
    """(Δ log p [G, T] after θ − η g, η, achieved mean |Δ|) with η scaled until mean |Δ| ≈ target.

    Δ log p is nearly linear in η for small steps, so each iteration rescales η by target / achieved.
    """
    base, _ = model.logp_and_hidden(params, ids, attn)
    g = model.grad(params, ids, attn, mask, advantages)
    norm = float(np.sqrt(sum(float(jnp.sum(x.astype(jnp.float32) ** 2)) for x in jax.tree.leaves(g))))
    if not norm > 0:
        return np.zeros(np.shape(mask)), 0.0, 0.0
    on = np.asarray(mask) > 0
    eta, achieved, delta = 1e-3 / norm, 0.0, None
    for _ in range(iterations):
        new, _ = model.logp_and_hidden(model.step(params, g, eta), ids, attn)
        delta = np.asarray(new, np.float64) - np.asarray(base, np.float64)
        achieved = float(np.abs(delta[on]).mean())
        if not achieved > 0:
            break
        if abs(achieved / target - 1.0) < 0.05:
            break
        eta *= target / achieved
    return np.where(on, delta, 0.0), float(eta), achieved


def mean_action_hidden(hidden, action_mask) -> np.ndarray:
    """[G, D] mean final hidden state over the positions that predict each response's action tokens."""
    h = np.asarray(hidden, np.float64)[:, :-1]  # position t predicts token t + 1
    m = np.asarray(action_mask, np.float64)[:, 1:h.shape[1] + 1]
    return (h * m[..., None]).sum(axis=1) / np.maximum(m.sum(axis=1, keepdims=True), 1.0)


# -- one checkpoint ------------------------------------------------------------------------------

def _copy_state(state):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def probe_checkpoint(learner, saved_state, tokenizer, retriever, records, config, settings: dict,
                     group_model: GroupModel, reward_fn=None, response_grads=None) -> dict:
    """Every mixed group of one sampling at ``saved_state``, each probed alone (see the module docstring).

    ``reward_fn(answers, golden)`` scores the samples (default: the trainer's EM, ``loop.em_rewards``);
    ``response_grads`` (a ``lab.gram.ResponseGrads``) turns the Gram probe on.
    """
    from llds_jax.rollout.multi_turn import run_rollouts
    from llds_jax.train.batch import TrainBatch
    from llds_jax.train.loop import em_rewards
    from llds_jax.train.state import learning_rate

    slots = int(config.rollout.max_turns) + 1
    fresh_state = saved_state.replace(opt_state=jax.tree.map(jnp.zeros_like, saved_state.opt_state))

    def sample(rollout_config, salt):
        learner.state = _copy_state(saved_state)
        key = jax.random.fold_in(jax.random.key(settings["seed"]), salt)
        rollout = run_rollouts(learner.sampler_policy(), tokenizer, [r.question for r in records], retriever,
                               rollout_config, key=key, group_ids=list(range(len(records))))
        golden = [records[g].golden_answers for g in rollout.group_ids]
        rewards = np.asarray((reward_fn or em_rewards)(rollout.answers, golden), np.float32)
        return rollout, rewards, TrainBatch.from_rollout(rollout, rewards, length=learner.seq_len,
                                                         ma_search_count=config.rl.ma_search_count)

    rollout, rewards, host = sample(config.rollout, 7919)
    groups = []
    for g in range(len(records)):
        rows = np.flatnonzero(np.asarray(rollout.group_ids) == g)
        if np.ptp(rewards[rows]) == 0:
            continue
        sub = TrainBatch(*[None if x is None else np.asarray(x)[rows] for x in host])
        learner.state = _copy_state(fresh_state)
        _, fresh = learner.update(sub)
        fresh_logp = learner.logprobs_now(fresh["batch"])
        learner.state = _copy_state(saved_state)
        metrics, extra = learner.update(sub)
        new_logp = learner.logprobs_now(extra["batch"])
        advantages = np.asarray(extra["advantages"], np.float64)
        mask = np.asarray(sub.action_mask)
        tokens = per_action_delta(np.ones_like(mask), np.zeros_like(mask), mask, sub.action_index, slots)
        delta = per_action_delta(new_logp, extra["old_logp"], mask, sub.action_index, slots)
        ids, attn = jnp.asarray(sub.input_ids), jnp.asarray(sub.attention_mask)
        params = saved_state.params
        sgd_delta, eta, achieved = sgd_probe(group_model, params, ids, attn, jnp.asarray(mask),
                                             jnp.asarray(advantages, jnp.float32), settings["sgd_mean_abs_dlogp"])
        sgd = per_action_delta(sgd_delta, np.zeros_like(sgd_delta), mask, sub.action_index, slots)
        old_logp, hidden = group_model.logp_and_hidden(params, ids, attn)
        old_logp = np.asarray(old_logp, np.float64)
        incorrect = advantages < 0
        per_row_logp = (np.where(mask > 0, old_logp, 0.0).sum(axis=1) / np.maximum(mask.sum(axis=1), 1))
        fresh_delta = per_action_delta(fresh_logp, fresh["old_logp"], mask, sub.action_index, slots)
        first_order = None
        if response_grads is not None:
            from llds_jax.lab.gram import first_order_delta, gram_matrices

            grads = response_grads(params, sub.input_ids, sub.attention_mask, mask, sub.action_index)
            first_order = first_order_delta(gram_matrices(grads)[1], advantages)
        groups.append({
            "group": int(g), "question": records[g].question, "rewards": rewards[rows].tolist(),
            "delta": eq3_delta(delta, tokens, advantages),
            "delta_fresh_adam": eq3_delta(fresh_delta, tokens, advantages),
            "delta_first_order": first_order,
            "delta_sgd": eq3_delta(sgd, tokens, advantages),
            "sgd_eta": eta, "sgd_mean_abs_dlogp": achieved,
            "ches": ches(mean_action_hidden(hidden, mask), advantages),
            "incorrect_logp": float(per_row_logp[incorrect].mean()),
            "grad_norm": metrics.get("grad/norm_preclip"),
            "first_actions_identical": len({tuple(np.asarray(sub.input_ids)[r][(np.asarray(sub.action_index)[r] == 0)
                                                                            & (mask[r] > 0)].tolist())
                                            for r in range(len(rows))}) == 1,
        })
    lr = float(learning_rate(saved_state.step, config.optim, config.train.total_steps))
    out = {"questions": len(records), "reward_mean": float(rewards.mean()), "lr": lr,
           **summarise(groups, slots), "groups": groups}
    if response_grads is not None:
        out["gram"] = gram_probe(sample, config, settings, response_grads, saved_state.params, groups)
    return out


def gram_probe(sample, config, settings: dict, response_grads, params, groups: list[dict]) -> dict:
    """``probe.json["gram"]``: first-order validation on the natural groups, then the k-stratified
    subsets of ``gram_samples`` fresh responses per question (``lab/gram.py``)."""
    from llds_jax.lab.gram import question_strata, sign_agreement

    rollout_config = ml_collections.ConfigDict(config.rollout.to_dict())
    rollout_config.n_samples = int(settings["gram_samples"])
    rollout, rewards, host = sample(rollout_config, 104729)
    rng = np.random.default_rng(settings["seed"])
    strata: dict[str, list[dict]] = {}
    for question in sorted(set(rollout.group_ids)):
        rows = np.flatnonzero(np.asarray(rollout.group_ids) == question)
        grads = response_grads(params, *(np.asarray(x)[rows] for x in
                                         (host.input_ids, host.attention_mask, host.action_mask, host.action_index)))
        for k, records in question_strata(grads, rewards[rows], question, rng, settings["gram_subsets"]).items():
            strata.setdefault(str(k), []).extend(records)
    validation = sign_agreement([g["delta_first_order"] for g in groups], [g["delta_sgd"]["total"] for g in groups])
    return {"samples": int(settings["gram_samples"]), "validation": validation, "strata": strata,
            "questions_by_stratum": {k: len({r["question"] for r in v}) for k, v in strata.items()}}


def probe_main(config) -> list[Path]:
    """Entry point of ``--mode=probe``; returns the ``probe.json`` paths written."""
    from llds_jax.app.run import load_policy_and_retriever
    from llds_jax.data.prompts import load_questions
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.checkpoint import Checkpointer, abstract_like
    from llds_jax.train.learner import Learner

    settings = probe_settings(config)
    workdir = Path(config.workdir)
    if not (workdir / "checkpoints").is_dir():
        raise InputError(f"{workdir}/checkpoints does not exist: --config.workdir must name a run with checkpoints")
    probe_cfg = group_config(config)
    # Read-only use, but Orbax's manager cleans temporary save directories when it opens:
    # probe a run after it has finished (or between its saves), not while it is writing one.
    ckpt = Checkpointer(workdir.resolve(), keep=10_000, async_save=False)
    available = ckpt.all_steps()
    wanted = ([int(s) for s in str(settings["steps"]).split(",") if s.strip()] if settings["steps"]
              else [s for s in available if s >= settings["from_step"]])
    if missing := sorted(set(wanted) - set(available)):
        raise InputError(f"probe.steps {missing} have no checkpoint in {workdir}/checkpoints (has {available})")
    mesh = make_mesh((1, 1, 1))
    model, tokenizer, retriever = load_policy_and_retriever(probe_cfg, mesh)
    learner = Learner.create(model, probe_cfg, mesh)
    group_model = GroupModel(learner.graphdef, float(config.rollout.temperature))
    response_grads = None
    if settings["gram"]:
        from llds_jax.lab.gram import ResponseGrads

        response_grads = ResponseGrads(learner.graphdef, float(config.rollout.temperature),
                                       int(config.rollout.max_turns) + 1)
    records = load_questions(config.data.train)
    pick = np.random.default_rng(settings["seed"]).choice(len(records), size=min(settings["questions"], len(records)),
                                                          replace=False)
    records = [records[i] for i in sorted(pick)]
    written = []
    for step in wanted:
        out = workdir / "probe" / str(step) / "probe.json"
        if out.exists() and not settings["overwrite"]:
            print(f"probe: step {step} already has {out}; skipped (probe.overwrite=True redoes it)")
            continue
        clock = time.perf_counter()
        saved = ckpt.restore(step, abstract_like(learner.state)).state
        result = {"step": step, "checkpoint": str(ckpt.step_dir(step)), "settings": settings,
                  **probe_checkpoint(learner, saved, tokenizer, retriever, records, probe_cfg, settings, group_model,
                                     response_grads=response_grads)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        written.append(out)
        print(f"probe: step {step}: {result['mixed_groups']} mixed groups, lld_share {result['lld_share']}, "
              f"lld_share_sgd {result['lld_share_sgd']}, Δ mean {result.get('delta_mean')}, "
              f"CHES {result.get('ches_mean')} ({time.perf_counter() - clock:.0f}s) → {out}", flush=True)
    ckpt.close()
    return written
