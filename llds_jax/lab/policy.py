"""The lab's tiny policy: a Qwen2-family decoder pre-trained from scratch on protocol trajectories.

Why from scratch: GRPO needs a policy that already writes ``<search>``/``<answer>`` and is right
sometimes (all-wrong or all-right groups have zero advantage). A random 2-layer decoder learns
the protocol and partial copying of answers from retrieved passages in a few hundred SFT steps,
so the death spiral can be studied in minutes instead of days.

Trajectories are built by the rollout's own protocol code (prompt, feedback, masks as in
``llds_jax.train.sft``), but with the search pattern the world needs: one search for a one-hop
question, and for a two-hop one a second search naming the bridge entity the first passage gave.
The update is ``llds_jax.train.sft.SFTStep`` (masked NLL over action tokens, AdamW), unchanged.
The result is an HF directory (``config.json`` + ``model.safetensors`` + tokenizer) the trainer
loads like any model (``model.source = <dir>``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from llds_jax.errors import InputError
from llds_jax.lab.freeform import Writing
from llds_jax.retrieval.hit import format_docs
from llds_jax.rollout import protocol

DEFAULT_POLICY = dict(
    seed=0,
    layers=2,
    hidden=128,
    heads=4,
    kv_heads=2,
    intermediate=512,
    sft_steps=400,
    sft_batch_size=16,
    sft_lr=3e-3,
    sft_warmup_steps=30,
    sft_max_seq_len=288,
    sft_drill_fraction=0.5,  # share of each SFT batch that is packed reading drills (see reading_drills)  # one-doc trajectories are 187–259 tokens (rollout.topk = 1)
    check_questions=32,  # greedy rollouts on dev questions after SFT, recorded in lab_build.json (0 = skip)
    # The build fails unless the greedy check's one-hop EM reaches this (0 = no gate). Not part of the
    # artifact's hash: it judges a policy, it does not change it.
    min_build_em=0.0,
    # How trajectories word thoughts and queries (llds_jax.lab.freeform.Writing): "fixed" (one thought
    # per action kind, the bare name as query) or "freeform" (Markov-chain thoughts, paraphrased queries).
    writing="fixed",
    thought_entity_prob=0.3,  # freeform: chance a thought names the entity
)
GATE_FIELDS = ("min_build_em",)  # settings that judge the built policy without changing it
FREEFORM_FIELDS = ("writing", "thought_entity_prob")  # hashed only when writing != "fixed" (prepare)



class PolicyConfigError(InputError):
    """A ``lab.policy`` value that cannot give a decoder; the message names field and value."""


def check_policy_settings(settings: Mapping) -> dict:
    unknown = set(settings) - set(DEFAULT_POLICY)
    if unknown:
        raise PolicyConfigError(f"lab.policy has unknown fields {sorted(unknown)}; known: {sorted(DEFAULT_POLICY)}")
    merged = {**DEFAULT_POLICY, **dict(settings)}
    for field, value in merged.items():
        if field == "writing":
            ok = value in ("fixed", "freeform")
        elif field in ("seed", "check_questions", "sft_warmup_steps"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        elif field in ("min_build_em", "sft_drill_fraction", "thought_entity_prob"):
            ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0
        elif field == "sft_lr":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not ok:
            raise PolicyConfigError(f"lab.policy.{field}={value!r} is not valid "
                                    f"({'a number in [0, 1]' if field in ('min_build_em', 'sft_drill_fraction') else 'positive number'} expected)")
    if merged["hidden"] % merged["heads"] or (merged["hidden"] // merged["heads"]) % 2:
        raise PolicyConfigError(f"lab.policy.hidden={merged['hidden']} must split into lab.policy.heads="
                                f"{merged['heads']} heads of even width")
    if merged["heads"] % merged["kv_heads"]:
        raise PolicyConfigError(f"lab.policy.heads={merged['heads']} is not a multiple of "
                                f"lab.policy.kv_heads={merged['kv_heads']}")
    return merged


def _expected(field: str) -> str:
    if field == "writing":
        return "'fixed' or 'freeform'"
    return "a number in [0, 1]" if field in ("min_build_em", "sft_drill_fraction", "thought_entity_prob") \
        else "positive number"


def writing_for(settings: Mapping, rng: np.random.Generator) -> Writing:
    """The trajectories' :class:`Writing` of checked ``lab.policy`` settings (``DEFAULT_POLICY`` merged), drawing from ``rng``."""
    return Writing(settings["writing"], rng, settings["seed"], settings["thought_entity_prob"])


