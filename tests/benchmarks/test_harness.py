"""benchmarks/_harness.py: the load gate, A/B alternation and the JSON record, in-process; and two
bench scripts as real subprocesses: one refusing on a (forced) loaded machine, one printing a
parsable record with ``--allow-noisy --json`` on its smallest settings."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("_harness", BENCHMARKS / "_harness.py")
harness = importlib.util.module_from_spec(_SPEC)
sys.modules["_harness"] = harness  # dataclasses look their module up while the file executes
_SPEC.loader.exec_module(harness)

SIDE_KEYS = {"median_s", "cpu_s", "wall_s", "cpu_s_all"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=3)
    harness.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.unit
def test_alternation_interleaves_sides_per_repeat_never_all_of_one_first():
    assert harness.alternation_order(["a", "b"], 3) == ["a", "b", "a", "b", "a", "b"]
    calls = []
    times = harness.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2)
    assert calls == ["a", "b", "a", "b", "a", "b"], calls  # one warm-up call each, then A, B per repeat
    assert [len(times[s].wall_s) for s in "ab"] == [2, 2]
    assert [len(times[s].cpu_s) for s in "ab"] == [2, 2]


@pytest.mark.unit
def test_setup_runs_untimed_before_each_call_and_feeds_it():
    calls = []

    def slow_setup():
        calls.append("setup")
        time.sleep(0.2)
        return len(calls)

    times = harness.alternate({"a": lambda n: calls.append(("a", n)), "b": lambda: calls.append("b")}, repeats=2,
                              setup={"a": slow_setup})
    assert calls == ["setup", ("a", 1), "b", "setup", ("a", 4), "b", "setup", ("a", 7), "b"], calls
    assert max(times["a"].wall_s) < 0.2, times["a"].wall_s  # the 0.2 s sleep is setup, not the timed call


@pytest.mark.unit
def test_cpu_seconds_count_the_work_done_on_a_side():
    def spin():
        x = 0
        for i in range(300_000):
            x += i * i
    times = harness.alternate({"busy": spin, "idle": lambda: None}, repeats=1)
    assert times["busy"].cpu_s[0] > times["idle"].cpu_s[0], (times["busy"].cpu_s, times["idle"].cpu_s)
    assert times["busy"].cpu_s[0] > 0


@pytest.mark.unit
def test_gate_refuses_above_max_load_with_exit_2_and_a_clear_error(capsys):
    with pytest.raises(SystemExit) as stop:
        harness.start("bench_x", parse(["--max-load=-1"]))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert re.search(r"load average \d+\.\d\d exceeds the threshold -1\.00", err[0]), err[0]
    assert "--allow-noisy" in err[0], err[0]


@pytest.mark.unit
def test_allow_noisy_runs_and_marks_the_record_and_table_noisy():
    session = harness.start("bench_x", parse(["--max-load=-1", "--allow-noisy"]))
    assert session.noisy
    assert harness.format_table(session.record()).startswith("NOISY")
    quiet = harness.start("bench_x", parse([f"--max-load={10 * os.getloadavg()[0] + 1e9}"]))
    assert not quiet.noisy and not harness.format_table(quiet.record()).startswith("NOISY")


@pytest.mark.unit
def test_json_record_has_every_field_and_ratios_are_peer_time_over_ours(capsys):
    session = harness.start("bench_x", parse(["--json", "--allow-noisy", "--size=7"]))
    times = {"llds_jax": harness.SideTimes([1.0, 3.0, 2.0], [0.5, 0.5, 0.5]),
             "torch_1": harness.SideTimes([4.0, 4.0, 8.0], [1.0, 2.0, 3.0]),
             "torch_2": harness.SideTimes([3.0, 3.0, 3.0], [1.0, 1.0, 1.0])}
    session.add_case("case", times, tokens=100)
    session.finish()
    out = capsys.readouterr().out
    record = json.loads(out)  # exactly one object: json.loads rejects trailing text
    assert set(record) >= {"benchmark", "settings", "cases", "load_average", "cpu_count", "git_commit", "versions",
                           "noisy", "max_load"}
    assert record["benchmark"] == "bench_x" and record["settings"] == {"size": 7}
    assert len(record["load_average"]["start"]) == 3 and len(record["load_average"]["end"]) == 3
    assert record["cpu_count"] == os.cpu_count()
    assert set(record["versions"]) >= {"python", "jax", "torch"}
    assert record["git_commit"] and len(record["git_commit"].removesuffix("-dirty")) == 40
    (case,) = record["cases"]
    assert SIDE_KEYS | {"tokens_per_s"} <= set(case["sides"]["llds_jax"])
    assert case["sides"]["llds_jax"]["median_s"] == 2.0 and case["sides"]["llds_jax"]["tokens_per_s"] == 50.0
    assert case["sides"]["torch_1"]["cpu_s"] == 2.0
    assert case["ratios"] == {"llds_jax_speedup_vs_torch_1": 2.0, "llds_jax_speedup_vs_torch_2": 1.5,
                              "llds_jax_speedup_vs_best_peer": 1.5}


def run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=BENCHMARKS.parent)


@pytest.mark.parametrize("script", ["bench_forward.py", "bench_sampler.py", "bench_train_step.py", "bench_attention.py",
                                    "bench_rollout.py", "bench_retrieval.py", "bench_kernels.py"])
def test_every_bench_script_refuses_a_loaded_machine_with_exit_2(script):
    extra = ["--index_dir=/nonexistent"] if script == "bench_retrieval.py" else []
    done = run_script(script, "--max-load=-1", *extra, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(errors) == 1 and "--allow-noisy" in errors[0] and "-1.00" in errors[0], errors
    assert done.stdout == "", done.stdout


def test_bench_sampler_allow_noisy_json_prints_one_parsable_record():
    done = run_script("bench_sampler.py", "--models=tiny", "--batch=2", "--prompt-len=8", "--new-tokens=4",
                      "--repeats=2", "--allow-noisy", "--json", "--max-load=-1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["benchmark"] == "bench_sampler" and record["noisy"] is True
    (case,) = record["cases"]
    assert set(case["sides"]) == {"llds_jax", "transformers"}
    for side in case["sides"].values():
        assert SIDE_KEYS | {"tokens_per_s"} <= set(side) and len(side["wall_s"]) == 2
        assert side["median_s"] > 0 and side["tokens_per_s"] == pytest.approx(2 * 4 / side["median_s"])
    assert set(case["ratios"]) == {"llds_jax_speedup_vs_transformers"}


def test_bench_kernels_json_record_has_each_case_with_rates_and_the_decode_ceiling():
    done = run_script("bench_kernels.py", "--matmul=32x48x64", "--decode-layers=1", "--decode-batch=2",
                      "--stream-mb=4", "--repeats=1", "--allow-noisy", "--json", "--max-load=-1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["benchmark"] == "bench_kernels" and record["noisy"] is True
    matmul, decode, stream = record["cases"]
    assert matmul["work"] == {"GFLOP": pytest.approx(5 * 2 * 32 * 48 * 64 / 1e9)}
    # one layer's seven projections and the tied head, fp32
    weights = 4 * (576 * (576 + 192 + 192 + 576 + 1536 + 1536) + 1536 * 576 + 49152 * 576)
    assert decode["work"] == {"GB": pytest.approx(5 * weights / 1e9)}
    assert stream["work"] == {"GB": pytest.approx(5 * 4 * 2**20 / 1e9)}
    for case in (matmul, decode, stream):
        assert set(case["sides"]) == {"llds_jax", "torch"} and set(case["ratios"]) == {"llds_jax_speedup_vs_torch"}
    ceiling = record["results"]["decode_tokens_per_s_ceiling"]
    step_ms = record["results"]["decode_gemm_ms_per_step"]
    for side in ("llds_jax", "torch"):
        assert ceiling[side] == pytest.approx(2 / (step_ms[side] / 1000))
        assert step_ms[side] == pytest.approx(1000 * decode["sides"][side]["median_s"] / 5)


def test_bench_kernels_update_case_counts_every_product_of_the_update_and_reports_its_floor():
    done = run_script("bench_kernels.py", "--cases=update", "--update-layers=1", "--repeats=1", "--allow-noisy", "--json",
                      "--max-load=-1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    (case,) = record["cases"]
    tokens, scored = 4 * 256, 4 * 80  # a micro-batch of bench_train_step: 4 rows of 256, 80 scored targets a row
    projections = 576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536  # q, k, v, o, gate, up, down of one layer
    attention_block = 2 * 4 * 9 * 128 * 128 * 64  # one product of a 128-query x 128-key block, 9 heads
    per_micro_batch = (6 * tokens * projections  # forward, input and weight gradients
                       + 3 * 7 * attention_block  # 3 causal block pairs x (2 forward + 5 backward products)
                       + 6 * scored * 576 * 49152)  # the tied head on the scored positions
    assert case["work"] == {"GFLOP": pytest.approx(4 * per_micro_batch / 1e9)}
    assert set(case["sides"]) == {"llds_jax", "torch"}
    floor = record["results"]["update_products_floor_s"]
    assert floor == {side: case["sides"][side]["median_s"] for side in ("llds_jax", "torch")}


@pytest.mark.parametrize(("argument", "message"), [("--cases=matmul,gemv", "--cases: unknown ['gemv']"),
                                                    ("--update-layers=0", "--update-layers=0: must be >= 1"),
                                                    ("--matmul=64x64x64,12x3", "--matmul: '12x3' is not MxKxN")])
def test_bench_kernels_rejects_bad_arguments_by_name_before_measuring(argument, message):
    done = run_script("bench_kernels.py", argument, "--allow-noisy", timeout=300)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert done.stdout == "", done.stdout
