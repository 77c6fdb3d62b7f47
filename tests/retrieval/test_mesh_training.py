"""``retrieval.method="mesh"`` inside the trainer (issue 59): the default job trains over the mesh index,
its rollouts read the same feedback as over faiss Flat, the index lies on the trainer's own mesh, and the
rollout searches it in-process with one batched call per turn.

Why these tests: the search being exact (``test_mesh.py``) says nothing about a training run. The run
must build the index over the devices it trains on (not a mesh of its own), the rollout must call it
in-process, and the feedback the policy reads — and so every token sampled after it, every reward and
every update — must not change when the host's faiss ``IndexFlatIP`` is swapped for the devices. One
shortened default job runs over the mesh index; its recorded searches are then asked of faiss Flat
(``--mode=replay``'s comparison): equal feedback for every query the run sampled is the same run, for
the price of one run instead of two. Both retrievers search one set of MiniLM vectors of a 301-row cut
of the bundled corpus (an odd count: the mesh pads it over the devices); queries are encoded by the
configured encoder.

The run is the default job with its policy swapped for the tiny random model (``tiny:qwen2``, the Qwen
tokenizer): the comparison needs rollouts that search, not a model that answers, and this file cost 504
CPU-s with SmolLM2's run, 226 with the tiny model's (a loaded 2-core VM). A random model writes no
``<search>`` either, so the job's own format warm-up (synthetic trajectories whose documents come from the
same mesh retriever) runs first, at a learning rate a tiny model learns the fixed tag template from, and
the rollout samples at T = 0.5 (below). Its queries are a few of the question words ("who the answer"),
so BM25's documents for them still differ from the dense index's; the rollout's caps, the retriever and
the replay are the default job's.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from llds_jax.errors import InputError
from llds_jax.models.loading import load_tokenizer
from llds_jax.retrieval import Corpus, DenseRetriever, build_retriever
from llds_jax.retrieval.config import BUNDLED_CORPUS
from llds_jax.retrieval.dense import build_dense_index
from llds_jax.retrieval.mesh import MeshRetriever
from llds_jax.rollout.feedback_replay import replay_feedback
from tests.codegen_sensitive import child_xla_flags
from tests.processes import finish

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROWS = 301
# The smallest run whose rollouts search: the tiny random model writes no <search>, so the default job's
# format warm-up runs first (its synthetic trajectories' documents come from the same retriever), at a rate
# that teaches a tiny model the tag template (the job's 1e-4 is SmolLM2's fine-tuning rate): after 80 steps
# at 1e-2 it writes "<think> I need to find information about this question. </think>\n<search>" but then a
# query of random words, which at T = 1 often runs past the action cap before "</search>" (3 of 8 searched);
# sampled at T = 0.5 the learned closing tag comes soon enough.
WARMUP_STEPS = 70
SFT_LR = 1e-2
TEMPERATURE = 0.5
RL_STEPS = 1
TRAJECTORIES = 8  # the default job's 2 prompts x 4 samples: every one is written to samples.jsonl
# One device, as a user's CPU run has: simulated devices' collectives abort after 40 s without a peer, which a
# loaded 2-core machine reaches. The index on several of the trainer's devices: the in-process tests above.
RUN_DEVICES = 1


def load_default_job():
    spec = importlib.util.spec_from_file_location("cpu_smoke", REPO / "configs" / "cpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def cut(tmp_path_factory, make_embedder):
    """The bundled corpus's first 301 rows, MiniLM-embedded into one index directory holding both the
    ``embeddings/`` the mesh index reads and the ``faiss/Flat.faiss`` the dense retriever reads."""
    folder = tmp_path_factory.mktemp("mesh_training")
    corpus_path = folder / "corpus.jsonl"
    with open(BUNDLED_CORPUS, "rb") as src, open(corpus_path, "wb") as dst:
        dst.writelines(itertools.islice(src, ROWS))
    index_dir = folder / "index"
    build_dense_index(Corpus(corpus_path), make_embedder(batch_size=32), index_dir, "Flat", 128, "minilm",
                      show_progress=False)
    return {"corpus": corpus_path, "index": index_dir}


def policy_fields(shared_dir: Path) -> dict:
    """The default job's policy swapped for the tiny random model over the Qwen tokenizer."""
    return {"model.source": "tiny:qwen2", "model.tokenizer": str(shared_dir / "assets" / "qwen2_tokenizer")}


