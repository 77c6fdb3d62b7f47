"""Evaluation on the seven QA benchmarks (SPEC §7, §9) and run reports.

    # the shared dev slices, greedy, with the checkpoint of a run (or an HF directory):
    python -m llds_jax.main --mode=eval --config=configs/eval.py \\
        --config.model.source=runs/cpu_smoke --config.eval.data=../shared/data/eval
    # sampled at T=1 / top-p 0.95, as the Search-R1 reference's validation actually did:
    python -m llds_jax.main --mode=eval --config=configs/eval.py --config.eval.greedy=False
    # plots + summary of a run, or a comparison of several:
    python -m llds_jax.main --mode=report --config=configs/eval.py --config.workdir=runs/cpu_smoke
    python -m llds_jax.main --mode=report --config=configs/eval.py \\
        --config.report.compare=runs/grpo,runs/llds --config.report.out_dir=runs/compare

The model, retrieval and rollout sections are the training defaults (the same rollout
and retriever as training); override them exactly as for ``--mode=train``.
"""

import ml_collections

from llds_jax.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/eval"
    c.model.source = "smollm2"       # or an HF dir, a .gguf file, or tiny:<family> with model.tokenizer
    c.rollout.max_turns = 2
    c.eval.limit = 0  # every question of each source (the eval section's fields: base_config)
    c.report = ml_collections.ConfigDict(dict(
        compare="",           # "RUN_A,RUN_B": overlay several runs instead of one workdir
        out_dir="",           # "" = <workdir>/report (compare: <first run>/compare)
    ))
    # c.monitor (from base_config) holds every MonitorConfig field; --mode=report replays it
    return c
