"""The death-spiral laboratory: a synthetic search world, a tokenizer and a tiny policy built for it.

``prepare.prepare(config)`` builds (or finds cached) all three and points the config at them;
``configs/lab_grpo.py`` / ``configs/lab_llds.py`` are the experiment. See docs/death_spiral_lab.md.
"""
