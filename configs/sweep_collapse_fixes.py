"""What users reach for when GRPO collapses, side by side with LLDS, on the lab's collapsing setting.

    python -m llds_jax.main --mode=sweep --config=configs/sweep_collapse_fixes.py                         # print + validate
    python -m llds_jax.main --mode=sweep --config=configs/sweep_collapse_fixes.py --config.sweep.launch=True

Every arm starts from ``configs/lab_freeform.py`` (the free-form world of issue 43: 8 × 8
samples, 8 sequential updates per step, 150 steps, lr ramped from 0 to 8e-4 over the run) with
seed 0, where GRPO format-breaks once the ramp passes ≈ 3e-4; one field set per arm:

* ``grpo_s0``: vanilla GRPO (λ = 0), the collapsing baseline.
* ``llds_s0`` / ``llds_ma_s0``: LLDS, action gate, λ = 0.1; LLDS-MA removes the answer span from the penalty.
* ``kl02_s0``: GRPO with KL 0.02 to the reference (20 × the default) as the only stabiliser
  (issue 43's KL control, so one run serves both).
* ``tis_s0``: token-level truncated IS with the sampler's own log-probs, C = 2 (verl's ``token_is`` preset).
* ``rpp_s0``: REINFORCE++ advantages, KL moved from the loss into the reward (β = 0.001).
* ``dyn_s0``: GRPO with dynamic sampling (DAPO's filter_groups): only mixed groups are trained on.

The runs land in ``/work/lab_runs/ff/<arm>`` (shared with issue 43's probes); put them on one page
with ``--mode=report --config=configs/eval.py --config.report.compare=<run dirs>``. Results:
docs/collapse_fixes.md.
"""

import ml_collections

GRPO = (("seed", 0), ("rl.llds_coef", 0.0))
ARMS = (  # priority order: the baseline and LLDS first
    ("grpo_s0", GRPO),
    ("llds_s0", (("seed", 0), ("rl.llds_coef", 0.1))),
    ("kl02_s0", GRPO + (("rl.kl_coef", 0.02),)),
    ("tis_s0", GRPO + (("rl.rollout_correction", "tis"), ("rl.rollout_correction_cap", 2.0))),
    ("rpp_s0", GRPO + (("rl.advantage_estimator", "reinforce_pp"), ("rl.kl_coef", 0.0),
                       ("rl.reinforce_pp_kl_coef", 0.001))),
    ("dyn_s0", GRPO + (("train.dynamic_sampling", True), ("train.dynamic_sampling_max_draws", 4))),
    ("llds_ma_s0", (("seed", 0), ("rl.llds_coef", 0.1), ("rl.mask_answer", True), ("rl.answer_weight", 0.0))),
)


def get_config():
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(dict(
        base_config="configs/lab_freeform.py",
        arms=ARMS,
        grid=(),  # the arms carry the seed; the base config keeps its own lr schedule
        workdir_root="/work/lab_runs/ff",
        launch=False,
        num_devices=0,
    ))
    return c
