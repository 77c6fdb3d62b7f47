"""The sharded GRPO + LLDS update step on a tiny real Decoder: mesh invariance, LLDS timing, compile counts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from train_helpers import synthetic_rollout, tiny_train_config

from llds_jax.models.testing import tiny_model
from llds_jax.parallel.mesh import make_mesh
from llds_jax.parallel.placement import shard_model
from llds_jax.train.batch import TrainBatch
from llds_jax.train.checkpoint import Checkpointer, abstract_like
from llds_jax.train.learner import Learner

pytestmark = pytest.mark.unit


def tiny_learner(config, mesh_shape=(1, 1, 1), **create_kwargs) -> Learner:
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2"), mesh)
    return Learner.create(model, config, mesh, **create_kwargs)


def run_steps(mesh_shape, steps: int = 1, eps: float | None = None, **train_overrides):
    config = tiny_train_config(**train_overrides)
    if eps is not None:
        config.optim.eps = eps
    config.mesh.shape = mesh_shape
    learner = tiny_learner(config, mesh_shape)
    history = []
    for step in range(steps):
        arrays = synthetic_rollout(seed=step)
        metrics, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
        extra["params"] = jax.tree.map(np.asarray, jax.device_get(learner.state.params))
        history.append((metrics, extra))
    return learner, history


@pytest.fixture(scope="module")
def single_device():
    return run_steps((1, 1, 1), steps=3)


def _assert_close(name, got, want, rtol=1e-5, floor=0.0):
    """Relative to the array's largest magnitude, or to ``floor`` for quantities that are ~0 by
    cancellation (the PG loss at ρ = 1 is −mean(A) ≈ 0 over O(1) advantages: fp32 noise ~1e-7)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), floor, 1e-30)
    err = np.max(np.abs(got - want)) / scale
    assert err <= rtol, f"{name}: max relative difference {err:.3e} > {rtol} (got {got}, want {want})"


# Adam's eps for the mesh-invariance runs. Adam's direction g/(|g| + eps) has per-entry
# sensitivity |∂u/∂g| ≤ 1/eps; at the default eps = 1e-8 an entry whose true gradient is ~0 turns
# reduction-order rounding of the gradient (≈ ε₃₂ · |grad| ≈ 1e-7) into an O(1) fraction of an lr
# step whose size depends on the host's ISA, so *no* tight per-entry bound on the updated params
# exists there. At eps = 1e-4 the map from gradient to update is 1e4-Lipschitz and the bound below
# follows from the quantities alone. (The gradients themselves are compared at the real eps through
# mini-batch 1's metrics, which do not depend on eps.)
WELL_CONDITIONED_EPS = 1e-4
F32_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def well_conditioned_reference():
    return run_steps((1, 1, 1), steps=1, eps=WELL_CONDITIONED_EPS)


# Which axes a mesh splits is layout, the same under either code generator; (2, 2, 2) splits all three (data,
# FSDP and tensor: every collective the others use), so it alone carries the numeric re-run under the host's
# default code generator (tests/codegen_sensitive.py).
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1),
                                        pytest.param((2, 2, 2), marks=pytest.mark.codegen_sensitive)])
def test_one_step_on_mesh_equals_single_device(mesh_shape, well_conditioned_reference):
    _, history = run_steps(mesh_shape, steps=1, eps=WELL_CONDITIONED_EPS)
    _, reference_history = well_conditioned_reference
    metrics, extra = history[0]
    ref_metrics, ref_extra = reference_history[0]
    # Mini-batch 1 sees the initial params on every mesh: its metrics must agree to 1e-5.
    mb1, ref_mb1 = extra["per_mini_batch"], ref_extra["per_mini_batch"]
    for key in ("loss/total", "loss/pg"):  # differences of O(1) per-token terms (|A| ~ 1): scale 1
        _assert_close(f"mini-batch 1 {key}", mb1[key][0], ref_mb1[key][0], floor=1.0)
    for key in ("kl/mean", "policy/entropy", "grad/norm_preclip", "ratio/max", "ratio/clip_frac", "llds/value",
                "delta_logp/abs_max"):
        _assert_close(f"mini-batch 1 {key}", mb1[key][0], ref_mb1[key][0], floor=0.1)
    _assert_close("old_logp", extra["old_logp"], ref_extra["old_logp"])

    lr = tiny_train_config().optim.lr
    updates = len(ref_mb1["grad/norm_preclip"])
    # Per update, an entry's step differs by ≤ lr · |δg| / eps, with |δg| ≤ ε₃₂ · (pre-clip grad norm):
    # one rounding unit at the gradient's own scale (clipping scales g and δg alike).
    grad_scale = float(np.max(ref_mb1["grad/norm_preclip"]))
    step_bound = updates * lr * min(2.0, F32_EPS * grad_scale / WELL_CONDITIONED_EPS)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(extra["params"]),
                                 jax.tree.leaves(ref_extra["params"])):
        _assert_params_close(f"param {jax.tree_util.keystr(path)}", got, want, lr, step_bound)

    # Mini-batch 2 reads π_θ after one (now well-conditioned) update: its LLDS penalty is a
    # 1-Lipschitz hinge of log π differences, so it moves by at most the log-prob rounding
    # (the old_logp tolerance) plus what the params' bounded difference can move log π.
    penalty, ref_penalty = extra["per_mini_batch"]["llds/value"][1], ref_mb1["llds/value"][1]
    logp_rounding = 2e-5 * float(np.max(np.abs(ref_extra["old_logp"])))
    assert abs(penalty - ref_penalty) <= logp_rounding, (
        f"mini-batch 2 llds/value {penalty:.6e} vs {ref_penalty:.6e}: differs by "
        f"{abs(penalty - ref_penalty):.3e} > {logp_rounding:.3e}")
    _assert_close("mini-batch 2 grad/norm_preclip", extra["per_mini_batch"]["grad/norm_preclip"][1],
                  ref_mb1["grad/norm_preclip"][1], rtol=1e-4)
    assert metrics.keys() == ref_metrics.keys()


