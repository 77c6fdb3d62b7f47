"""Build (or find cached) the lab's world, tokenizer and policy, and point the config at them.

``llds_jax.main`` calls :func:`prepare` when a config has a ``lab`` section, before any mode
runs, so ``python -m llds_jax.main --config=configs/lab_grpo.py`` works from a fresh clone. The
trainer itself knows nothing of the lab: it gets a corpus path, question files and an HF model
directory, like any run.

Config values written ``lab:<artifact>`` are replaced by the built artifact's path
(``lab:corpus``, ``lab:train``, ``lab:dev``, ``lab:policy``); any other value is left alone,
so a user can point one field elsewhere. Artifacts live under ``lab.dir`` (default
``<LLDS_JAX_CACHE>/lab``) in directories named by a hash of exactly the settings they depend on:
changing the policy's SFT steps rebuilds the policy but reuses the world. Each is built in a
temporary directory and renamed, so an interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import ml_collections

from llds_jax.errors import InputError
from llds_jax.lab.policy import DEFAULT_POLICY, FREEFORM_FIELDS, GATE_FIELDS, check_policy_settings
from llds_jax.lab.world import (
    DEFAULT_WORLD,
    check_world_settings,
    generate_world,
    question_files,
    write_world,
)
from llds_jax.utils.assets import cache_dir

LAB_VERSION = 2  # bump when a builder's output changes for the same settings
SENTINELS = ("lab:corpus", "lab:train", "lab:dev", "lab:policy")


class PolicyBelowGateError(InputError):
    """The built policy's greedy check is below ``lab.policy.min_build_em``: RL on it would be noise."""


def check_build_gate(policy_dir: Path, min_em: float) -> None:
    """Fail naming ``lab_build.json``'s EM and the settings to change when one-hop EM < ``min_em``.

    Why a gate: a policy that does not copy names out of passages gets reward only by guessing,
    most GRPO groups have zero advantage, and a run on it says nothing about the death spiral.
    """
    if min_em <= 0:
        return
    record_path = policy_dir / "lab_build.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    check = record.get("check")
    if not check or "nq" not in check:
        raise PolicyBelowGateError(
            f"lab.policy.min_build_em={min_em} needs a greedy one-hop check, but {record_path} has none "
            "(set lab.policy.check_questions > 0 and lab.world.two_hop_fraction < 1, or min_build_em=0)")
    em = {source: round(scores["em"], 4) for source, scores in check.items()}
    if check["nq"]["em"] < min_em:
        raise PolicyBelowGateError(
            f"the lab policy reads too little for RL: {record_path} has greedy EM {em} (one-hop 'nq' "
            f"{check['nq']['em']:.3f} < lab.policy.min_build_em={min_em}). Change lab.policy.sft_steps / sft_lr / "
            "sft_batch_size / layers / hidden, or rollout.topk / retrieval.max_doc_tokens (shorter context), "
            "or lower lab.policy.min_build_em; the policy is cached, so delete that directory or change a setting "
            "to rebuild")


def default_lab_config() -> ml_collections.ConfigDict:
    """The ``lab`` section: where artifacts go and the settings of each."""
    return ml_collections.ConfigDict(dict(
        dir="",  # "" → <LLDS_JAX_CACHE>/lab
        world=dict(DEFAULT_WORLD),
        tokenizer=dict(vocab_size=2048),
        policy=dict(DEFAULT_POLICY),
    ))


def _digest(*parts) -> str:
    return hashlib.sha1(json.dumps([LAB_VERSION, *parts], sort_keys=True).encode()).hexdigest()[:12]


def _built(target: Path, build: Callable[[Path], object]) -> Path:
    """``target`` if it exists, else ``build(tmp)`` renamed to ``target`` (a racing builder's copy wins)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _non_empty(files) -> tuple[str, ...]:
    return tuple(f for f in files if Path(f).stat().st_size > 0)


def _replace(config, path: str, sentinel: str, value) -> None:
    section, field = path.split(".")
    current = config[section][field]
    if current == sentinel or (isinstance(current, (tuple, list)) and tuple(current) == (sentinel,)):
        config[section][field] = value


def prepare(config: ml_collections.ConfigDict, log=print) -> ml_collections.ConfigDict:
    """Build what is missing, then return ``config`` with its ``lab:*`` values replaced by paths."""
    from transformers import AutoTokenizer

    lab = config.lab
    world_settings = check_world_settings(lab.world.to_dict())
    policy_settings = check_policy_settings(lab.policy.to_dict())
    vocab_size = lab.tokenizer.vocab_size
    root = Path(lab.dir).expanduser() if lab.dir else cache_dir() / "lab"

    world_dir = _built(root / f"world-{_digest(world_settings)}",
                       lambda d: write_world(generate_world(world_settings), d))
    train_files = _non_empty(question_files(world_dir, "train"))
    dev_files = _non_empty(question_files(world_dir, "dev"))
    corpus = str(world_dir / "corpus.jsonl")

    def build_tokenizer(directory: Path) -> None:
        from llds_jax.lab.tokenizer import train_tokenizer

        train_tokenizer(generate_world(world_settings), vocab_size, directory)

    tokenizer_dir = _built(root / f"tokenizer-{_digest(world_settings, vocab_size)}", build_tokenizer)

    # The SFT trajectories see the run's retrieval cut and feedback limits, so those join the hash.
    retrieval_view = dict(topk=config.rollout.topk, max_obs_tokens=config.rollout.max_obs_tokens,
                          max_prompt_tokens=config.rollout.max_prompt_tokens,
                          max_doc_tokens=config.retrieval.max_doc_tokens)
    # The free-form writing fields join the hash only when they are in use, so the first world's
    # cached policies (built before the fields existed, byte-identical output) stay valid.
    built_settings = {k: v for k, v in policy_settings.items() if k not in GATE_FIELDS
                      and not (k in FREEFORM_FIELDS and policy_settings["writing"] == "fixed")}
    policy_key = _digest(world_settings, vocab_size, built_settings, retrieval_view)

    def build_policy(directory: Path) -> None:
        from llds_jax.data.prompts import load_questions
        from llds_jax.lab.policy import pretrain_policy
        from llds_jax.lab.world import read_questions
        from llds_jax.retrieval.factory import build_retriever

        log(f"lab: pre-training the tiny policy ({policy_settings['sft_steps']} SFT steps) into {directory}")
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        retrieval = config.retrieval.copy_and_resolve_references()
        retrieval.corpus_path, retrieval.method, retrieval.url, retrieval.index_path = corpus, "bm25", "", ""
        retriever = build_retriever(retrieval, tokenizer)
        rows = [row for f in train_files for row in read_questions(f)]
        check = []
        if policy_settings["check_questions"]:
            per_source = max(1, policy_settings["check_questions"] // len(dev_files))
            check = load_questions(dev_files, per_source)
        pretrain_policy(config, policy_settings, tokenizer, retriever, rows, directory, check, log=log)

    policy_dir = _built(root / f"policy-{policy_key}", build_policy)
    log(f"lab: world {world_dir.name}, tokenizer {tokenizer_dir.name}, policy {policy_dir.name} under {root}")
    check_build_gate(policy_dir, float(policy_settings["min_build_em"]))

    _replace(config, "retrieval.corpus_path", "lab:corpus", corpus)
    _replace(config, "data.train", "lab:train", train_files)
    _replace(config, "sft.data", "lab:train", train_files)
    _replace(config, "eval.data", "lab:dev", ",".join(dev_files))
    _replace(config, "model.source", "lab:policy", str(policy_dir))
    return config
