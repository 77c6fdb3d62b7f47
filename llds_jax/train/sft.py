"""Supervised format warm-up on synthetic Search-R1 trajectories (``--mode=sft``, ``train.warmup_sft_steps``).

Small instruct models (SmolLM2-135M) never close a ``<search>`` or ``<answer>`` tag zero-shot,
so EM reward is 0 for every sample, every GRPO advantage is 0, and RL learns nothing. The
standard remedy is a few supervised steps on trajectories in the protocol's exact format:

    <prompt> <think>…</think>\\n<search> {question} </search>      ← action 0 (trained)
    \\n\\n<information>Doc 1(Title: …) …</information>\\n\\n       ← feedback (masked)
    <think>…</think>\\n<answer> {gold} </answer>                  ← action 1 (trained)

The prompt and feedback come from the same code the rollout uses (``rollout.protocol``,
``retrieval.format_docs``, the real retriever), each example is a rollout ``Trajectory`` and its
masks come from the rollout's own layout (``rollout.trajectory.token_layout``), so the warm-up
conditions on the very tokens RL will see; feedback and prompt tokens carry no loss. Each action
fits ``rollout.max_action_tokens`` as a rollout's must (:func:`fitted_action`: the thought goes
first, then the query's last words; a gold answer is never cut, and questions none of whose
answers fit are left out up front, :func:`answerable_within`). The optimizer step is the RL
update's (``train.state.apply_update``). Docs are whatever the retriever returns — the trainer
hands in the same ``ShortDocsRetriever`` view the RL rollouts use when ``retrieval.max_doc_tokens``
is set.

The loss is the token-mean negative log-likelihood over action tokens, through the same
chunked ``forward_logprobs`` the RL step uses (never a [B, T, V] fp32 array), scoring at most
``sft.max_action_tokens_per_row`` positions per example when set (the action targets, gathered
in order, as the RL step does; 0 = every position).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.data.benchmarks import QARecord
from llds_jax.models.logprobs import scored_positions
from llds_jax.parallel.overlap import TRAINING_COMPILER_OPTIONS
from llds_jax.parallel.rules import current_rules, use_rules
from llds_jax.retrieval.hit import format_docs
from llds_jax.rollout import protocol
from llds_jax.rollout.trajectory import Trajectory, token_layout
from llds_jax.sampling.decode_loop import FinishReason
from llds_jax.sampling.token_bytes import vocab_bytes
from llds_jax.train.batch import (
    batch_sharding,
    check_action_tokens,
    next_token_targets,
    scored_positions_per_row,
)
from llds_jax.train.forward import forward_logprobs
from llds_jax.train.signatures import SignatureLog
from llds_jax.train.state import TrainState, apply_update, make_optimizer
from llds_jax.train.state_layout import train_state_layout

FIRST_THOUGHT = "<think> I need to find information about this question. </think>\n"
SECOND_THOUGHT = "<think> The documents contain the answer. </think>\n"


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """A hand-built example for callers that lay ids out themselves (the lab's reading drills).

    Its masks are the caller's statement of provenance; the trainer's own warm-up builds
    :class:`~llds_jax.rollout.trajectory.Trajectory` records instead (:func:`synthetic_trajectories`).
    """

    input_ids: np.ndarray  # int32 [L]
    action_mask: np.ndarray  # bool [L]: the two actions' tokens
    feedback_mask: np.ndarray  # bool [L]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _tagged(tag: str, body: str) -> str:
    return f"<{tag}> {body} </{tag}>"


def fitted_action(tokenizer, thought: str, tag: str, bodies: Sequence[str], cap: int, *,
                  cut_words: bool = False) -> list[int]:
    """The action's ids within ``cap`` tokens (``rollout.max_action_tokens``), as the rollout could write it.

    A warm-up action the rollout would cut mid-tag teaches a format RL cannot finish. The thought
    goes first, then the first of ``bodies`` that fits is used (an answer's aliases: a gold answer
    is never cut), and with ``cut_words`` (a search query) the body loses its last words.
    """
    candidates = [text for body in bodies for text in (thought + _tagged(tag, body), _tagged(tag, body))]
    if cut_words:
        words = bodies[0].split()
        candidates += [_tagged(tag, " ".join(words[:n])) for n in range(len(words) - 1, 0, -1)]
    shortest = math.inf
    for text in candidates:
        if len(ids := _encode(tokenizer, text)) <= cap:
            return ids
        shortest = min(shortest, len(ids))
    raise ValueError(f"a warm-up <{tag}> action needs {shortest} tokens > rollout.max_action_tokens={cap} "
                     f"(body {bodies[0]!r}); raise rollout.max_action_tokens or set train.warmup_sft_steps=0")


def answerable_within(records: Sequence[QARecord], tokenizer, cap: int) -> list[QARecord]:
    """The records with a gold answer the rollout could write within ``cap`` action tokens.

    The rest cannot be taught (a gold answer is never cut) nor earn reward in RL; the warm-up leaves
    them out up front, counted, rather than failing on one of them mid-run.
    """
    kept = [r for r in records
            if any(len(_encode(tokenizer, _tagged("answer", a))) <= cap for a in r.golden_answers)]
    if not kept:
        raise ValueError(f"no warm-up question has a gold answer within rollout.max_action_tokens={cap} tokens; "
                         "raise it or set train.warmup_sft_steps=0")
    if len(kept) < len(records):
        print(f"warm-up: {len(records) - len(kept)} of {len(records)} questions have no gold answer within "
              f"rollout.max_action_tokens={cap} tokens and are left out", flush=True)
    return kept


def synthetic_trajectories(records: Sequence[QARecord], tokenizer, retriever, rollout_cfg) -> list[Trajectory]:
    """One think → search → feedback → think → answer trajectory per record (a gold answer).

    Recorded exactly as a rollout records its trajectories (``Trajectory.add_action`` /
    ``add_feedback``), so :func:`collate_sft` lays them out with the rollout's own code; each
    action is held to ``rollout.max_action_tokens`` (:func:`fitted_action`).
    """
    vocab = vocab_bytes(tokenizer)
    cap = int(rollout_cfg.max_action_tokens)
    hits = retriever.search([r.question for r in records], rollout_cfg.topk)
    trajectories = []
    for row, (record, row_hits) in enumerate(zip(records, hits)):
        prompt = protocol.encode_prompt(tokenizer, record.question, rollout_cfg.max_prompt_tokens)
        query = protocol.format_question(record.question).rstrip("?")
        search = fitted_action(tokenizer, FIRST_THOUGHT, "search", [query], cap, cut_words=True)
        feedback = protocol.encode_feedback(tokenizer, protocol.search_feedback(format_docs(row_hits)),
                                            rollout_cfg.max_obs_tokens)
        answer = fitted_action(tokenizer, SECOND_THOUGHT, "answer", record.golden_answers, cap)
        trajectory = Trajectory(prompt_ids=list(prompt), group_id=row)
        trajectory.add_action(search, [0.0] * len(search), FinishReason.STOP_STRING, vocab)
        trajectory.add_feedback(feedback, "search")
        trajectory.add_action(answer, [0.0] * len(answer), FinishReason.STOP_STRING, vocab)
        trajectories.append(trajectory)
    return trajectories


def collate_sft(examples: Sequence[Trajectory | SFTExample], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded [B, length] arrays; an example longer than ``length`` fails naming ``sft.max_seq_len``.

    Trajectories go through the rollout's ``token_layout`` (the masks RL trains on);
    :class:`SFTExample` s carry their own masks.
    """
    longest = max((_length(ex) for ex in examples), default=0)
    if longest > length:
        raise ValueError(f"a synthetic trajectory has {longest} tokens > sft.max_seq_len={length}; "
                         "raise sft.max_seq_len or lower retrieval.max_doc_tokens / rollout.max_obs_tokens")
    out = dict(input_ids=np.full((len(examples), length), pad_id, np.int32),
               attention_mask=np.zeros((len(examples), length), bool),
               action_mask=np.zeros((len(examples), length), np.float32))
    rows = [row for row, ex in enumerate(examples) if isinstance(ex, Trajectory)]
    if rows:
        layout = token_layout([examples[row] for row in rows], length, pad_id=pad_id)
        for key in out:
            out[key][rows] = layout[key]
    for row, ex in enumerate(examples):
        if not isinstance(ex, Trajectory):
            size = len(ex.input_ids)
            out["input_ids"][row, :size] = ex.input_ids
            out["attention_mask"][row, :size] = True
            out["action_mask"][row, :size] = ex.action_mask
    return out


def _length(example: Trajectory | SFTExample) -> int:
    return example.length if isinstance(example, Trajectory) else len(example.input_ids)


class SFTStep:
    """Jitted masked-NLL update with AdamW (``sft.lr``, constant after ``sft.warmup_steps``)."""

    def __init__(self, model: nnx.Module, config, mesh):
        rules = current_rules()  # the ambient table, as the learner's
        self.config, self.mesh, self.rules = config, mesh, rules
        optim = config.optim.copy_and_resolve_references()
        optim.lr, optim.warmup_ratio, optim.lr_first_step_zero = config.sft.lr, 0.0, False
        self.optim = optim
        with jax.set_mesh(mesh), use_rules(rules):
            layout = train_state_layout(model, config, mesh, optim=optim, with_reference=False)
            self.state: TrainState = layout.fresh(nnx.state(model, nnx.Param))
        self.graphdef, self.state_shardings = layout.graphdef, layout.shardings
        n, length = config.sft.batch_size, config.sft.max_seq_len
        self.scored = scored_positions_per_row(config, length, "sft")
        self.batch_shardings = {k: batch_sharding(mesh, rules, 2, (n, length))
                                for k in ("input_ids", "attention_mask", "action_mask")}
        self._signatures = SignatureLog()
        self._step = jax.jit(self._signatures.counted("sft_step", self._update), in_shardings=(self.state_shardings, self.batch_shardings),
                             out_shardings=(self.state_shardings, NamedSharding(mesh, PartitionSpec())),
                             donate_argnums=(0,), compiler_options=TRAINING_COMPILER_OPTIONS)

    def _update(self, state: TrainState, batch: dict[str, jax.Array]):
        cfg = self.config
        mask = next_token_targets(batch["action_mask"])  # the forward scores next-token targets
        positions = None
        if self.scored < mask.shape[1]:  # only the action targets: [B, scored], in order
            positions, valid = scored_positions(mask, self.scored)
            mask = jnp.where(valid, jnp.take_along_axis(mask, positions, axis=1), 0.0)

        def loss_fn(params):
            logp, _ = forward_logprobs(self.graphdef, params, batch["input_ids"], batch["attention_mask"],
                                       temperature=1.0, chunk_size=cfg.model.logprob_chunk_size, with_entropy=False,
                                       positions=positions)
            return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        warm = cfg.sft.warmup_steps
        lr = cfg.sft.lr * (jnp.minimum(1.0, (state.step + 1.0) / warm) if warm > 0 else 1.0)
        state, optimizer_metrics = apply_update(state, grads, loss, lr, make_optimizer(self.optim),
                                                cfg.optim.clip_norm)
        state = state.replace(step=state.step + 1)
        return state, {"sft/loss": loss, "grad/norm_preclip": optimizer_metrics["grad/norm_preclip"], "optim/lr": lr,
                       "sft/action_tokens": mask.sum(), "update/skipped": optimizer_metrics["update/skipped"]}

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        check_action_tokens(arrays["action_mask"], self.scored, "sft.max_action_tokens_per_row")
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            batch = jax.device_put({k: arrays[k] for k in self.batch_shardings}, self.batch_shardings)
            self.state, metrics = self._step(self.state, batch)
        return jax.device_get(metrics)

    def model(self) -> nnx.Module:
        """The warmed-up model (graphdef + current params), e.g. to start RL from."""
        return nnx.merge(self.graphdef, self.state.params)

    def compile_count(self) -> int:
        return self._signatures.count("sft_step")  # train.signatures: jit's cache size is evicted


def run_sft(model: nnx.Module, tokenizer, retriever, config, mesh, writer, *, steps: int,
            records: Sequence[QARecord]) -> tuple[nnx.Module, list[dict]]:
    """``steps`` warm-up updates over shuffled synthetic trajectories; returns the tuned model.

    Trajectories are built lazily, one batch at a time, so the first step starts after one
    batch of retrieval rather than after the whole dataset.
    """
    from tqdm import tqdm

    from llds_jax.data.prompts import PromptIterator
    from llds_jax.rollout.multi_turn import pad_token_id

    sft = SFTStep(model, config, mesh)
    records = answerable_within(records, tokenizer, int(config.rollout.max_action_tokens))
    prompts = PromptIterator(records, config.sft.batch_size, seed=config.seed + 1)
    history = []
    bar = tqdm(range(steps), desc="sft", unit="step", dynamic_ncols=True)
    for step in bar:
        clock = time.perf_counter()
        batch = next(prompts)
        examples = synthetic_trajectories(batch.records, tokenizer, retriever, config.rollout)
        arrays = collate_sft(examples, config.sft.max_seq_len, pad_token_id(tokenizer))
        metrics = {k: float(v) for k, v in sft(arrays).items()}
        metrics["time/step_s"] = time.perf_counter() - clock
        metrics["sft/tokens_mean"] = float(arrays["attention_mask"].sum(axis=1).mean())
        writer.write(step, metrics, phase="sft")
        bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
        history.append(metrics)
    bar.close()
    if sft.compile_count() != 1:
        raise RuntimeError(f"the SFT step compiled {sft.compile_count()} times; its shapes must be fixed")
    return sft.model(), history
