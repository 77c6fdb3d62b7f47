"""``--mode=replay``: a run's recorded searches asked again of another retriever, feedback compared.

Why: a user who moves a run from one index to another (faiss ``IndexFlatIP`` on the host to the
mesh index in device memory, a rebuilt index, a retrieval server) wants to know whether the
policy would have read the same ``<information>`` blocks. Feedback is the only way a retriever
reaches training: if every query of a run gets the same feedback tokens from the new retriever,
the run over it is the same run (same sampled tokens, rewards, updates), step for step. Replaying
the queries the run sampled answers that for the price of one batched search, not a second run.

For each trajectory of ``<workdir>/samples.jsonl`` (the text the trainer decoded from the
trajectory's token ids), each ``<information>`` block is matched to the search action before it
(parsed as the rollout parses it, :func:`protocol.parse_action`); a turn's queries go to the
configured retriever in one call, and each answer is turned into feedback exactly as the
rollout does it (``protocol.batch_search_feedback``, tokenized with the policy's tokenizer,
cut to ``rollout.max_obs_tokens``, decoded from the token bytes) and compared, character for
character, with what the run recorded (:func:`replay_feedback`).

Exit status: 0 when every block is equal, 1 when any differs (each listed), 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llds_jax.errors import InputError
from llds_jax.rollout import protocol

_OPEN = "\n\n<information>"
_CLOSE = "</information>\n\n"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One recorded ``<information>`` block that the replay did not reproduce."""
    sample: int        # line of samples.jsonl, from 0
    turn: int          # the block's place in its response, from 0
    query: str | None  # None: the action before the block parses as no search
    recorded: str      # the response from the block's start, as long as the replayed feedback (or to its end)
    replayed: str      # the feedback the retriever gives now ("" without a query)


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """How many recorded blocks were replayed and which differ."""
    samples: int
    searches: int
    mismatches: list[Mismatch]

    def summary(self) -> dict:
        return {"samples": self.samples, "searches": self.searches, "equal": self.searches - len(self.mismatches),
                "mismatches": [dataclasses.asdict(m) for m in self.mismatches]}


def _query_before(action: str) -> str | None:
    """The search the action before a block asked for, parsed as the rollout parses it. An invalid action's
    message (recorded before the next action) names the tags itself, so only what follows the last one counts."""
    parsed = protocol.parse_action(action.split(protocol.INVALID_ACTION_FEEDBACK)[-1])
    return parsed.content if parsed.kind == "search" else None


def replay_feedback(responses: list[str], retriever, tokenizer, topk: int, max_obs_tokens: int) -> ReplayReport:
    """Each recorded block against ``retriever``'s feedback for its query, one batched search per turn.

    A block's end is not in the text (a block ``max_obs_tokens`` cut has no closing tag and the next
    action follows it), so the responses are walked turn by turn: the replayed feedback must start
    the rest of the response there, and the next action begins right after it; a response that ends
    inside the block (the context's room ran out) must be a prefix of it. After a mismatch the walk
    goes on after the block's closing tag, if it has one.
    """
    from llds_jax.sampling.token_bytes import decode_text, vocab_bytes

    table = vocab_bytes(tokenizer)
    at, turn = [0] * len(responses), [0] * len(responses)
    mismatches, searches = [], 0
    waiting = [i for i, text in enumerate(responses) if _OPEN in text]
    while waiting:
        opens = {i: responses[i].find(_OPEN, at[i]) for i in waiting}
        queries = {i: _query_before(responses[i][at[i]:opens[i]]) for i in waiting}
        asked = [i for i in waiting if queries[i] is not None]
        fed = dict(zip(asked, protocol.batch_search_feedback(retriever, [queries[i] for i in asked], topk)))
        for i in waiting:
            rest = responses[i][opens[i]:]
            ours = decode_text(protocol.encode_feedback(tokenizer, fed[i], max_obs_tokens), table) if i in fed else ""
            searches += 1
            if ours and rest.startswith(ours):
                at[i] = opens[i] + len(ours)
            elif ours and ours.startswith(rest):
                at[i] = len(responses[i])
            else:
                close = rest.find(_CLOSE)
                block = len(rest) if close < 0 else close + len(_CLOSE)
                mismatches.append(Mismatch(i, turn[i], queries[i], rest[: max(len(ours), block)], ours))
                at[i] = opens[i] + block
            turn[i] += 1
        waiting = [i for i in waiting if responses[i].find(_OPEN, at[i]) >= 0]
    return ReplayReport(len(responses), searches, mismatches)


def read_responses(path: Path) -> list[str]:
    """The ``response`` of every line of a samples.jsonl; a bad line is an error naming file, line and field."""
    responses = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{number}: not a JSON object ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("response"), str):
                raise InputError(f"{path}:{number}: field 'response' must be a string")
            responses.append(record["response"])
    return responses


def replay_main(config) -> ReplayReport:
    """Entry point of ``--mode=replay``: ``config.workdir``'s samples against ``config.retrieval``."""
    from llds_jax.models.loading import load_tokenizer, resolve_model_path
    from llds_jax.retrieval.factory import build_retriever

    path = Path(config.workdir) / "samples.jsonl"
    if not path.is_file():
        raise InputError(f"{path} does not exist: --config.workdir must name a run that wrote samples")
    responses = read_responses(path)
    source = str(config.model.source)
    tokenizer = load_tokenizer(config.model, None if config.model.get("tokenizer") else resolve_model_path(source))
    retriever = build_retriever(config.retrieval, tokenizer)
    report = replay_feedback(responses, retriever, tokenizer, int(config.rollout.topk),
                             int(config.rollout.max_obs_tokens))
    summary = report.summary()
    (Path(config.workdir) / f"replay_{config.retrieval.method}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"replay over retrieval.method={config.retrieval.method}: {summary['equal']} of {report.searches} "
          f"feedback blocks equal in {report.samples} samples", flush=True)
    if report.mismatches:
        for m in report.mismatches[:5]:
            print(f"differs: sample {m.sample} turn {m.turn} query {m.query!r}\n  recorded {m.recorded!r}\n"
                  f"  replayed {m.replayed!r}", flush=True)
        raise SystemExit(1)
    return report
