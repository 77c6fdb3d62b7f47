"""Every key the trainer writes to ``metrics.jsonl``, as one table: the metrics vocabulary.

Each metric has exactly one name, and it is the name the code that computes it gives it:
the objective and the update step (``rl/objective.py``, ``rl/metrics.py``, ``train/step.py``)
emit their per-mini-batch values under the names logged here, the rollout batch its
``RolloutBatch.stats()`` names, ``diagnostics.step_metrics`` its ``diag/*`` names. The
learner, the loop, the console line, the monitor and the report look keys up here; a test
(``tests/train/test_train_loop.py``) runs a real tiny training job and checks that every
logged key is in :data:`TABLE` and every entry of :data:`TABLE` is logged.

Columns of a :class:`Metric`:

- ``name``: the key; ``{k}`` stands for an action index (0 … ``rollout.max_turns``),
  ``{benchmark}`` for an eval data source (or ``average``).
- ``unit`` and ``meaning``.
- ``phases``: ``rl`` (one row per RL step), ``sft`` (format warm-up), ``eval`` (end of run).
- ``hosts``: how ``train.loop.combine_over_hosts`` merges the per-process values of a
  multi-host step: ``mean`` (per-row means over equal row counts; exact), ``sum`` (counts),
  ``max``/``min`` (extrema; ``time/*`` waits for the slowest host), ``global`` (computed on
  the device mesh or already summed over hosts: equal everywhere).
- ``mini_batches``: for the update's metrics, how the step value comes from the
  per-mini-batch array the jitted update returns (``mean``, ``max``, ``min``, ``sum``,
  ``first`` = mini-batch 1, where θ = θ_old, ``last``, ``count``); ``from_update`` names
  that array when the step value is a second reduction of another metric's array.
- ``when``: the condition under which the key appears (empty: every row of its phase).

A value with no samples in a step (e.g. no correct response) is written as ``null``.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    meaning: str
    phases: tuple[str, ...] = ("rl",)
    hosts: str = "mean"
    mini_batches: str | None = None
    from_update: str | None = None
    when: str = ""

    def matches(self, key: str) -> bool:
        return _pattern(self.name).fullmatch(key) is not None


def _pattern(name: str) -> re.Pattern:
    escaped = re.escape(name).replace(r"\{k\}", r"\d+").replace(r"\{benchmark\}", r"[^/]+")
    return re.compile(escaped)


# Keys the code refers to by name.
REWARD_MEAN = "reward/mean"
LOSS_TOTAL = "loss/total"
LLDS_VALUE = "llds/value"
LLDS_LAMBDA = "llds/lambda"
GRAD_NORM = "grad/norm_preclip"
GRAD_NORM_PER_ACTIVE_ROW = "grad/norm_per_active_row"
POLICY_ENTROPY = "policy/entropy"
UPDATE_SKIPPED = "update/skipped"
OPTIM_LR = "optim/lr"
SEARCHES = "rollout/searches"
VALID_ACTION_RATE = "rollout/valid_action_rate"
LL_CORRECT = "diag/ll_correct/all"
LL_INCORRECT = "diag/ll_incorrect/all"
LLD_RATE = "diag/lld_rate"
LOGODDS_CORRECT_FIRST = "diag/logodds_correct/action0"
LL_OFFICIAL_POS = "diag/ll_official_pos"
IDENTICAL_FIRST_ACTION_FRAC = "diag/identical_first_action_frac"
FIRST_ACTION_CORRECT_RATE = "diag/first_action_correct_rate"
MONITOR_PHASE = "monitor/phase"
STEP_SECONDS = "time/step_s"

_DELTA_WHEN = "train.delta_diagnostics, on steps divisible by train.delta_every (one extra no-grad forward after the updates)"
_MONITOR_WHEN = "monitor.enabled"

TABLE: tuple[Metric, ...] = (
    # -- reward (loop.em_rewards) ----------------------------------------------------------------
    Metric(REWARD_MEAN, "EM", "mean exact-match reward of the step's trajectories (every draw under dynamic sampling)"),
    Metric("reward/max", "EM", "best reward of the step", hosts="max"),
    Metric("reward/group_solved_frac", "fraction", "prompts with at least one rewarded trajectory"),
    # -- rollout behaviour (RolloutBatch.stats(), per-trajectory means) ------------------------
    Metric("rollout/turns", "actions/trajectory", "actions taken (searches, answers, invalid)"),
    Metric(SEARCHES, "searches/trajectory", "valid searches executed"),
    Metric("rollout/search_actions_written", "searches/trajectory",
           "search actions written, valid or not (the count adaptive LLDS-MA reads by default)"),
    Metric(VALID_ACTION_RATE, "fraction", "valid actions / actions taken (over the host's batch)"),
    Metric("rollout/finished", "fraction", "trajectories that ended with an <answer>"),
    Metric("rollout/truncated", "fraction", "trajectories cut by max_turns or the context limit"),
    Metric("rollout/response_tokens", "tokens/trajectory", "response tokens including feedback"),
    Metric("rollout/action_tokens", "tokens/trajectory", "tokens the model wrote (loss-mask 1)"),
    # -- advantages and the sampler/trainer log-prob agreement (learner) -----------------------
    Metric("advantage/abs_mean", "advantage", "mean |A| of this host's rows"),
    Metric("advantage/nonzero_frac", "fraction", "rows with A ≠ 0 (groups that are not all-equal)"),
    Metric("logprob_gap/abs_mean", "nats/token", "mean |sampler log-prob − trainer π_old| on action tokens"),
    Metric("logprob_gap/abs_max", "nats/token", "max of the same", hosts="max"),
    Metric("logprob_gap/corr", "Pearson r", "correlation of sampler and trainer log-probs on action tokens"),
    # -- rollout correction (rl.rollout_correction; host-side, logged even when it is "none") ----
    Metric("rollout_corr/capped_frac", "fraction", "action tokens whose π_old/π_sampler weight (token or sequence "
           "level per rl.rollout_correction; token TIS when none) exceeds rl.rollout_correction_cap"),
    Metric("rollout_corr/masked_frac", "fraction", "action tokens masked IS removes from the loss (0 unless mis)"),
    Metric("rollout_corr/weight_mean", "weight", "mean weight on the pg term over action tokens (0 where masked; "
           "what token TIS would apply when none)"),
    # -- dynamic sampling (train.dynamic_sampling; logged when off too: one draw, uniform groups "filled") --
    Metric("dynamic/draws", "batches", "prompt batches rolled out this step (≤ train.dynamic_sampling_max_draws)",
           hosts="max"),
    Metric("dynamic/prompts_drawn", "groups", "groups rolled out this step over all draws", hosts="sum"),
    Metric("dynamic/mixed_groups_drawn", "groups", "of those, groups whose rewards are not all equal", hosts="sum"),
    Metric("dynamic/mixed_frac", "fraction", "mixed groups / groups drawn"),
    Metric("dynamic/groups_kept", "groups", "mixed groups in the trained batch", hosts="sum"),
    Metric("dynamic/filled_groups", "groups", "uniform (zero-advantage) groups in the trained batch: the cap was hit "
           "(dynamic sampling) or plain GRPO's", hosts="sum"),
    Metric("reward/trained_mean", "EM", "mean reward of the trained batch (reward/mean: of every trajectory drawn)"),
    # -- the update (per-mini-batch outputs of train.step, reduced by the learner) -------------
    Metric(LOSS_TOTAL, "loss", "pg + kl_coef·kl − entropy_coef·entropy + λ·llds", hosts="global",
           mini_batches="mean"),
    Metric("loss/pg", "loss", "clipped policy-gradient surrogate (rl.aggregation)", hosts="global",
           mini_batches="mean"),
    Metric("kl/mean", "nats/token", "KL(π_θ‖π_ref) estimate (rl.kl_estimator), token mean", hosts="global",
           mini_batches="mean"),
    Metric("kl/old_k3", "nats/token", "k3 KL of π_θ to π_old: how far the updates moved", hosts="global",
           mini_batches="mean"),
    Metric(POLICY_ENTROPY, "nats/token", "token entropy of π_old over action tokens", hosts="global",
           mini_batches="first"),
    Metric("ratio/mean", "ratio", "importance ratio π_θ/π_old, action-token mean", hosts="global",
           mini_batches="mean"),
    Metric("ratio/max", "ratio", "largest ratio over the step", hosts="global", mini_batches="max"),
    Metric("ratio/min", "ratio", "smallest ratio over the step", hosts="global", mini_batches="min"),
    Metric("ratio/clip_frac", "fraction", "action tokens whose ratio is clipped (either side)", hosts="global",
           mini_batches="mean"),
    Metric("ratio/clip_frac_high", "fraction", "… clipped at 1 + clip_high", hosts="global", mini_batches="mean"),
    Metric("ratio/clip_frac_low", "fraction", "… clipped at 1 − clip_low", hosts="global", mini_batches="mean"),
    Metric(LLDS_VALUE, "nats", "LLDS penalty before λ (rl.llds_* denominator)", hosts="global",
           mini_batches="mean"),
    Metric("llds/value_last_minibatch", "nats", "LLDS penalty of the last mini-batch (mini-batch 1's is 0: "
           "θ = θ_old there)", hosts="global", mini_batches="last", from_update=LLDS_VALUE),
    Metric("llds/loss", "loss", "λ · LLDS penalty, as added to the loss", hosts="global", mini_batches="mean"),
    Metric(LLDS_LAMBDA, "λ", "LLDS coefficient in force (train state; the monitor may raise it)",
           hosts="global", mini_batches="first"),
    Metric("llds/gate_frac_tokens", "fraction", "preserved (A ≥ 0) action tokens whose gate is on",
           hosts="global", mini_batches="mean"),
    Metric("llds/gate_frac_actions", "fraction", "preserved actions whose gate is on", hosts="global",
           mini_batches="mean"),
    Metric("llds/gate_frac_responses", "fraction", "preserved responses with any gated action", hosts="global",
           mini_batches="mean"),
    Metric("llds/preserved_response_frac", "fraction", "responses in the preserved set (A ≥ 0)",
           hosts="global", mini_batches="mean"),
    Metric("logp_old/pos_mean", "nats/token", "π_old log-prob of A > 0 action tokens (token mean)",
           hosts="global", mini_batches="mean"),
    Metric("logp_old/neg_mean", "nats/token", "π_old log-prob of A < 0 action tokens (token mean)",
           hosts="global", mini_batches="mean"),
    Metric("delta_logp/pos_mean", "nats/token", "log π_θ − log π_old on A > 0 tokens, before each update",
           hosts="global", mini_batches="mean"),
    Metric("delta_logp/neg_mean", "nats/token", "the same on A < 0 tokens", hosts="global", mini_batches="mean"),
    Metric("delta_logp/abs_max", "nats", "max |log π_θ − log π_old| on action tokens over the step",
           hosts="global", mini_batches="max"),
    Metric("old_logp/recompute_gap", "nats", "the same in mini-batch 1: π_old vs the loss forward at θ_old "
           "(fp noise only)", hosts="global", mini_batches="first", from_update="delta_logp/abs_max"),
    Metric(GRAD_NORM, "global norm", "gradient norm before clipping (mean over mini-batches)",
           phases=("rl", "sft"), hosts="global", mini_batches="mean"),
    Metric("grad/norm_preclip_max", "global norm", "largest pre-clip gradient norm of the step", hosts="global",
           mini_batches="max", from_update=GRAD_NORM),
    Metric(GRAD_NORM_PER_ACTIVE_ROW, "global norm", "grad/norm_preclip / advantage/nonzero_frac: the token-mean "
           "norm undiluted by zero-advantage rows (null when no row has A ≠ 0)"),
    Metric("grad/clip_scale", "factor", "min(1, clip_norm / norm) applied to the gradient", hosts="global",
           mini_batches="mean"),
    Metric(OPTIM_LR, "lr", "learning rate of the step", phases=("rl", "sft"), hosts="global",
           mini_batches="first"),
    Metric(UPDATE_SKIPPED, "updates", "non-finite updates skipped (params and optimizer state kept)",
           phases=("rl", "sft"), hosts="global", mini_batches="sum"),
    Metric("update/mini_batches", "updates", "optimizer updates in the step", hosts="global",
           mini_batches="count", from_update=UPDATE_SKIPPED),
    # -- death-spiral diagnostics (diagnostics.step_metrics; A > 0 correct, A < 0 incorrect) ---
    Metric("diag/frac_correct", "fraction", "responses with A > 0"),
    Metric("diag/frac_incorrect", "fraction", "responses with A < 0"),
    Metric("diag/num_correct", "responses", "responses with A > 0", hosts="sum"),
    Metric("diag/num_incorrect", "responses", "responses with A < 0", hosts="sum"),
    Metric("diag/ll_correct/action{k}", "nats/token", "π_old likelihood of correct responses' action k"),
    Metric("diag/ll_correct/later", "nats/token", "… of their actions ≥ 1, pooled per response"),
    Metric(LL_CORRECT, "nats/token", "… of all their action tokens (the monitor's likelihood)"),
    Metric("diag/ll_incorrect/action{k}", "nats/token", "the same for incorrect responses"),
    Metric("diag/ll_incorrect/later", "nats/token", "the same for incorrect responses"),
    Metric(LL_INCORRECT, "nats/token", "the same for incorrect responses"),
    Metric("diag/logodds_correct/action{k}", "log-odds/token", "token mean of log p − log(1−p) (each clipped to "
           "±15) under π_old, correct responses' action k: falls linearly where log p saturates"),
    Metric("diag/logodds_incorrect/action{k}", "log-odds/token", "the same for incorrect responses"),
    Metric(LL_OFFICIAL_POS, "nats/token", "Σ log π_old over A ≥ 0 responses' action tokens / all action tokens "
           "(the official code's pos_avg_old_log_prob)"),
    Metric(IDENTICAL_FIRST_ACTION_FRAC, "fraction", "mixed groups (A > 0 and A < 0 members) whose first actions "
           "are token-identical (no net on-policy gradient on them)"),
    Metric(LLD_RATE, "fraction", "correct responses with Δ = Σ(log π_new − log π_old) ≤ 0 after the updates",
           when=_DELTA_WHEN),
    Metric("diag/lld_rate/action{k}", "fraction", "the same per action k", when=_DELTA_WHEN),
    Metric("diag/delta_correct/action{k}", "nats/action", "mean Δ of correct responses' action k",
           when=_DELTA_WHEN),
    Metric("diag/delta_correct/all", "nats/response", "mean Δ of correct responses", when=_DELTA_WHEN),
    Metric("diag/delta_incorrect/all", "nats/response", "mean Δ of incorrect responses", when=_DELTA_WHEN),
    Metric(FIRST_ACTION_CORRECT_RATE, "fraction", "incorrect responses whose first search found what a "
           "correct response of the group found (paper §5.3)"),
    Metric("diag/first_action_correct/eligible", "responses", "incorrect responses in groups with a correct "
           "one (the rate's denominator)", hosts="sum"),
    # -- death-spiral monitor (diagnostics.monitor) ---------------------------------------------
    Metric(MONITOR_PHASE, "phase", "1 stagnation, 2 steady decay, 3 acceleration", hosts="global",
           when=_MONITOR_WHEN),
    Metric("monitor/ll_slope", "nats/token/step", "least-squares slope of the likelihood over the window",
           hosts="global", when=_MONITOR_WHEN),
    Metric("monitor/ll_t_stat", "t", "that slope over its standard error", hosts="global", when=_MONITOR_WHEN),
    Metric("monitor/grad_surge_ratio", "ratio", "recent / baseline median gradient norm", hosts="global",
           when=_MONITOR_WHEN),
    Metric("monitor/entropy_surge_ratio", "ratio", "recent / baseline median entropy", hosts="global",
           when=_MONITOR_WHEN),
    # -- time and throughput -------------------------------------------------------------------
    Metric("time/rollout_s", "s", "the whole rollout", hosts="max"),
    Metric("time/retrieval_s", "s", "waiting for the retriever", hosts="max"),
    Metric("time/decode_s", "s", "token decoding", hosts="max"),
    Metric("time/prefill_s", "s", "prompt prefill and feedback appends", hosts="max"),
    Metric("time/logprobs_s", "s", "π_old and π_ref forwards", hosts="max"),
    Metric("time/update_s", "s", "the sequential mini-batch updates", hosts="max"),
    Metric("time/delta_logprobs_s", "s", "the π_new forward for Δ", hosts="max", when=_DELTA_WHEN),
    Metric("throughput/delta_responses_frac", "fraction", "responses the Δ forward computed: packed rows, those "
           "with A ≠ 0 (the only ones a Δ diagnostic reads); padded rows, all", hosts="global", when=_DELTA_WHEN),
    Metric(STEP_SECONDS, "s", "the whole step", phases=("rl", "sft"), hosts="max"),
    Metric("throughput/rollout_tokens_per_s", "tokens/s", "action tokens sampled per rollout second",
           hosts="sum"),
    Metric("throughput/update_tokens_per_s", "tokens/s", "all tokens of the batch per update second",
           hosts="global"),
    Metric("throughput/action_tokens_per_s", "tokens/s", "action tokens of the batch per update second",
           hosts="global"),
    Metric("throughput/update_mfu", "fraction", "model FLOPs of the update (3 × forward over the batch's computed "
           "rows × length, LM head on scored positions; utils.flops) / update seconds / (peak × mesh devices)",
           hosts="global"),
    Metric("throughput/logprobs_mfu", "fraction", "model FLOPs of the π_old (+ π_ref) forwards / their seconds / "
           "(peak × mesh devices)", hosts="global"),
    Metric("throughput/logprobs_tokens_per_s", "tokens/s", "computed tokens of the π_old (+ π_ref) forwards per second",
           hosts="global"),
    Metric("throughput/decode_mbu", "fraction", "bytes the decode must read (weights once per decode step, each "
           "row's live KV entries) / decode seconds / (HBM bandwidth × sampler devices)", hosts="mean"),
    Metric("throughput/decode_tokens_per_s", "tokens/s", "tokens sampled per decode second", hosts="sum"),
    Metric("memory/device_peak_bytes", "bytes", "the largest peak_bytes_in_use of this process's devices so far "
           "(XLA:CPU reports none: the process's peak resident set)", hosts="max"),
    Metric("data/epoch", "epochs", "passes over the training questions so far"),
    # -- format warm-up (train.sft) ------------------------------------------------------------
    Metric("sft/loss", "nats/token", "cross-entropy on the action tokens", phases=("sft",)),
    Metric("sft/action_tokens", "tokens", "action tokens in the batch", phases=("sft",)),
    Metric("sft/tokens_mean", "tokens/example", "tokens per example", phases=("sft",)),
    # -- evaluation (eval.run, one row at the end; {benchmark} is a data source or "average") --
    Metric("eval/{benchmark}/em", "EM", "exact match", phases=("eval",)),
    Metric("eval/{benchmark}/subem", "fraction", "a golden answer is contained in the answer", phases=("eval",)),
    Metric("eval/{benchmark}/f1", "F1", "token F1", phases=("eval",)),
    Metric("eval/{benchmark}/n", "questions", "questions evaluated", phases=("eval",)),
    Metric("eval/{benchmark}/finished_rate", "fraction", "answered questions", phases=("eval",)),
    Metric("eval/{benchmark}/mean_response_length", "tokens", "response tokens", phases=("eval",)),
    Metric("eval/{benchmark}/searches_per_question", "searches", "valid searches", phases=("eval",)),
    Metric("eval/{benchmark}/valid_action_rate", "fraction", "valid actions / actions", phases=("eval",)),
    Metric("eval/decoding_greedy", "bool", "1 if eval decoded greedily", phases=("eval",)),
)

# Per-mini-batch outputs of the update that are not logged per step (the arrays still reach
# ``rl_loop``'s ``on_step_end``): the differentiated loss, extra estimators and variants.
UPDATE_ONLY = frozenset({
    "loss/objective", "kl/old_k1", "llds/answer_coef", "llds/gated_actions_per_preserved_response",
    "logp_old/pos_mean_all_token_scaled", "logp_old/neg_mean_all_token_scaled",
    "logp_old/pos_first_action", "logp_old/neg_first_action", "logp_old/pos_later_actions",
    "logp_old/neg_later_actions", "response/action_tokens", "response/actions", "response/searches",
})

# Names older trainers logged → today's name (``report.load_metrics`` reads old files with it).
# Old keys with no entry were duplicates (both names were logged) or constants; they are dropped.
RENAMED = {
    "rollout/searches_mean": SEARCHES,
    "rollout/turns_mean": "rollout/turns",
    "rollout/finished_rate": "rollout/finished",
    "rollout/truncated_rate": "rollout/truncated",
    "rollout/response_tokens_mean": "rollout/response_tokens",
    "rollout/action_tokens_mean": "rollout/action_tokens",
    "diag/searches/mean": SEARCHES,
    "diag/valid_action_rate": VALID_ACTION_RATE,
    "diag/finished_rate": "rollout/finished",
    "diag/response_length/mean": "rollout/response_tokens",
    "diag/action_tokens/mean": "rollout/action_tokens",
    "diag/entropy": POLICY_ENTROPY,
    "grad/norm": GRAD_NORM,
}
REMOVED = frozenset({"llds/value_first_minibatch"})  # 0 by construction (θ = θ_old in mini-batch 1)

BY_NAME = {metric.name: metric for metric in TABLE}
UPDATE_METRICS = tuple(metric for metric in TABLE if metric.mini_batches is not None)


def lookup(key: str) -> Metric | None:
    """The table entry of ``key`` (exact, or through a ``{k}``/``{benchmark}`` template), else None."""
    return BY_NAME.get(key) or next((m for m in TABLE if "{" in m.name and m.matches(key)), None)


def host_reduction(key: str) -> str:
    """How ``combine_over_hosts`` merges ``key`` (``global`` values are equal on every host: mean)."""
    metric = lookup(key)
    if metric is None:
        raise KeyError(f"metric {key!r} is not in llds_jax.diagnostics.keys.TABLE: add it there")
    return "mean" if metric.hosts == "global" else metric.hosts


def upgrade_row(row: dict) -> dict:
    """An old ``metrics.jsonl`` row with today's names (:data:`RENAMED`).

    The old key's value replaces a same-named one: old rows logged the π_old entropy as
    ``diag/entropy`` and a mean over mini-batches (0.0 without an entropy term) as ``policy/entropy``.
    """
    for old, new in RENAMED.items():
        if old in row:
            value = row.pop(old)
            if value is not None or new not in row:
                row[new] = value
    for old in REMOVED:
        row.pop(old, None)
    return row
