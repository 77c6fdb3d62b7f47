"""Both arms of the lab's death-spiral setting over three seeds: 2 × 3 = 6 runs of 300 steps.

    python -m llds_jax.main --mode=sweep --config=configs/sweep_lab_spiral.py                         # print + validate
    python -m llds_jax.main --mode=sweep --config=configs/sweep_lab_spiral.py --config.sweep.launch=True

λ = 0 is vanilla GRPO, λ = 0.1 LLDS with the action gate (``configs/lab_spiral.py``); the runs
land in ``runs/lab_spiral/llds_coef=<λ>+seed=<s>``. A run stopped midway resumes from its last
checkpoint when launched again. About 2 h in all on two quiet cores. Compare them with
``--mode=report --config=configs/eval.py --config.report.compare=<run dirs>`` (docs/death_spiral_lab.md).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(dict(
        base_config="configs/lab_spiral.py",
        grid=(("rl.llds_coef", (0.0, 0.1)), ("seed", (0, 1, 2))),
        workdir_root="runs/lab_spiral",
        launch=False,
        num_devices=0,
    ))
    return c
