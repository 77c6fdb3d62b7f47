"""llds_jax.eval."""