def hf_config(settings: Mapping, tokenizer) -> dict:
    """The HF ``Qwen2Config`` of the policy (written through transformers, so the file is a real one)."""
    from transformers import Qwen2Config

    from llds_jax.models.loading import padded_vocab

    config = Qwen2Config(
        vocab_size=padded_vocab(len(tokenizer)), hidden_size=settings["hidden"],
        num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
        num_key_value_heads=settings["kv_heads"], intermediate_size=settings["intermediate"],
        max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return config.to_dict()


def init_decoder(hf: dict, seed: int):
    """A randomly initialised decoder of ``hf`` (N(0, INIT_STD) weights, unit norms), numpy-seeded."""
    import jax.numpy as jnp
    from flax import nnx

    from llds_jax.models.config import DecoderConfig
    from llds_jax.models.decoder import INIT_STD, Decoder
    from llds_jax.parallel.placement import iter_params

    config = DecoderConfig.from_hf_config(hf)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for name, var in iter_params(model):
        is_norm = name.rsplit(".", 1)[-1].endswith("norm")
        value = np.ones(var.shape, np.float32) if is_norm else INIT_STD * rng.standard_normal(var.shape, np.float32)
        var.set_value(jnp.asarray(value, dtype=config.weight_dtype))
    return model


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _searches(rows: Sequence[dict], retriever, topk: int, writing: Writing | None = None) -> tuple[list, list]:
    """(query, hits) of each row's first search (its entity) and, for two-hop rows, of the bridge search."""
    writing = writing or Writing()
    first = [writing.query(row["metadata"].get("entity") or protocol.format_question(row["question"]).rstrip("?"))
             for row in rows]
    bridges = [writing.query(row["metadata"]["bridge"]) for row in rows if row["metadata"]["hops"] == 2]
    bridge_hits = iter(zip(bridges, retriever.search(bridges, topk)) if bridges else [])
    second = [next(bridge_hits) if row["metadata"]["hops"] == 2 else None for row in rows]
    return list(zip(first, retriever.search(first, topk))), second


def _episode(tokenizer, row: dict, first, bridge, rollout_cfg, thoughts: bool,
             writing: Writing | None = None) -> list[tuple[list[int], int]]:
    """(ids, kind) pieces after the question: kind 1 = action (trained), 2 = feedback (masked)."""
    writing = writing or Writing()
    query, hits = first
    entity = row["metadata"].get("entity", "")
    think = (lambda text: text) if thoughts else (lambda text: "")
    pieces = [(_encode(tokenizer, f"{think(writing.search_thought(entity))}<search> {query} </search>"), 1),
              (protocol.encode_feedback(tokenizer, protocol.search_feedback(format_docs(hits)),
                                        rollout_cfg.max_obs_tokens), 2)]
    if row["metadata"]["hops"] == 2:
        bridge_query, bridge_hits = bridge
        thought = think(writing.bridge_thought(row["metadata"]["bridge"]))
        pieces.append((_encode(tokenizer, thought + f"<search> {bridge_query} </search>"), 1))
        pieces.append((protocol.encode_feedback(tokenizer, protocol.search_feedback(format_docs(bridge_hits)),
                                                rollout_cfg.max_obs_tokens), 2))
    pieces.append((_encode(tokenizer, f"{think(writing.answer_thought())}<answer> {row['golden_answers'][0]} </answer>"),
                   1))
    return pieces


def _example(pieces):
    from llds_jax.train.sft import SFTExample

    ids = np.concatenate([np.asarray(p, np.int32) for p, _ in pieces])
    kinds = np.concatenate([np.full(len(p), k, np.int8) for p, k in pieces])
    return SFTExample(ids, kinds == 1, kinds == 2)


def lab_trajectories(rows: Sequence[dict], tokenizer, retriever, rollout_cfg, writing: Writing | None = None) -> list:
    """One protocol-following trajectory per world question row (one search per hop), recorded as
    a rollout records its own (``Trajectory``), so the SFT masks come from the rollout's layout code.

    The first query names the question's entity, as a reader would: copying one name out of the
    question is what a tiny policy can learn (the whole question as a query also matches every
    "born in" passage).
    """
    from llds_jax.rollout.trajectory import Trajectory
    from llds_jax.sampling.decode_loop import FinishReason
    from llds_jax.sampling.token_bytes import vocab_bytes

    vocab = vocab_bytes(tokenizer)
    first, second = _searches(rows, retriever, rollout_cfg.topk, writing)
    trajectories = []
    for index, (row, hits, bridge_hits) in enumerate(zip(rows, first, second)):
        prompt = protocol.encode_prompt(tokenizer, row["question"], rollout_cfg.max_prompt_tokens)
        trajectory = Trajectory(prompt_ids=list(prompt), group_id=index)
        for ids, kind in _episode(tokenizer, row, hits, bridge_hits, rollout_cfg, True, writing):
            if kind == 1:
                trajectory.add_action(ids, [0.0] * len(ids), FinishReason.STOP_STRING, vocab)
            else:
                trajectory.add_feedback(ids, "search")
        trajectories.append(trajectory)
    return trajectories


def reading_drills(rows: Sequence[dict], tokenizer, retriever, rollout_cfg, length: int,
                   writing: Writing | None = None) -> list:
    """Sequences of back-to-back ``Question: …`` → search → passage → answer episodes, ≤ ``length`` tokens.

    Why: in a full trajectory the 120-token prompt and the fixed thoughts carry no signal; the
    2–4 tokens that need reading (the entity copied into the query, the answer copied out of the
    passage) are all the copying practice a step gives. Packing bare episodes gives the same skill
    several times per sequence, so the copy circuit forms within a few hundred steps on 2 cores.
    Each row is used once, in order; an episode that does not fit starts the next sequence.
    """
    first, second = _searches(rows, retriever, rollout_cfg.topk, writing)
    drills, current, size = [], [], 0
    for row, hits, bridge_hits in zip(rows, first, second):
        pieces = [(_encode(tokenizer, f"Question: {protocol.format_question(row['question'])}\n"), 0),
                  *_episode(tokenizer, row, hits, bridge_hits, rollout_cfg, False, writing),
                  (_encode(tokenizer, "\n"), 0)]
        n = sum(len(p) for p, _ in pieces)
        if n > length:
            continue
        if size + n > length:
            drills.append(_example(current))
            current, size = [], 0
        current.extend(pieces)
        size += n
    if current:
        drills.append(_example(current))
    return drills


def sft_config(config, settings: Mapping):
    """The run's config with the ``sft`` fields the lab's pre-training uses."""
    c = config.copy_and_resolve_references()
    c.sft.lr, c.sft.batch_size = float(settings["sft_lr"]), settings["sft_batch_size"]
    c.sft.max_seq_len, c.sft.warmup_steps = settings["sft_max_seq_len"], settings["sft_warmup_steps"]
    c.seed = settings["seed"]
    return c


def pretrain_policy(config, settings: Mapping, tokenizer, retriever, rows: Sequence[dict], directory: Path,
                    check_rows: Sequence | None = None, log=print) -> dict:
    """SFT a fresh decoder on ``rows``' trajectories, save it (HF dir + tokenizer) to ``directory``.

    Returns the build record (losses, timings, the greedy protocol check), also written to
    ``directory/lab_build.json``.
    """
    import jax

    from llds_jax.models import save_pretrained
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.placement import shard_model
    from llds_jax.rollout.multi_turn import pad_token_id
    from llds_jax.train.sft import SFTStep, collate_sft

    settings = check_policy_settings(settings)
    c = sft_config(config, settings)
    mesh = make_mesh(tuple(c.mesh.shape))
    hf = hf_config(settings, tokenizer)
    with jax.set_mesh(mesh):
        model = shard_model(init_decoder(hf, settings["seed"]), mesh)
    step = SFTStep(model, c, mesh)
    rng = np.random.default_rng(settings["seed"] + 1)
    writing = writing_for(settings, np.random.default_rng(settings["seed"] + 2))
    clock, losses = time.perf_counter(), []
    batch = settings["sft_batch_size"]
    for index in range(settings["sft_steps"]):
        drills = int(round(batch * settings["sft_drill_fraction"]))
        chosen = [rows[i] for i in rng.choice(len(rows), size=batch - drills, replace=len(rows) < batch - drills)]
        examples = lab_trajectories(chosen, tokenizer, retriever, c.rollout, writing)
        if drills:
            drill_rows = [rows[i] for i in rng.choice(len(rows), size=8 * drills, replace=len(rows) < 8 * drills)]
            examples += reading_drills(drill_rows, tokenizer, retriever, c.rollout, c.sft.max_seq_len,
                                       writing)[:drills]
        metrics = step(collate_sft(examples, c.sft.max_seq_len, pad_token_id(tokenizer)))
        losses.append(float(metrics["sft/loss"]))
        if index % 50 == 0 or index == settings["sft_steps"] - 1:
            log(f"lab policy SFT step {index}: loss {losses[-1]:.3f} ({time.perf_counter() - clock:.0f}s)")
    record = dict(settings=settings, hf_config=hf, sft_loss_first=losses[0], sft_loss_last=losses[-1],
                  sft_loss_every_10=losses[::10], sft_seconds=time.perf_counter() - clock)
    trained = step.model()
    directory.mkdir(parents=True, exist_ok=True)
    save_pretrained(trained, directory)
    tokenizer.save_pretrained(str(directory))
    if check_rows:
        record["check"] = protocol_check(trained, tokenizer, retriever, c, check_rows)
        log(f"lab policy greedy check: {record['check']}")
    (directory / "lab_build.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def protocol_check(model, tokenizer, retriever, config, records) -> dict:
    """Greedy EM per hop count through the real evaluation rollout (so 'partial accuracy' is measured)."""
    import jax

    from llds_jax.eval.run import evaluate

    grouped: dict[str, list] = {}
    for record in records:
        grouped.setdefault(record.data_source, []).append(record)
    result = evaluate(model, tokenizer, grouped, retriever, config.rollout, greedy=True,
                      key=jax.random.key(0), batch_size=min(16, len(records)))
    return {source: {k: float(v) for k, v in scores.items()} for source, scores in result.summary.items()}
