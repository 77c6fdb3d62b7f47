"""llds_jax.utils."""
