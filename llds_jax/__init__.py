"""llds_jax: Search-R1-style GRPO with the LLDS regulariser, JAX/Flax-native."""

__version__ = "0.1.0"
