"""llds_jax.parallel."""
