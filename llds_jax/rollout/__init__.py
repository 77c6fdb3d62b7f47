"""llds_jax.rollout."""
