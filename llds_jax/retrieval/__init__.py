"""llds_jax.retrieval."""