def _assert_params_close(name, got, want, lr, step_bound):
    """Every entry within ``step_bound`` (the Adam-derived bound) plus two fp32 ulps of the value.

    No outlier allowance: with a well-conditioned optimizer the bound holds for each entry.
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.abs(got - want)
    ulps = 2 * np.spacing(np.maximum(np.abs(got), np.abs(want)).astype(np.float32)).astype(np.float64)
    excess = diff - (step_bound + ulps)
    worst = int(np.argmax(excess))
    assert excess.flat[worst] <= 0, (
        f"{name}: {int((excess > 0).sum())} of {diff.size} entries exceed the bound; worst differs by "
        f"{diff.flat[worst]:.3e} = {diff.flat[worst] / lr:.3e} lr (bound {step_bound / lr:.3e} lr + 2 ulp)")


@pytest.mark.codegen_sensitive
def test_llds_is_zero_in_first_mini_batch_and_nonzero_later(single_device):
    """π_old is computed once, before the updates: mini-batch 1 sees π_θ = π_old, later ones do not.

    Mini-batch 1 uses its own forward as π_old (θ = θ_old there), so its LLDS is exactly 0; the
    separately computed π_old must agree with that forward to fp rounding (``delta_logp/abs_max``
    in mini-batch 1), and later mini-batches, which read the precomputed π_old, see the updates.
    """
    _, history = single_device
    for step, (_metrics, extra) in enumerate(history):
        per_mini = extra["per_mini_batch"]
        penalties, gaps = per_mini["llds/value"], per_mini["delta_logp/abs_max"]
        assert len(penalties) == 2
        assert penalties[0] == 0.0, f"step {step}: LLDS in mini-batch 1 is {penalties[0]}; π_θ must equal π_old"
        assert penalties[1] > 1e-5, f"step {step}: LLDS in mini-batch 2 is {penalties[1]}; params did not move?"
        assert gaps[0] <= 1e-5, f"step {step}: π_old and the loss forward differ by {gaps[0]} before any update"
        assert gaps[1] > 100 * max(gaps[0], 1e-7), f"step {step}: mini-batch 2 log-probs did not move ({gaps})"


def test_each_jitted_function_compiles_once_over_three_steps(single_device):
    learner, history = single_device
    assert len(history) == 3
    counts = learner.compile_counts()
    assert counts == {"policy_logprobs": 1, "update": 1, "reference_logprobs": 1}, counts


def test_state_counters_advance(single_device):
    learner, _ = single_device
    assert int(learner.state.step) == 3
    assert int(learner.state.updates) + int(learner.state.skipped_updates) == 6


@pytest.mark.codegen_sensitive
def test_non_finite_loss_skips_the_update_and_counts_it():
    """A NaN reward in group 0 poisons mini-batch 1 only. Its own learner (one finite step first, so the
    update is compiled): the shared one's counters stay what the other tests read, in any order."""
    learner, _ = run_steps((1, 1, 1), steps=1)
    skipped = int(learner.state.skipped_updates)
    arrays = synthetic_rollout(seed=9)
    rewards = arrays["rewards"].copy()
    rewards[0] = np.nan
    metrics, _ = learner.update(TrainBatch.from_arrays({**arrays, "rewards": rewards}, length=learner.seq_len))
    assert metrics["update/skipped"] == 1.0, metrics["update/skipped"]  # only the NaN row's mini-batch
    assert int(learner.state.skipped_updates) == skipped + 1
    after = jax.tree.map(np.asarray, jax.device_get(learner.state.params))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))
    assert learner.compile_counts()["update"] == 1, "a NaN batch must not recompile"


