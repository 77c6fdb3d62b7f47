"""llds_jax.sampling."""
