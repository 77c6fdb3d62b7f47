"""The GPU decode step's SwiGLU gate/up kernel (``models/mlp_gpu.py``) in Pallas' interpreter, against
float64, under a mesh, and where the decoder calls it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models import mlp_gpu

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]


def _inputs(rows: int, hidden: int, intermediate: int, dtype, seed: int = 0):
    """x, gate, up holding ``dtype``'s values (as float64 too): unit-scale rows, weights of 1/sqrt(D)."""
    rng = np.random.default_rng(seed)
    arrays = (rng.standard_normal((rows, hidden)), rng.standard_normal((hidden, intermediate)) / np.sqrt(hidden),
              rng.standard_normal((hidden, intermediate)) / np.sqrt(hidden))
    typed = [jnp.asarray(a, dtype) for a in arrays]
    return typed, [np.asarray(t.astype(jnp.float32), np.float64) for t in typed]


def _exact(x, gate, up):
    g, u = x @ gate, x @ up
    return g / (1 + np.exp(-g)) * u


def _fp32_sums_error(x, gate, up):
    """What fp32 accumulation over D can add: D · 2^-24 of each sum of |x|·|w|, through SiLU·up's
    partial derivatives (|d(silu(g)u)/dg| ≤ 1.1 |u|, |d/du| ≤ |g|), doubled for headroom."""
    hidden = x.shape[1]
    reach_g, reach_u = np.abs(x) @ np.abs(gate), np.abs(x) @ np.abs(up)
    return 2 * hidden * 2.0 ** -24 * (1.1 * reach_g * np.abs(x @ up) + reach_u * np.abs(x @ gate))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [64, 40])  # 40: a partial row tile, padded and sliced off
def test_the_kernel_is_silu_gate_times_up_within_one_rounding(dtype, rows):
    """fp32 accumulators, one rounding to ``dtype`` at the end: the result is within one unit in the last
    place of ``dtype`` of the float64 product, plus the fp32 sums' own error (:func:`_fp32_sums_error`)."""
    hidden, intermediate = 128, 192
    (x, gate, up), (x64, gate64, up64) = _inputs(rows, hidden, intermediate, dtype)
    out = np.asarray(mlp_gpu.gate_up_silu(x, gate, up, interpret=True).astype(jnp.float32), np.float64)
    want = _exact(x64, gate64, up64)
    assert out.shape == want.shape
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) * (
        2.0 ** 16 if dtype == jnp.bfloat16 else 1.0)  # bf16 keeps 8 of fp32's 24 significand bits
    np.testing.assert_array_less(np.abs(out - want), ulp + _fp32_sums_error(x64, gate64, up64) + np.finfo(np.float32).tiny)


def test_under_a_mesh_each_device_runs_its_own_rows():
    """8 devices split the rows (``batch``) and the weights stay whole (no tensor axis): each device's
    rows come out as the single-program result's, to the fp32 sums' error."""
    from llds_jax.parallel.mesh import make_mesh

    (x, gate, up), (x64, gate64, up64) = _inputs(128, 64, 128, jnp.float32, seed=1)
    mesh = make_mesh((-1, 1, 1))
    whole = np.asarray(mlp_gpu.gate_up_silu(x, gate, up, interpret=True))
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
        split = jax.jit(lambda x, g, u: mlp_gpu.gate_up_silu(x, g, u, interpret=True))(placed, gate, up)
    assert (*split.sharding.spec, None)[0] is not None  # rows stay split over the devices
    bound = 2 * _fp32_sums_error(x64, gate64, up64) + np.finfo(np.float32).tiny  # either side's sums
    np.testing.assert_array_less(np.abs(np.asarray(split, np.float64) - whole), bound)


def test_only_whole_tiles_are_taken():
    assert mlp_gpu.supported(896, 4864) and mlp_gpu.supported(2048, 11008) and mlp_gpu.supported(3584, 18944)
    assert not mlp_gpu.supported(100, 4864) and not mlp_gpu.supported(896, 100)
    x = jnp.zeros((8, 100), jnp.float32)
    with pytest.raises(ValueError, match="multiples of 64"):
        mlp_gpu.gate_up_silu(x, jnp.zeros((100, 128)), jnp.zeros((100, 128)), interpret=True)


@pytest.mark.parametrize("intermediate", [256, 192])  # 192 over 4 devices: 48 a device, not whole tiles
def test_under_a_tensor_axis_each_device_computes_its_share_of_f_or_all_of_it(intermediate):
    """A mesh of (data 2, tensor 4): F split four ways where a device's share is whole 64-column tiles,
    else every device computes all of F; either way the single-program result, to the fp32 sums' error."""
    from llds_jax.parallel.mesh import make_mesh

    (x, gate, up), (x64, gate64, up64) = _inputs(64, 64, intermediate, jnp.float32, seed=2)
    whole = np.asarray(mlp_gpu.gate_up_silu(x, gate, up, interpret=True))
    mesh = make_mesh((2, 1, 4))
    with jax.set_mesh(mesh):
        split = jax.jit(lambda x, g, u: mlp_gpu.gate_up_silu(x, g, u, interpret=True))(x, gate, up)
    spec = (*split.sharding.spec, None, None)
    assert (spec[1] is not None) == (intermediate == 256), split.sharding
    bound = 2 * _fp32_sums_error(x64, gate64, up64) + np.finfo(np.float32).tiny
    np.testing.assert_array_less(np.abs(np.asarray(split, np.float64) - whole), bound)