@pytest.mark.codegen_sensitive
def test_raised_llds_lambda_applies_without_recompiling_and_survives_a_checkpoint(tmp_path):
    """The monitor's raise_lambda path: λ is train state, read at run time, saved and restored."""
    learner, history = run_steps((1, 1, 1), steps=1)
    assert history[0][0]["llds/lambda"] == pytest.approx(0.1)
    learner.set_llds_coef(0.4)
    assert learner.llds_coef == pytest.approx(0.4)
    arrays = synthetic_rollout(seed=5)
    metrics, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    per_mini = extra["per_mini_batch"]
    assert metrics["llds/lambda"] == pytest.approx(0.4)
    assert per_mini["llds/value"][1] > 0
    np.testing.assert_allclose(per_mini["llds/loss"][1], 0.4 * per_mini["llds/value"][1], rtol=1e-5)
    assert learner.compile_counts()["update"] == 1, "changing λ must not recompile the update"

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, learner.state, {})
    restored = Checkpointer(tmp_path).restore_latest(abstract_like(learner.state))
    assert float(restored.state.llds_coef) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="λ=-1"):
        learner.set_llds_coef(-1.0)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("count, expected", [("batch_written", [0.03, 0.03]), ("minibatch_executed", [0.0, 0.06])])
def test_adaptive_ma_reads_searches_over_the_scope_the_config_names(count, expected):
    """Official ``valid_search_mean``: one mean over the whole rollout batch; ours: per mini-batch.

    Mini-batch 1's rows searched once, mini-batch 2's three times: the batch mean is 2, so the
    answer coefficient min(w·max(s − 1, 0), λ) is 0.03 in both under the official count, and
    0 then 0.06 per mini-batch.
    """
    config = tiny_train_config()
    config.rl.update(dict(mask_answer=True, adaptive_ma=True, answer_weight=0.03, llds_coef=0.1, ma_search_count=count))
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2"), mesh)
    learner = Learner.create(model, config, mesh)
    arrays = synthetic_rollout(seed=0)
    half = len(arrays["num_searches"]) // 2
    arrays["num_searches"] = np.array([1.0] * half + [3.0] * half, np.float32)
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    np.testing.assert_allclose(extra["per_mini_batch"]["llds/answer_coef"], expected, rtol=1e-6)


@pytest.mark.codegen_sensitive
def test_first_step_reads_pi_old_as_pi_ref_and_later_steps_run_the_reference_pass():
    """Before the first update π_ref is a same-dtype copy of π_θ: step 0 skips its pass and hands the
    update π_old's log-probs, which is exactly what the pass would return (one program, equal inputs)."""
    learner = tiny_learner(tiny_train_config())
    calls = []
    reference_pass = learner.fns.reference_logprobs
    learner.fns = learner.fns._replace(reference_logprobs=lambda *args: calls.append(1) or reference_pass(*args))
    batch = learner.upload(TrainBatch.from_arrays(synthetic_rollout(seed=0), length=learner.seq_len))
    _, extra = learner.update(batch)
    assert not calls, "step 0 ran the reference pass"
    with jax.set_mesh(learner.mesh):  # π_ref is frozen: the pass the step skipped, run now on the same batch
        ran_pass = np.asarray(learner.fns.reference_logprobs(learner.state.ref_params, *batch.logprob_inputs))
    np.testing.assert_array_equal(np.asarray(extra["batch"].ref_logp), ran_pass)
    np.testing.assert_array_equal(np.asarray(extra["batch"].ref_logp), np.asarray(extra["batch"].old_logp))
    assert learner.reference_is_policy_in is not None and learner.reference_is_policy_in() is None, \
        "the donated fresh state must not stay alive"
    _, extra = learner.update(TrainBatch.from_arrays(synthetic_rollout(seed=1), length=learner.seq_len))
    gap = np.abs(np.asarray(extra["batch"].ref_logp) - np.asarray(extra["batch"].old_logp)).max()
    assert calls and gap > 0, "step 1 must score π_ref with the frozen reference, not the updated policy"


def test_a_reference_model_or_dtype_of_its_own_always_runs_the_reference_pass():
    config = tiny_train_config()
    config.model.ref_dtype = "bfloat16"
    assert tiny_learner(config).reference_is_policy_in is None
    config.model.ref_dtype = config.model.param_dtype
    assert tiny_learner(config, ref_model=tiny_model("qwen2")).reference_is_policy_in is None
    assert tiny_learner(config).reference_is_policy_in is not None