def job_config(fields: dict):
    """The default job with ``fields`` (dotted names) set."""
    config = load_default_job()
    for field, value in fields.items():
        section, name = field.split(".")
        config[section][name] = value
    return config


def retrieval_fields(cut, method: str) -> dict:
    return {"retrieval.method": method, "retrieval.corpus_path": str(cut["corpus"]),
            "retrieval.index_path": str(cut["index"])}


def test_the_trainer_places_the_mesh_index_on_its_own_mesh(cut, shared_dir):
    """``app.run`` hands its mesh to the factory: the index's shards are the trainer's devices, over every
    axis, or over ``retrieval.mesh_axis`` only (replicated over the rest); an axis the trainer's mesh
    lacks is refused by the config check, before any weight is loaded."""
    from llds_jax.app.run import load_policy_and_retriever
    from llds_jax.config import validate_sections
    from llds_jax.parallel.mesh import make_mesh

    config = job_config({**policy_fields(shared_dir), **retrieval_fields(cut, "mesh")})
    for shape, axis, shards, spec in (((-1, 1, 1), "", 8, P(("data", "fsdp", "tensor"), None)),
                                      ((2, 4, 1), "fsdp", 4, P(("fsdp",), None))):
        config.mesh.shape, config.retrieval.mesh_axis = shape, axis
        validate_sections(config)  # the batch sizes are the 1-device job's: the sections alone
        mesh = make_mesh(tuple(config.mesh.shape))
        _, _, retriever = load_policy_and_retriever(config, mesh)
        index = retriever.retriever.index  # through the retrieval.max_doc_tokens view
        assert index.mesh is mesh and index.vectors.sharding.mesh == mesh
        assert index.vectors.sharding.device_set == set(mesh.devices.flat) == set(jax.devices())
        assert index.num_shards == shards and index.vectors.sharding.spec == spec
        assert index.padded_passages == ROWS + 3, "301 rows padded to 304 over 8 or 4 shards, none dropped"
    config.retrieval.mesh_axis = "passages"
    with pytest.raises(InputError, match=r"retrieval.mesh_axis='passages' names \['passages'\], not axes of the "
                                         r"trainer's mesh"):
        validate_sections(config)


def test_the_waves_rollout_calls_the_mesh_index_once_per_turn_with_every_query(cut, qwen_tokenizer):
    """In-process and batched: each turn's queries reach the index as one device program, and the
    feedback the rows read is the faiss-Flat retriever's."""
    from llds_jax.rollout import default_config, run_rollouts, terminator_ids
    from llds_jax.rollout.action_stop import action_stop_table
    from llds_jax.rollout.scripted_policy import ScriptedPolicy
    from llds_jax.sampling import vocab_bytes

    r = load_default_job().retrieval
    r.update({field.split(".")[1]: value for field, value in retrieval_fields(cut, "mesh").items()})
    r.max_doc_tokens = 0  # whole passages: the cut view needs a policy tokenizer and is not under test here
    mesh_retriever = build_retriever(r, mesh=jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)))
    assert isinstance(mesh_retriever, MeshRetriever) and mesh_retriever.index.num_shards == 8
    calls = []
    search = mesh_retriever.index.search
    mesh_retriever.index.search = lambda queries, k: calls.append((len(queries), k)) or search(queries, k)
    dense = DenseRetriever.load(cut["index"], "Flat", mesh_retriever.embedder, Corpus(cut["corpus"]))

    rows = [["<search> river in europe </search>", "<search> nobel prize </search>", "<answer> x </answer>"],
            ["<search> tamil film director </search>", "<answer> y </answer>"],
            ["<search> album </search>", "<search> football club </search>", "<answer> z </answer>"]]
    cfg = default_config()
    cfg.n_samples, cfg.max_turns = 1, 2
    batches = {}
    for name, retriever in (("mesh", mesh_retriever), ("dense", dense)):
        streams = [[qwen_tokenizer.encode(turn, add_special_tokens=False) for turn in row] for row in rows]
        policy = ScriptedPolicy(streams, action_stop_table(vocab_bytes(qwen_tokenizer)),
                                stop_token_ids=terminator_ids(qwen_tokenizer),
                                filler_id=qwen_tokenizer.encode("!")[0])
        batches[name] = run_rollouts(policy, qwen_tokenizer, ["q"] * len(rows), retriever, cfg,
                                     group_ids=list(range(len(rows))))
    assert calls == [(3, cfg.topk), (2, cfg.topk)], "one index call per turn, carrying all of the turn's searches"
    assert batches["mesh"].response_texts == batches["dense"].response_texts
    assert (batches["mesh"].input_ids == batches["dense"].input_ids).all()
    assert all(text.count("<information>") == len(row) - 1 for text, row in zip(batches["mesh"].response_texts, rows))


