"""llds_jax.diagnostics."""
