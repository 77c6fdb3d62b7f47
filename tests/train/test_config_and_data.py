"""Configs, batch arithmetic, sweep expansion, the resumable prompt iterator, metrics files, the LR
schedule, the bundled data and the synthetic warm-up trajectories (no compilation in this file)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from llds_jax.app.sweep import expand_grid, plan
from llds_jax.config import TrainConfigError, base_config, batch_arithmetic, validate
from llds_jax.data.prompts import BUNDLED_DIR, PromptIterator, load_questions
from llds_jax.train.metrics import MetricsWriter, read_metrics
from llds_jax.train.state import learning_rate

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_qwen3b_config_resolves_validates_and_prints_the_paper_arithmetic():
    config = validate(load_config("qwen3b"), num_devices=64)
    table = batch_arithmetic(config, num_devices=64)
    assert "512 prompts × 5 samples = 2560" in table
    assert "2560 / 256 = 10 sequential optimizer updates" in table
    assert "warmup 286 steps" in table
    assert config.rl.llds_coef == 0.1 and config.rl.llds_gate == "action"
    assert config.rollout.max_turns == 3 and config.rollout.topk == 3 and config.optim.lr == 1e-6


@pytest.mark.parametrize("name, devices", [("cpu_smoke", 1), ("cpu_smoke", 2), ("qwen0p5b", 1), ("qwen0p5b", 8), ("qwen3b", 64),
                                           ("qwen7b", 64)])
def test_every_config_file_validates_for_its_target(name, devices):
    validate(load_config(name), num_devices=devices)


@pytest.mark.parametrize("field, value, message", [
    ("mini_batch_size", 300, "train.mini_batch_size=300 does not divide train.prompts_per_step×rollout.n_samples"),
    ("micro_batch_size", 48, "train.micro_batch_size=48 does not divide train.mini_batch_size=256"),
    ("micro_batch_size", 4, "train.micro_batch_size=4 is not a multiple of the data-parallel size 64"),
    ("prompts_per_step", 0, "train.prompts_per_step=0 must be a positive integer"),
])
def test_sizes_that_do_not_fit_fail_naming_the_fields(field, value, message):
    config = load_config("qwen3b")
    config.train[field] = value
    with pytest.raises(TrainConfigError, match=message.replace("×", ".").replace("(", r"\(")):
        validate(config, num_devices=64)


def test_every_monitor_setting_is_a_command_line_field_and_bad_ones_are_named():
    config = load_config("cpu_smoke")
    assert config.monitor.on_phase_two == "log" and config.monitor.lambda_factor == 2.0
    config.monitor.on_phase_two = "raise_lambda"  # what --config.monitor.on_phase_two=raise_lambda sets
    validate(config, num_devices=1)
    config.monitor.on_phase_two = "panic"
    with pytest.raises(TrainConfigError, match="monitor: on_phase_two='panic'; choose log, stop or raise_lambda"):
        validate(config, num_devices=1)


def test_mesh_that_does_not_divide_the_devices_fails_naming_it():
    config = load_config("qwen7b")
    with pytest.raises(TrainConfigError, match=r"mesh.shape=\(1, -1, 4\) does not divide the 6 devices"):
        validate(config, num_devices=6)


def test_sweep_expands_the_grid_in_order_and_validates_every_run(tmp_path):
    grid = (("rl.llds_coef", (0.0, 0.1)), ("rl.llds_gate", ("action", "response")))
    assert expand_grid(grid) == [
        {"rl.llds_coef": 0.0, "rl.llds_gate": "action"}, {"rl.llds_coef": 0.0, "rl.llds_gate": "response"},
        {"rl.llds_coef": 0.1, "rl.llds_gate": "action"}, {"rl.llds_coef": 0.1, "rl.llds_gate": "response"}]
    config = load_config("sweep_llds")
    config.sweep.base_config = str(REPO / "configs" / "cpu_smoke.py")
    config.sweep.workdir_root = str(tmp_path)
    config.sweep.num_devices = 1
    runs = plan(config)
    assert len(runs) == 6
    assert "--config.rl.llds_coef=0.01" in runs[2][1] and "--config.rl.llds_gate=action" in runs[2][1]
    config.sweep.grid = (("train.mini_batch_size", (3,)),)
    with pytest.raises(TrainConfigError, match="sweep run 'mini_batch_size=3'.*train.mini_batch_size=3"):
        plan(config)
    config.sweep.grid = (("rl.llds_gate", ("action", "acton")),)  # caught before any run starts
    with pytest.raises(TrainConfigError, match="sweep run 'llds_gate=acton'.*rl.llds_gate = 'acton' is not one of"):
        plan(config)


def _flat(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items"):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_the_lab_spiral_sweep_is_both_arms_over_three_seeds_of_the_documented_setting(monkeypatch):
    """docs/death_spiral_lab.md's group-size-8 runs as one sweep: the arms differ only in λ, and the
    setting differs from the default lab run only in the hyperparameters the doc names."""
    monkeypatch.chdir(REPO)  # the sweep names its base config relative to the checkout
    changed = dict(set(_flat(load_config("lab_spiral"))) - set(_flat(load_config("lab_grpo"))))
    assert changed == {"workdir": "runs/lab_spiral", "rollout.n_samples": 8, "train.mini_batch_size": 16,
                       "train.micro_batch_size": 16, "train.logprob_batch_size": 32, "train.total_steps": 300,
                       "train.save_every": 50, "optim.lr": 3e-4, "optim.warmup_ratio": 20 / 300}, changed
    assert int(changed["optim.warmup_ratio"] * changed["train.total_steps"]) == 20  # the runs' 20 warm-up steps
    config = load_config("sweep_lab_spiral")
    config.sweep.num_devices = 1
    runs = plan(config)  # resolves and validates every run
    assert [name for name, _ in runs] == [f"llds_coef={lam}+seed={seed}" for lam in (0.0, 0.1) for seed in (0, 1, 2)]
    assert all("--config=configs/lab_spiral.py" in args for _, args in runs)


def test_the_smollm2_transfer_is_the_default_job_with_the_lab_spirals_step_shape():
    """Issue 17 item 5: only the step's shape (groups of 8, four updates per step), the lr schedule,
    λ = 0 and the checkpoint cadence differ from the default job; the same two CPU devices fit it."""
    config = load_config("lab_transfer_smollm2")
    changed = dict(set(_flat(config)) - set(_flat(load_config("cpu_smoke"))))
    assert changed == {"workdir": "runs/lab_transfer_smollm2", "rl.llds_coef": 0.0,
                       "rollout.n_samples": 8, "train.total_steps": 200, "train.save_every": 10,
                       "optim.lr": 1e-5, "optim.warmup_ratio": 10 / 200}, changed
    assert "16 / 4 = 4 sequential optimizer updates" in batch_arithmetic(validate(config, num_devices=2), num_devices=2)


@pytest.mark.parametrize("field, value, message", [
    ("llds_gate", "acton", "rl.llds_gate = 'acton' is not one of"),
    ("ratio_max", 1.1, "rl.ratio_max = 1.1 must be 0 .off. or above 1 . rl.clip_high"),
    ("ma_search_count", "all", "rl.ma_search_count = 'all' is not one of"),
])
def test_a_bad_rl_field_fails_the_config_check_before_any_weight_is_loaded(field, value, message):
    config = load_config("cpu_smoke")
    config.rl[field] = value
    with pytest.raises(ValueError, match=message):
        validate(config, num_devices=1)


def test_first_step_lr_zero_is_a_flag():
    optim = base_config().optim
    optim.warmup_ratio, optim.lr = 0.5, 1.0
    assert [float(learning_rate(s, optim, 10)) for s in (0, 1, 5, 9)] == pytest.approx([0.0, 0.2, 1.0, 1.0])
    optim.lr_first_step_zero = False
    assert [float(learning_rate(s, optim, 10)) for s in (0, 4, 5)] == pytest.approx([0.2, 1.0, 1.0])


def test_prompt_iterator_resumes_exactly_from_its_saved_state():
    records = load_questions(["bundled:nq_train", "bundled:hotpotqa_train"])
    first = PromptIterator(records, batch_size=64, seed=3)
    for _ in range(12):  # crosses an epoch boundary (744 // 64 = 11 batches per epoch)
        next(first)
    saved = json.loads(json.dumps(first.state_dict()))
    expected = [next(first).uids for _ in range(3)]
    resumed = PromptIterator(records, batch_size=64, seed=3)
    resumed.load_state_dict(saved)
    assert saved["epoch"] == 1
    for want in expected:
        np.testing.assert_array_equal(next(resumed).uids, want)
    with pytest.raises(ValueError, match="saved for 744 questions"):
        PromptIterator(records[:10], batch_size=2).load_state_dict(saved)


def test_bundled_data_is_small_and_loads_with_the_shared_loader():
    size = sum(p.stat().st_size for p in BUNDLED_DIR.glob("*.json*"))
    assert size <= 5_000_000, size
    nq = load_questions(["bundled:nq_train"])
    assert len(nq) == 674 and nq[0].data_source == "nq" and nq[0].golden_answers
    assert len(load_questions(["bundled:hotpotqa_train"])) == 70
    with pytest.raises(FileNotFoundError, match="no bundled question file 'nope'"):
        load_questions(["bundled:nope"])


def test_the_data_parallel_size_comes_from_the_rules_table():
    """Config checks, packing and the planner read ``batch``'s mesh axes from the table (before: data × fsdp
    by position in ``mesh.shape``), so a table that keeps the batch off ``fsdp`` changes all of them."""
    import jax

    from llds_jax.config import data_parallel_size
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.rules import ShardingRules, use_rules
    from llds_jax.rollout.memory import data_devices_of_ambient_mesh
    from llds_jax.train.packing import data_parallel_size as packing_data_parallel_size

    config = base_config()
    config.mesh.shape = (2, 4, 1)
    mesh = make_mesh((2, 4, 1))
    assert data_parallel_size(config, 8) == packing_data_parallel_size(mesh) == 8
    data_only = ShardingRules.from_mapping(batch="data")
    with use_rules(data_only), jax.set_mesh(mesh):
        assert data_parallel_size(config, 8) == data_devices_of_ambient_mesh() == 2
    assert packing_data_parallel_size(mesh, data_only) == data_only.shards("batch", {"data": 2, "fsdp": 4}) == 2
    assert data_only.shards("batch", mesh, size=3) == 1  # 2 does not divide 3 rows: replicated


def test_bundled_corpus_holds_no_protocol_markup():
    """The shared wiki subset holds passages scraped from Search-R1 observations (``<search>``, ``<information>``,
    ``Doc 1(Title:`` inside); retrieved into an observation they would show the policy tags it did not write."""
    from llds_jax.data.make_bundle import has_protocol_markup

    assert has_protocol_markup('x <search> q </search>\n\n<information>Doc 1(Title: "T") y</information>')
    assert has_protocol_markup("Doc 12(Title: T) text") and has_protocol_markup("<answer> x")
    assert not has_protocol_markup("the search for information (Title IX) <b>bold</b>")
    with open(BUNDLED_DIR / "corpus.jsonl") as handle:
        marked = [row["id"] for row in map(json.loads, handle) if has_protocol_markup(row["contents"])]
    assert not marked, f"bundled passages with protocol markup: {marked}"


def test_metrics_writer_writes_flat_strict_json_and_tensorboard(tmp_path):
    lines = []
    with MetricsWriter(tmp_path, console=lines.append, loggers=("tensorboard",)) as writer:
        writer.write(0, {"reward": {"mean": np.float32(0.25)}, "llds/value": float("nan")})
    rows = read_metrics(tmp_path)
    assert rows[0]["reward/mean"] == 0.25 and rows[0]["llds/value"] is None and rows[0]["phase"] == "rl"
    assert "reward=0.250" in lines[0]
    assert list((tmp_path / "tensorboard").glob("events.*"))


def test_synthetic_warmup_trajectories_mask_feedback_exactly_like_rollouts(qwen_tokenizer):
    from llds_jax.retrieval.config import default_retrieval_config
    from llds_jax.retrieval.factory import build_retriever
    from llds_jax.retrieval.short_docs import ShortDocsRetriever
    from llds_jax.rollout.config import default_config
    from llds_jax.rollout.trajectory import collate
    from llds_jax.sampling.token_bytes import vocab_bytes
    from llds_jax.train.sft import collate_sft, synthetic_trajectories

    records = load_questions(["bundled:nq_train"])[:3]
    retriever = ShortDocsRetriever(build_retriever(default_retrieval_config()), qwen_tokenizer, 20)
    examples = synthetic_trajectories(records, qwen_tokenizer, retriever, default_config())
    vocab = vocab_bytes(qwen_tokenizer)
    rollout = collate(examples, vocab, pad_id=0, pad_to_multiple=1)  # the rollout's own layout
    arrays = collate_sft(examples, 400, pad_id=0)
    for row, record in enumerate(records):
        ids = rollout.input_ids[row]
        text = qwen_tokenizer.decode(ids[rollout.action_mask[row]])
        feedback = qwen_tokenizer.decode(ids[rollout.feedback_mask[row]])
        assert "<search>" in text and f"<answer> {record.golden_answers[0]} </answer>" in text
        assert "<information>" not in text and "Doc 1(Title:" not in text
        assert feedback.startswith("\n\n<information>Doc 1(Title:") and feedback.endswith("</information>\n\n")
        assert rollout.answers[row] == record.golden_answers[0] and rollout.action_feedback[row] == ["search", None]
    width = rollout.input_ids.shape[1]
    assert arrays["input_ids"].shape == (3, 400)
    np.testing.assert_array_equal(arrays["input_ids"][:, :width], rollout.input_ids)
    np.testing.assert_array_equal(arrays["action_mask"][:, :width], rollout.action_mask)
    np.testing.assert_array_equal(arrays["attention_mask"][:, :width], rollout.attention_mask)
    assert not arrays["attention_mask"][:, width:].any()
    with pytest.raises(ValueError, match="sft.max_seq_len=10"):
        collate_sft(examples, 10, pad_id=0)


def test_warmup_actions_fit_the_rollouts_action_cap_and_never_cut_a_gold_answer(qwen_tokenizer, capsys):
    from llds_jax.data.benchmarks import QARecord
    from llds_jax.retrieval.config import default_retrieval_config
    from llds_jax.retrieval.factory import build_retriever
    from llds_jax.retrieval.short_docs import ShortDocsRetriever
    from llds_jax.rollout import protocol
    from llds_jax.rollout.config import default_config
    from llds_jax.train.sft import FIRST_THOUGHT, answerable_within, fitted_action, synthetic_trajectories

    def length(text):
        return len(qwen_tokenizer.encode(text, add_special_tokens=False))

    query = "who sang the theme song of the long running television series cheers"
    whole = f"{FIRST_THOUGHT}<search> {query} </search>"
    bare = length(f"<search> {query} </search>")
    assert fitted_action(qwen_tokenizer, FIRST_THOUGHT, "search", [query], length(whole)) == \
        qwen_tokenizer.encode(whole, add_special_tokens=False)
    # Over the cap: the thought goes first, then the query's last words.
    assert qwen_tokenizer.decode(fitted_action(qwen_tokenizer, FIRST_THOUGHT, "search", [query], bare)) == \
        f"<search> {query} </search>"
    cut = qwen_tokenizer.decode(fitted_action(qwen_tokenizer, FIRST_THOUGHT, "search", [query], bare - 3, cut_words=True))
    assert cut.startswith("<search> who sang the theme") and cut.endswith(" </search>") and length(cut) <= bare - 3
    with pytest.raises(ValueError, match=f"needs {length('<search> who </search>')} tokens > rollout.max_action_tokens=3"):
        fitted_action(qwen_tokenizer, FIRST_THOUGHT, "search", [query], 3, cut_words=True)
    # An answer takes the first alias that fits and is never cut; none fitting names the knob.
    aliases = ["Gary Portnoy and Judy Hart Angelo", "Gary Portnoy"]
    fits = length("<answer> Gary Portnoy </answer>")
    assert qwen_tokenizer.decode(fitted_action(qwen_tokenizer, "", "answer", aliases, fits)) == \
        "<answer> Gary Portnoy </answer>"
    with pytest.raises(ValueError, match=f"needs {fits} tokens > rollout.max_action_tokens={fits - 1}"):
        fitted_action(qwen_tokenizer, "", "answer", aliases, fits - 1)
    # The warm-up leaves out, up front and counted, the questions no gold answer of which fits.
    long_only = QARecord("q2", "who wrote it", ("Gary Portnoy and Judy Hart Angelo",), "nq")
    records = [QARecord("q1", "who sang cheers", tuple(aliases), "nq"), long_only]
    assert answerable_within(records, qwen_tokenizer, fits) == records[:1]
    assert "1 of 2 questions have no gold answer within rollout.max_action_tokens" in capsys.readouterr().out
    with pytest.raises(ValueError, match=f"rollout.max_action_tokens={fits - 1} tokens"):
        answerable_within(records, qwen_tokenizer, fits - 1)

    cfg = default_config()
    cfg.max_action_tokens = 24
    records = load_questions(["bundled:nq_train", "bundled:hotpotqa_train"])[:40]
    retriever = ShortDocsRetriever(build_retriever(default_retrieval_config()), qwen_tokenizer, 20)
    examples = synthetic_trajectories(records, qwen_tokenizer, retriever, cfg)
    actions = [action for ex in examples for action in ex.actions]
    assert len(actions) == 2 * len(records) and max(len(action.ids) for action in actions) <= 24
    assert all(ex.actions[1].answer_token_span() is not None for ex in examples)
    queries = [protocol.format_question(r.question).rstrip("?") for r in records]
    assert sum(length(f"{FIRST_THOUGHT}<search> {q} </search>") > 24 for q in queries) > len(records) // 2  # the cap bit
