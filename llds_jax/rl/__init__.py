"""llds_jax.rl."""
