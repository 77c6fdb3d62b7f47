"""llds_jax.app: the command-line modes' wiring (train, sft, sweep), config assembly and run control.

``train/`` is the trainer; this package decides what runs, in which order, and when a run stops.
"""
