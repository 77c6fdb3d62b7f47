"""llds_jax.train."""
