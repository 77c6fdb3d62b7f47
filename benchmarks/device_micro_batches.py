"""Packed training passes at several micro-batch sizes on one device (a GPU check beside device_check.py).

    python benchmarks/device_micro_batches.py --tokenizer DIR [--rows 16,1,4] [--prompts 16] [--out DIR]
    python benchmarks/device_micro_batches.py --tokenizer DIR --dry-run     # tiny model on CPU, the wiring

Why: packed micro-batches are ``train.micro_batch_tokens`` // 4,096 rows; every micro-batch is one
trip of the passes' loop, so how few tokens a device can take per trip before the GPU idles decides
the default (``train/packing.py``). For each rows setting: a fresh learner of ``configs/device_check.py``
(Qwen2.5-0.5B shapes, random weights) at ``--prompts`` × 5 trajectories in mini-batches of
``--prompts``, the rollout-shaped batch of ``device_check.rollout_shaped_arrays`` (one trajectory per
row: 2,270 real tokens), two ``Learner.update`` calls (the first compiles). Prints and appends one
JSON line per setting to ``OUT/micro_batches.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_check  # noqa: E402


def time_rows(tokenizer: str, rows: int, prompts: int, dry_run: bool) -> dict:
    from llds_jax.train.batch import TrainBatch

    started = time.perf_counter()
    config = device_check.passes_config(dry_run, tokenizer, rows=rows)
    if not dry_run:
        config.train.prompts_per_step = config.train.mini_batch_size = prompts
    learner = device_check.job_learner(config)
    arrays, tokens_per_row = device_check.rollout_shaped_arrays(config, learner.seq_len, dry_run)
    batch = learner.upload(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    calls = []
    for _ in range(2):  # the first compiles (and skips π_ref: it equals π_old then)
        metrics, extra = learner.update(batch)
        calls.append({"logprobs_s": metrics["time/logprobs_s"], "update_s": metrics["time/update_s"],
                      "logprob_passes": extra["logprob_passes"]})
    return {"rows_per_micro_batch": learner.packing.rows, "trajectories": len(arrays["rewards"]),
            "tokens_per_trajectory": tokens_per_row, "packing": str(learner.packing), "first": calls[0],
            "second": calls[1], "total_s": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory")
    parser.add_argument("--rows", default="16,1,4", help="rows per packed micro-batch, comma-separated")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (× 5 trajectories)")
    parser.add_argument("--out", default="runs/device_micro_batches")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU (the wiring only)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rows in (int(r) for r in args.rows.split(",")):
        record = time_rows(args.tokenizer, rows, args.prompts, args.dry_run)
        print(json.dumps(record), flush=True)
        with open(out / "micro_batches.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
