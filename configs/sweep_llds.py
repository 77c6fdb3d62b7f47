"""λ × gate sweep of the paper's ablation (Qwen2.5-3B, NQ+HotpotQA): 3 × 2 = 6 runs.

    python -m llds_jax.main --mode=sweep --config=configs/sweep_llds.py                 # print + validate
    python -m llds_jax.main --mode=sweep --config=configs/sweep_llds.py --config.sweep.launch=True

Swap ``sweep.base_config`` for ``configs/cpu_smoke.py`` to sweep the default job on a laptop.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(dict(
        base_config="configs/qwen3b.py",
        grid=(("rl.llds_coef", (0.0, 0.01, 0.1)), ("rl.llds_gate", ("action", "response"))),
        workdir_root="runs/sweep_llds",
        launch=False,
        num_devices=0,  # validate the runs for this many devices (0 = this host's; e.g. 64 for a v5e-64)
    ))
    return c
