"""``--mode=eval``: a policy on the QA benchmarks through the training rollout and retriever.

:func:`evaluate` runs one trajectory per question with ``llds_jax.rollout.run_rollouts``
— the same prompt, tag protocol, feedback masking, turn limits and retriever as training
— and scores the model's last answer (:mod:`llds_jax.eval.metrics`). Decoding is greedy
by default; ``greedy=False`` samples with the rollout's temperature / top-p (T = 1,
top-p 0.95: what the Search-R1 reference's validation actually did, because of a lost
flag). Every output names the decoding it used.

:func:`eval_main` writes ``<out_dir>/eval_results.json`` (per-source and average metrics,
decoding, model, data files), ``eval_table.md`` (the paper's layout) and
``predictions.jsonl`` (one scored response per question, for error analysis).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_collections

from llds_jax.config import validate_sections
from llds_jax.data.benchmarks import QARecord, benchmark_sort_key, load_qa_file
from llds_jax.errors import InputError
from llds_jax.eval.metrics import EvalResponse, markdown_table, score_response, summarize


@dataclasses.dataclass(frozen=True)
class EvalResult:
    responses: list[EvalResponse]
    summary: dict[str, dict[str, float]]
    decoding: str


def decoding_description(rollout_cfg, greedy: bool) -> str:
    if greedy:
        return "greedy"
    return f"sampled (T={rollout_cfg.temperature:g}, top-p {rollout_cfg.top_p:g})"


def eval_rollout_config(rollout_cfg, greedy: bool) -> ml_collections.ConfigDict:
    """The training rollout section with one sample per question; temperature 0 when greedy."""
    cfg = ml_collections.ConfigDict(rollout_cfg.to_dict() if hasattr(rollout_cfg, "to_dict") else dict(rollout_cfg))
    cfg.n_samples = 1
    if greedy:
        cfg.temperature = 0.0
    return cfg


def evaluate(policy, tokenizer, datasets: Mapping[str, Sequence[QARecord]] | Sequence[QARecord], retriever,
             rollout_cfg, *, greedy: bool = True, key=None, batch_size: int = 8,
             progress: bool = True) -> EvalResult:
    """Roll out and score every question of ``datasets`` (records or ``{source: records}``).

    ``policy`` is anything ``run_rollouts`` accepts (a ``Decoder``, ``(graphdef, params)``
    or a :class:`~llds_jax.rollout.multi_turn.Policy`); ``key`` seeds sampling and is
    split per batch, so results do not depend on how many batches ran before.
    """
    import jax
    from tqdm import tqdm

    from llds_jax.rollout.multi_turn import run_rollouts

    records = [r for rs in datasets.values() for r in rs] if isinstance(datasets, Mapping) else list(datasets)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be ≥ 1")
    cfg = eval_rollout_config(rollout_cfg, greedy)
    key = jax.random.key(0) if key is None else key
    responses: list[EvalResponse] = []
    correct = 0.0
    bar = tqdm(total=len(records), desc="eval", unit="q", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start:start + batch_size]
            batch = run_rollouts(policy, tokenizer, [r.question for r in chunk], retriever, cfg,
                                 key=jax.random.fold_in(key, start), group_ids=list(range(len(chunk))))
            for row, record in enumerate(chunk):
                response = _response_from_rollout(record, batch, row)
                correct += score_response(response).em
                responses.append(response)
            bar.update(len(chunk))
            bar.set_postfix(em=f"{correct / len(responses):.3f}", source=chunk[-1].data_source)
    finally:
        bar.close()
    return EvalResult(responses, summarize(responses), decoding_description(rollout_cfg, greedy))


def _response_from_rollout(record: QARecord, batch, row: int) -> EvalResponse:
    return EvalResponse(
        id=record.id, data_source=record.data_source, question=record.question,
        golden_answers=record.golden_answers, answer=batch.answers[row],
        searches=int(batch.searches[row]), valid_actions=int(batch.valid_actions[row]),
        actions=int(batch.turns[row]), finished=bool(batch.finished[row]),
        response_length=int(batch.lengths[row] - batch.prompt_lengths[row]),
        response_text=batch.response_texts[row],
    )


def write_results(result: EvalResult, out_dir: str | Path, *, title: str = "", extra: Mapping | None = None) -> Path:
    """``eval_results.json``, ``eval_table.md`` and ``predictions.jsonl`` in ``out_dir``; returns the table path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"decoding": result.decoding, **(dict(extra) if extra else {}),
               "metrics": {source: {k: _json_number(v) for k, v in m.items()} for source, m in result.summary.items()}}
    (out_dir / "eval_results.json").write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    table = out_dir / "eval_table.md"
    table.write_text(markdown_table(result.summary, title=title, decoding=result.decoding), encoding="utf-8")
    with (out_dir / "predictions.jsonl").open("w", encoding="utf-8") as handle:
        for response in result.responses:
            scores = score_response(response)
            row = {**dataclasses.asdict(response), **dataclasses.asdict(scores)}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return table


def resolve_data_files(spec: str | Sequence[str]) -> list[Path]:
    """``eval.data`` → files: a comma-separated string or a list of files, directories or ``bundled:<name>``."""
    from llds_jax.data.prompts import resolve_source

    entries = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s) for s in spec]
    files: list[Path] = []
    for entry in filter(None, entries):
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".parquet"))
            if not found:
                raise FileNotFoundError(f"eval.data directory {path} has no .jsonl or .parquet files")
            files.extend(found)
        else:
            files.append(resolve_source(entry))
    if not files:
        raise InputError("eval.data names no files")
    return files


def load_eval_datasets(spec: str | Sequence[str], limit: int = 0) -> dict[str, list[QARecord]]:
    """Records per data source (paper order), at most ``limit`` per source (0 = all)."""
    grouped: dict[str, list[QARecord]] = {}
    for path in resolve_data_files(spec):
        for record in load_qa_file(path):
            rows = grouped.setdefault(record.data_source, [])
            if not limit or len(rows) < limit:
                rows.append(record)
    return {source: grouped[source] for source in sorted(grouped, key=benchmark_sort_key)}


def load_policy_and_retriever(config):
    """(policy, tokenizer, retriever) as ``--mode=eval`` builds them: the retriever through the same
    factory and ``retrieval`` section as training, so both see the same documents."""
    from llds_jax.models.loading import load_model_and_tokenizer
    from llds_jax.retrieval.factory import build_retriever

    policy, tokenizer = load_model_and_tokenizer(config.model)
    return policy, tokenizer, build_retriever(config.retrieval, tokenizer)


def eval_main(config) -> Path:
    """Entry point of ``--mode=eval`` (commands in ``configs/eval.py``)."""
    import jax

    validate_sections(config)  # every section, before any data, index or weight is read
    section = config.eval
    datasets = load_eval_datasets(section.data, section.limit)
    policy, tokenizer, retriever = load_policy_and_retriever(config)
    greedy = bool(section.greedy)
    result = evaluate(policy, tokenizer, datasets, retriever, config.rollout, greedy=greedy,
                      key=jax.random.key(int(section.seed)), batch_size=int(section.batch_size))
    out_dir = section.out_dir or str(Path(config.workdir) / "eval")
    extra = {"model": config.model.source, "data": [str(p) for p in resolve_data_files(section.data)],
             "limit_per_source": section.limit, "max_turns": config.rollout.max_turns}
    table = write_results(result, out_dir, title=f"{config.model.source}", extra=extra)
    print(table.read_text(encoding="utf-8"))
    print(f"eval written: {Path(out_dir).resolve()}")
    return table


def _json_number(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
