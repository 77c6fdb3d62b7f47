"""llds_jax.models."""