def train_command(workdir: Path, cut, method: str, shared_dir: Path) -> list[str]:
    overrides = {
        "workdir": str(workdir), **policy_fields(shared_dir), **retrieval_fields(cut, method),
        "train.warmup_sft_steps": WARMUP_STEPS, "sft.lr": SFT_LR, "rollout.temperature": TEMPERATURE,
        "train.total_steps": RL_STEPS, "train.samples_per_step": TRAJECTORIES, "eval.data": "",
        "train.export_hf": False, "train.loggers": "()",
    }
    return [sys.executable, "-m", "llds_jax.main", "--config=configs/cpu_smoke.py",
            *(f"--config.{k}={v}" for k, v in overrides.items())]


def run_to_end(cmd: list[str], log: Path, timeout: float = 1500) -> None:
    """One ``python -m llds_jax.main`` as a user starts it, on one device. Under the second code generator its
    LLVM level is raised to 1: the run is 70 warm-up steps of compute, and level 0's slower code cost more than
    its faster compile (the file's CPU-s under that generator: 432 at level 0, 238 at level 1)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(RUN_DEVICES, min_llvm_level=1))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    finish(proc, log, timeout)


@pytest.fixture(scope="module")
def mesh_run(cut, tmp_path_factory, shared_dir):
    """The default job, shortened and on the tiny model, over the mesh index. Cost: ≈ 3.5 min on the 2-core
    VM (warm-up 87-95 s, RL step 50-100 s, mostly compiling); one run, where comparing two whole runs cost twice
    that."""
    root = tmp_path_factory.mktemp("runs")
    workdir, log = root / "mesh", root / "mesh.log"
    run_to_end(train_command(workdir, cut, "mesh", shared_dir), log)
    return {"workdir": workdir, "log": log.read_text(), "policy": policy_fields(shared_dir),
            "samples": [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()],
            "metrics": [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]}


def replay(run: dict, retriever_fields: dict):
    """The run's recorded searches asked of the retriever ``retriever_fields`` configure, as ``--mode=replay``
    asks them (the job's ``max_doc_tokens`` cut in the run's policy tokens, its ``topk`` and ``max_obs_tokens``)."""
    config = job_config({**run["policy"], **retriever_fields})
    tokenizer = load_tokenizer(config.model)  # model.tokenizer: the Qwen tokenizer the run sampled with
    return replay_feedback([s["response"] for s in run["samples"]], build_retriever(config.retrieval, tokenizer),
                           tokenizer, int(config.rollout.topk), int(config.rollout.max_obs_tokens))


def test_a_default_job_run_over_the_mesh_index_reads_the_faiss_flat_feedback_for_its_queries(mesh_run, cut):
    """Every ``<information>`` block the run's rollouts read is, character for character, what faiss
    ``IndexFlatIP`` over the same vectors returns for the block's query: the same feedback tokens, so the
    same run (sampled tokens, rewards and updates follow from the feedback). The rollouts did search (the
    comparison is not vacuous), and a different retriever (BM25 on the same passages) is told apart."""
    assert len(mesh_run["samples"]) == RL_STEPS * TRAJECTORIES
    report = replay(mesh_run, retrieval_fields(cut, "dense"))
    assert report.searches > 0, "no rollout searched: the warm-up did not teach the format"
    assert report.mismatches == [], report.summary()["mismatches"][:3]
    bm25 = replay(mesh_run, {**retrieval_fields(cut, "bm25"), "retrieval.index_path": str(cut["index"].parent / "bm25")})
    assert bm25.searches == report.searches and bm25.mismatches, "BM25's documents differ from the dense index's"


def test_the_mesh_run_trains_its_warm_up_and_rl_steps_over_the_mesh_retriever(mesh_run):
    phases = [m["phase"] for m in mesh_run["metrics"]]
    assert phases.count("sft") == WARMUP_STEPS and phases.count("rl") == RL_STEPS
    assert "mesh retriever ready" in mesh_run["log"]
