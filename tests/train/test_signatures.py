"""The compile counts read traced signatures, not jit's process-wide cache (which evicts, then reads 0)."""

import jax
import jax.numpy as jnp
import pytest

from llds_jax.train.signatures import SignatureLog

pytestmark = pytest.mark.unit


def test_a_retrace_of_the_same_signature_counts_once_and_a_new_shape_counts():
    log = SignatureLog()
    fn = jax.jit(log.counted("double", lambda x: 2 * x))
    fn(jnp.ones(3))
    assert log.count("double") == 1
    jax.clear_caches()  # what an eviction of jit's shared C++ cache does to this function's entry
    assert fn._cache_size() == 0  # jit's own count now says "never compiled"
    fn(jnp.ones(3))  # traced again, same signature
    assert log.count("double") == 1
    fn(jnp.ones(4))
    assert log.count("double") == 2


def test_a_name_counts_zero_until_its_function_is_called():
    log = SignatureLog()
    jax.jit(log.counted("later", lambda x: x))
    assert log.count("later") == 0 and log.count("unknown") == 0
    assert log.counts() == {"later": 0}
