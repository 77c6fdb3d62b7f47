"""llds_jax.plan: ahead-of-time memory plans (``--mode=plan`` and the fit check before a run)."""
