"""Per-trajectory token lengths: what a step's schedule and step time are predicted from.

A trajectory's work is its prompt, each action the policy sampled and each feedback the
environment appended. Two sources:

* :func:`reference_lengths` — Search-R1's released Qwen2.5-3B GRPO policy, 3,250 trajectories on
  NQ, TriviaQA, PopQA and Bamboogle (``bundled/searchr1_3b_lengths.jsonl``, cut from
  ``../shared/data/searchr1/reference_rollout_lengths.jsonl`` by :func:`bundle_reference`;
  mean length ≈ 688 tokens): the default of ``--mode=plan``'s step time;
* :func:`run_lengths` — a run's own ``samples.jsonl`` (``train.loop.write_samples`` records each
  sample's ``lengths``), so a plan can be re-made from what a model actually wrote.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llds_jax.errors import InputError

BUNDLED = Path(__file__).parent / "bundled" / "searchr1_3b_lengths.jsonl"


class LengthSourceError(InputError):
    """A length source that is missing or malformed; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class TrajectoryLengths:
    """Tokens of one trajectory: ``prompt``, each action in order, each feedback in order.

    ``searched[k]``: feedback ``k`` came from the retriever (not the invalid-action message);
    None = every feedback did (the reference file records search results only).
    """

    prompt: int
    actions: tuple[int, ...]
    feedback: tuple[int, ...]
    searched: tuple[bool, ...] | None = None

    def is_search(self, k: int) -> bool:
        return k < len(self.feedback) and (self.searched is None or bool(self.searched[k]))

    @property
    def decode_tokens(self) -> int:
        return sum(self.actions)

    @property
    def total(self) -> int:
        return self.prompt + sum(self.actions) + sum(self.feedback)

    def capped(self, max_actions: int, max_action_tokens: int, max_feedback_tokens: int) -> TrajectoryLengths:
        """The trajectory as a config's caps would cut it (turns, action and feedback tokens)."""
        actions = tuple(min(a, max_action_tokens) for a in self.actions[:max_actions])
        feedback = tuple(min(f, max_feedback_tokens) for f in self.feedback[: max(0, len(actions) - 1)])
        searched = None if self.searched is None else self.searched[: len(feedback)]
        return TrajectoryLengths(self.prompt, actions, feedback, searched)


def _parse(path: Path, line_number: int, row: dict, prompt_key: str) -> TrajectoryLengths:
    try:
        prompt, actions, feedback = row[prompt_key], row["actions"], row["feedback"]
    except KeyError as err:
        raise LengthSourceError(f"{path}:{line_number}: no field {err.args[0]!r}") from None
    values = [prompt, *actions, *feedback]
    if not actions or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise LengthSourceError(f"{path}:{line_number}: {prompt_key}/actions/feedback must be token counts ≥ 0 "
                                f"with at least one action; got {prompt_key}={prompt!r}, actions={actions!r}, "
                                f"feedback={feedback!r}")
    searched = row.get("searched")
    if searched is not None and (not isinstance(searched, list) or len(searched) != len(feedback)):
        raise LengthSourceError(f"{path}:{line_number}: searched={searched!r} must list one bool per feedback")
    return TrajectoryLengths(int(prompt), tuple(actions), tuple(feedback),
                             None if searched is None else tuple(bool(x) for x in searched))


def _read(path: Path, prompt_key: str, nested: str | None = None) -> list[TrajectoryLengths]:
    out = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise LengthSourceError(f"{path}:{number}: not JSON ({err.msg})") from None
            if nested is not None:
                if nested not in row:
                    continue  # a sample written before lengths were recorded
                row = row[nested]
            out.append(_parse(path, number, row, prompt_key))
    return out


def reference_lengths(path: str | Path | None = None) -> list[TrajectoryLengths]:
    """Search-R1 3B's trajectories (the bundled cut, or the original file at ``path``)."""
    path = Path(path) if path is not None else BUNDLED
    if not path.exists():
        raise LengthSourceError(f"no length file at {path}")
    return _read(path, "prompt" if path == BUNDLED else "first_prompt_tokens")


def run_lengths(run_dir: str | Path) -> list[TrajectoryLengths]:
    """The trajectories a run recorded in ``<run_dir>/samples.jsonl`` (its ``lengths`` fields)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.exists():
        raise LengthSourceError(f"plan.length_source={str(run_dir)!r}: no samples.jsonl there")
    lengths = _read(path, "prompt", nested="lengths")
    if not lengths:
        raise LengthSourceError(f"{path}: no sample records its 'lengths' (written by train.loop since the "
                                f"step-time plan; re-run with train.samples_per_step > 0)")
    return lengths


def load_lengths(source: str = "") -> list[TrajectoryLengths]:
    """``""`` or ``"searchr1_3b"``: the bundled reference; a directory: a run's samples; a file: the original format."""
    if source in ("", "searchr1_3b"):
        return reference_lengths()
    path = Path(source).expanduser()
    return run_lengths(path) if path.is_dir() else reference_lengths(path)


def row_lengths(prompt_tokens: int, action_index, feedback_mask, feedback_kinds=None) -> dict:
    """One rollout row's ``{"prompt", "actions", "feedback", "searched"}`` from its token-aligned arrays
    (``RolloutBatch.action_index``: k on action k's tokens, -1 elsewhere; ``feedback_mask``): each
    feedback is counted after the action it follows; ``feedback_kinds[k]`` (``RolloutBatch.action_feedback``
    of the row: "search", "invalid" or None) says which came from the retriever."""
    import numpy as np

    index, feedback = np.asarray(action_index), np.asarray(feedback_mask) > 0
    count = int(index.max(initial=-1)) + 1
    actions = [int(np.sum(index == k)) for k in range(count)]
    # Feedback after action k: feedback tokens whose last preceding action token is action k's.
    last_action = np.maximum.accumulate(np.where(index >= 0, index, -1))
    after = [int(np.sum(feedback & (last_action == k))) for k in range(count)]
    while after and after[-1] == 0:
        after.pop()
    out = {"prompt": int(prompt_tokens), "actions": actions, "feedback": after}
    if feedback_kinds is not None:
        out["searched"] = [k < len(feedback_kinds) and feedback_kinds[k] == "search" for k in range(len(after))]
    return out


def bundle_reference(shared: Path, out: Path) -> dict:
    """Write ``out/searchr1_3b_lengths.jsonl`` from ``shared``'s reference file; its manifest entry."""
    source = shared / "data" / "searchr1" / "reference_rollout_lengths.jsonl"
    rows = [json.loads(line) for line in open(source) if line.strip()]
    with open(out / BUNDLED.name, "w") as handle:
        for r in rows:
            handle.write(json.dumps({"source": r["source"], "prompt": r["first_prompt_tokens"], "actions": r["actions"],
                                     "feedback": r["feedback"]}, separators=(",", ":")) + "\n")
    return {"source": "data/searchr1/reference_rollout_lengths.jsonl", "trajectories": len(rows)}
