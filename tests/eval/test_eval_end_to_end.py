"""Evaluation end to end: the shared slices, the real rollout loop and real BM25 retrieval."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import ml_collections
import pytest

from llds_jax.data.benchmarks import BENCHMARKS, DISPLAY_NAMES
from llds_jax.eval.run import eval_main, eval_rollout_config, evaluate, load_eval_datasets
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.config import default_config as rollout_defaults
from llds_jax.rollout.scripted_policy import ScriptedPolicy
from llds_jax.sampling.token_bytes import vocab_bytes

pytestmark = pytest.mark.unit

CORPUS_ROWS = 3000
REPO = Path(__file__).resolve().parents[2]


def load_config_file(path: Path) -> ml_collections.ConfigDict:
    """What ``--config=configs/eval.py`` does: import the file and call its ``get_config``."""
    spec = importlib.util.spec_from_file_location("eval_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def bm25_config(shared_dir, tmp_path_factory):
    """BM25 over the first rows of the shared wiki-18 cut (real passages), index in a temp dir."""
    from llds_jax.retrieval.config import default_retrieval_config

    corpus = tmp_path_factory.mktemp("corpus") / "wiki18_head.jsonl"
    with open(shared_dir / "data" / "corpus" / "wiki18_subset.jsonl", "rb") as src, open(corpus, "wb") as dst:
        dst.writelines(itertools.islice(src, CORPUS_ROWS))
    config = default_retrieval_config()
    config.corpus_path = str(corpus)
    config.index_path = str(corpus.parent / "bm25")
    return config


@pytest.fixture(scope="module")
def bm25(bm25_config):
    from llds_jax.retrieval.factory import build_retriever

    return build_retriever(bm25_config)


@pytest.fixture(scope="module")
def slices(shared_dir):
    return load_eval_datasets(str(shared_dir / "data" / "eval"), limit=2)


def small_rollout_config(max_turns=1, max_action_tokens=12):
    cfg = rollout_defaults()
    cfg.update(dict(max_turns=max_turns, max_action_tokens=max_action_tokens, max_obs_tokens=64,
                    max_prompt_tokens=256, max_context=512, pad_to_multiple=64))
    return cfg


@pytest.mark.integration
def test_eval_mode_runs_a_tiny_model_with_real_bm25_on_all_seven_slices(shared_dir, bm25_config, tmp_path):
    config = load_config_file(REPO / "configs" / "eval.py")
    config.workdir = str(tmp_path)
    config.model.source = "tiny:qwen2"
    config.model.tokenizer = str(shared_dir / "assets" / "qwen2_tokenizer")
    config.retrieval = bm25_config
    config.rollout = small_rollout_config()
    config.eval.update(dict(data=str(shared_dir / "data" / "eval"), limit=2, batch_size=7))

    table_path = eval_main(config)

    assert table_path == tmp_path / "eval" / "eval_table.md"
    header = next(line for line in table_path.read_text().splitlines() if line.startswith("| metric"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == [DISPLAY_NAMES[s] for s in BENCHMARKS] + ["Avg"]
    assert "Decoding: greedy." in table_path.read_text()
    payload = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert payload["decoding"] == "greedy" and list(payload["metrics"]) == [*BENCHMARKS, "average"]
    assert all(payload["metrics"][s]["n"] == 2 for s in BENCHMARKS) and payload["metrics"]["average"]["n"] == 14
    predictions = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 14
    for row in predictions:
        # At most two capped actions (search turn + final turn) and one cut feedback.
        assert row["actions"] >= 1 and 0 < row["response_length"] <= 2 * 12 + 64, row


def test_scripted_searches_and_answers_are_scored_exactly(slices, bm25, qwen_tokenizer):
    """A policy that searches the question, then answers gold for even rows and a wrong answer for odd rows."""
    records = [r for rs in slices.values() for r in rs]
    streams = []
    for index, record in enumerate(records):
        answer = record.golden_answers[0] if index % 2 == 0 else "certainly not this"
        streams.append([qwen_tokenizer.encode(f"<think>x</think><search> {record.question} </search>"),
                        qwen_tokenizer.encode(f"<think>ok</think><answer> {answer} </answer>")])
    vocab = vocab_bytes(qwen_tokenizer)
    policy = ScriptedPolicy(streams, action_stop_table(vocab),
                            stop_token_ids=[qwen_tokenizer.eos_token_id])
    config = small_rollout_config(max_turns=2, max_action_tokens=96)
    result = evaluate(policy, qwen_tokenizer, records, bm25, config, greedy=False, batch_size=len(records),
                      progress=False)

    average = result.summary["average"]
    assert average["em"] == pytest.approx(0.5) and average["subem"] == pytest.approx(0.5)
    assert (average["searches_per_question"], average["valid_action_rate"], average["finished_rate"]) == (1, 1, 1)
    assert all(len(observed) == 1 and observed[0] for observed in policy.observed), "each row got one search result"
    assert result.decoding == "sampled (T=1, top-p 0.95)"


def test_greedy_evaluation_uses_one_sample_at_temperature_zero():
    cfg = eval_rollout_config(ml_collections.ConfigDict(rollout_defaults()), greedy=True)
    assert (cfg.n_samples, cfg.temperature) == (1, 0.0)
    sampled = eval_rollout_config(rollout_defaults(), greedy=False)
    assert (sampled.n_samples, sampled.temperature, sampled.top_p) == (1, 1.0, 0.95)


def test_a_run_directory_resolves_to_its_newest_hf_export(tmp_path):
    from llds_jax.models.loading import resolve_model_path

    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="export_hf"):
        resolve_model_path(str(tmp_path))
    for step in (5, 40, 10):
        (tmp_path / "hf" / f"step_{step}").mkdir(parents=True)
    assert resolve_model_path(str(tmp_path)) == tmp_path / "hf" / "step_40"
