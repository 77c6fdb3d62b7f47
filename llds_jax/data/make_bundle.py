"""Cut the package data the default job trains on: a few-MB corpus and answerable questions.

The default job must run from a fresh clone without ``../shared``, and a 135M model only
earns non-zero EM when the retriever can actually surface the answer (on all NQ questions
its expected greedy EM is ≈6%; docs/decisions.md, Data). So we ship:

* ``bundled/corpus.jsonl`` — wiki-18 passages: the BM25 top-``KEEP_PER_QUESTION`` of every
  candidate question (so the answer passages *and* their natural distractors are in) plus a
  seeded random filler, capped to ``--max_corpus_bytes``. Passages carrying the protocol's markup
  (:func:`has_protocol_markup`: the shared subset holds a few scraped from Search-R1 observations,
  with ``<search>``, ``<information>`` and ``Doc 1(Title:`` inside) are left out: retrieved into
  an observation they would show the policy tags it did not write.
* ``bundled/nq_train.jsonl``, ``bundled/hotpotqa_train.jsonl``, ``bundled/nq_dev.jsonl`` —
  FlashRAG rows whose gold answer occurs (normalised, on word boundaries) in the **bundled**
  corpus's BM25 top-3 for the question itself — checked with the project's own
  ``BM25Retriever`` over the final bundled corpus, the exact retriever the job runs.
* ``bundled/searchr1_3b_lengths.jsonl`` — per-trajectory token lengths of Search-R1's 3B policy
  (``data.lengths``: the step-time plan's default length distribution).
* ``bundled/MANIFEST.json`` — counts, sources and the command, so the cut is reproducible.

Run: ``python -m llds_jax.data.make_bundle --shared=../shared`` (takes ≈1 minute).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

from llds_jax.data.benchmarks import QARecord, load_qa_file
from llds_jax.data.lengths import bundle_reference
from llds_jax.retrieval.bm25 import BM25Retriever
from llds_jax.retrieval.corpus import Corpus
from llds_jax.rollout.reward import normalize_answer

BUNDLE_DIR = Path(__file__).resolve().parent / "bundled"
SOURCES = {  # bundled file name → (shared path, benchmark)
    "nq_train.jsonl": ("data/train/nq_train_first5000.jsonl", "nq"),
    "hotpotqa_train.jsonl": ("data/train/hotpotqa_train_800.jsonl", "hotpotqa"),
    "nq_dev.jsonl": ("data/eval/nq.dev200.jsonl", "nq"),
}
CORPUS = "data/corpus/wiki18_subset.jsonl"
KEEP_PER_QUESTION = 5
TOPK = 3
# The protocol's tags (rollout.protocol) and the doc header retrieval.format_docs writes.
PROTOCOL_MARKUP = re.compile(r"</?(?:think|search|answer|information)>|Doc \d+\(Title:")


def has_protocol_markup(contents: str) -> bool:
    """The passage holds a protocol tag or a ``Doc i(Title:`` header: text of a rollout, not of Wikipedia."""
    return PROTOCOL_MARKUP.search(contents) is not None


def answer_in(golden_answers, contents: str) -> bool:
    """Gold answer occurs as whole words in the passage (SPEC §3 normalisation on both sides)."""
    haystack = f" {normalize_answer(contents)} "
    return any(f" {normalize_answer(a)} " in haystack for a in golden_answers if normalize_answer(a))


def answerable(records: list[QARecord], retriever: BM25Retriever) -> list[QARecord]:
    hits = retriever.search([r.question for r in records], TOPK)
    return [r for r, row in zip(records, hits) if any(answer_in(r.golden_answers, h.contents) for h in row)]


def write_jsonl(path: Path, rows) -> None:
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default="../shared", help="the shared directory holding data/")
    parser.add_argument("--out", default=str(BUNDLE_DIR))
    parser.add_argument("--max_corpus_bytes", type=int, default=4_200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shared, out = Path(args.shared), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    full = Corpus(shared / CORPUS)
    full_bm25 = BM25Retriever.build(full)
    questions = {name: load_qa_file(shared / rel, data_source=src) for name, (rel, src) in SOURCES.items()}
    candidates = {name: answerable(recs, full_bm25) for name, recs in questions.items()}
    print({name: f"{len(candidates[name])}/{len(questions[name])}" for name in questions}, "answerable in full corpus")

    keep: dict[str, str] = {}  # id → contents, answer passages and their distractors first
    for recs in candidates.values():
        for row in full_bm25.search([r.question for r in recs], KEEP_PER_QUESTION):
            keep.update((hit.id, hit.contents) for hit in row if hit.id not in keep)
    filler = list(range(len(full)))
    random.Random(args.seed).shuffle(filler)
    rows, size = [], 0

    def add(doc_id: str, contents: str) -> bool:
        nonlocal size
        line = json.dumps({"id": doc_id, "contents": contents}, ensure_ascii=False) + "\n"
        if size + len(line.encode()) > args.max_corpus_bytes:
            return False
        rows.append({"id": doc_id, "contents": contents})
        size += len(line.encode())
        return True

    dropped = [doc_id for doc_id, contents in keep.items() if has_protocol_markup(contents)]
    for doc_id, contents in keep.items():
        if doc_id not in dropped:
            add(doc_id, contents)  # one that does not fit drops its question in the re-check below
    for i in filler:
        doc_id, contents = full.row(i)
        if doc_id in keep or has_protocol_markup(contents):
            continue
        if not add(doc_id, contents):
            break
    write_jsonl(out / "corpus.jsonl", rows)

    bundled = BM25Retriever.build(Corpus(out / "corpus.jsonl"))
    counts = {}
    for name, recs in candidates.items():
        kept = answerable(recs, bundled)
        write_jsonl(out / name, [{"id": r.id, "question": r.question, "golden_answers": list(r.golden_answers)}
                                 for r in kept])
        counts[name] = {"source": SOURCES[name][0], "rows": len(questions[name]),
                        "answerable_full_corpus": len(recs), "bundled": len(kept)}
    manifest = {
        "command": "python -m llds_jax.data.make_bundle --shared=../shared",
        "corpus": {"source": CORPUS, "passages": len(rows), "bytes": size,
                   "answer_passages_per_question": KEEP_PER_QUESTION, "seed": args.seed,
                   "left_out_for_protocol_markup": f"every passage matching {PROTOCOL_MARKUP.pattern}"},
        "questions": counts,
        "lengths": bundle_reference(Path(args.shared), out),
        "check": f"gold answer (normalised, word boundary) in BM25 top-{TOPK} over the bundled corpus",
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
