"""llds_jax.data."""
