"""What users reach for when GRPO collapses, side by side with LLDS, on the lab's collapsing setting.

    python -m llds_jax.main --mode=sweep --config=configs/sweep_collapse_fixes.py                         # print + validate
    python -m llds_jax.main --mode=sweep --config=configs/sweep_collapse_fixes.py --config.sweep.launch=True

Every arm starts from ``configs/lab_spiral.py`` (groups of 8, four sequential updates per step,
300 steps) at the point issue #45 names as collapsing (lr 4e-4, seed 1); one field set per arm:

* ``grpo``: vanilla GRPO (λ = 0), the collapsing baseline.
* ``llds`` / ``llds_ma``: LLDS, action gate, λ = 0.1; LLDS-MA removes the answer span from the penalty.
* ``tis``: token-level truncated IS with the sampler's own log-probs, C = 2 (verl's ``token_is`` preset).
* ``kl_only``: GRPO with ten times the default KL to the reference (0.01) as the only stabiliser.
* ``reinforce_pp``: REINFORCE++ advantages, KL moved from the loss into the reward (β = 0.001).

Dynamic sampling (DAPO's filter_groups) is not an arm: ``train.dynamic_sampling`` is not built yet.
The runs land in ``runs/collapse_fixes/<arm>+lr=0.0004+seed=1``; put them on one page with
``--mode=report --config=configs/eval.py --config.report.compare=<run dirs>`` (reward, LLD rate,
log-odds, grad norm).
"""

import ml_collections

ARMS = (
    ("grpo", (("rl.llds_coef", 0.0),)),
    ("llds", (("rl.llds_coef", 0.1),)),
    ("llds_ma", (("rl.llds_coef", 0.1), ("rl.mask_answer", True), ("rl.answer_weight", 0.0))),
    ("tis", (("rl.llds_coef", 0.0), ("rl.rollout_correction", "tis"), ("rl.rollout_correction_cap", 2.0))),
    ("kl_only", (("rl.llds_coef", 0.0), ("rl.kl_coef", 0.01))),
    ("reinforce_pp", (("rl.llds_coef", 0.0), ("rl.advantage_estimator", "reinforce_pp"), ("rl.kl_coef", 0.0),
                      ("rl.reinforce_pp_kl_coef", 0.001))),
)


def get_config():
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(dict(
        base_config="configs/lab_spiral.py",
        arms=ARMS,
        grid=(("optim.lr", (4e-4,)), ("seed", (1,))),
        workdir_root="runs/collapse_fixes",
        launch=False,
        num_devices=0,
    ))
    return c
