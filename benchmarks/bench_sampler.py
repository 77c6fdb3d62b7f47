"""Generation throughput: ``llds_jax.sampling.generate`` (jit, fp32) vs transformers ``generate`` (PyTorch, fp32).

Same weights on both sides (ours are loaded from what transformers saved, or both from the
SmolLM2 GGUF), same left-padded batch, same number of new tokens (EOS disabled so every
row generates all of them), same decoding (greedy, or T=1 / top-p 0.95 sampling), in one
process, alternating the two sides (A, B, A, B per repeat). Reported per side: generated tokens
per second of the whole ``generate`` call (prefill included on both sides), median wall and CPU
seconds of ``--repeats`` after a warm-up call (JAX compiles there). Refuses to run on a loaded
machine unless ``--allow-noisy`` (benchmarks/_harness.py); ``--json`` prints one JSON object.

    .venv/bin/python benchmarks/bench_sampler.py --models tiny,smollm2 --batch 8,32 \
        --prompt-len 64 --new-tokens 64

``--slots 128,1024,4096`` instead measures one decode step (ours only: ``slots.SlotSession``,
the paged cache) against the cache slots each row's block table covers (the pool holding every
row's), at the same 16 live tokens, on a random 8-layer Llama (d 256, vocab 8192), batch 8: does
a step cost what the rows hold, or what they could hold (the engine sizes rows for ``max_context``)?
"""

from __future__ import annotations

import argparse
import tempfile

import _harness  # benchmarks/ is on sys.path when run as a script
import jax
import numpy as np
import torch
import transformers

from llds_jax.models import from_pretrained
from llds_jax.sampling import generate
from llds_jax.utils.assets import smollm2_gguf_path


def tiny_pair(directory: str):
    """A random 2-layer Qwen2 (vocab 256) in transformers, and the same weights in llds_jax."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                                      tie_word_embeddings=True)
    hf_model = transformers.Qwen2ForCausalLM(config).eval()
    hf_model.save_pretrained(directory)
    return hf_model, from_pretrained(directory)


def smollm2_pair():
    gguf = smollm2_gguf_path()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 dtype="float32").eval()
    return hf_model, from_pretrained(gguf)


def left_padded_batch(batch: int, prompt_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_len // 2, prompt_len + 1, size=batch)
    ids = np.zeros((batch, prompt_len), np.int32)
    mask = np.zeros((batch, prompt_len), np.int32)
    for row, n in enumerate(lengths):
        ids[row, prompt_len - n:] = rng.integers(1, vocab, n)
        mask[row, prompt_len - n:] = 1
    return ids, mask


def run_case(hf_model, model, batch, prompt_len, new_tokens, sampled: bool, repeats: int):
    vocab = model.config.vocab_size
    ids, mask = left_padded_batch(batch, prompt_len, vocab)
    knobs = dict(temperature=1.0, top_p=0.95) if sampled else dict(temperature=0.0)

    def ours():
        out = generate(model, ids, mask, max_new_tokens=new_tokens, key=jax.random.key(0), **knobs)
        assert (out.lengths == new_tokens).all()

    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)
    torch_knobs = dict(do_sample=True, temperature=1.0, top_p=0.95, top_k=None) if sampled else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)

    @torch.no_grad()
    def theirs():
        out = hf_model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, **torch_knobs)
        assert out.shape[1] == prompt_len + new_tokens

    return _harness.alternate({_harness.OURS: ours, "transformers": theirs}, repeats), batch * new_tokens


def decode_seconds_vs_slots(session, slots: list[int], repeats: int, batch: int = 8, steps: int = 32):
    """One decode call of ``steps`` tokens on ``slots.SlotSession`` (the paged cache) per row
    capacity in ``slots``: each row's block table covers that many cache slots and the pool holds
    every row's blocks, the live length the same 16-token prompt; the timed call is the decode only.
    What it shows: whether a step's time follows the rows' live tokens or the cache they could hold
    (``max_context``, which the engine's rows are sized for)."""
    from flax import nnx

    from llds_jax.models.testing import tiny_model
    from llds_jax.sampling import SamplingParams
    from llds_jax.sampling.generate import resolve_stop_table
    from llds_jax.sampling.slots import SlotSession

    model = tiny_model("llama", vocab_size=8192, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate_size=512)
    graphdef, params = nnx.split(model)
    sampling = SamplingParams.create(temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=resolve_stop_table((), None, model.config.vocab_size))
    session.log(f"decode step vs cache slots: random 8-layer Llama d256 vocab 8192, batch {batch}, {steps} steps")
    sessions = {count: SlotSession((graphdef, params), sampling, slots=batch, max_action_tokens=steps,
                                   key=jax.random.key(0), max_tokens=count) for count in slots}

    def prefilled(count):  # untimed: every slot a new trajectory holding the prompt, its action started
        rows = sessions[count]
        for slot in range(batch):
            rows.reset(slot, slot, 0)
            rows.set_blocks(slot, np.arange(slot * rows.columns, (slot + 1) * rows.columns))
        rows.append({slot: [1] * 16 for slot in range(batch)})
        for slot in range(batch):
            rows.start_action(slot, steps)
        jax.block_until_ready(rows.logits)
        return rows

    def decode(rows):  # timed: the decode steps only
        ended = rows.decode(steps)
        assert len(ended) == batch and all(len(a.ids) == steps for a in ended.values())

    times = _harness.alternate({f"{count}_slots": decode for count in slots}, repeats,
                               setup={f"{count}_slots": lambda c=count: prefilled(c) for count in slots})
    session.add_case(f"decode step vs cache slots (8-layer Llama d256, batch {batch}, {steps} steps)", times,
                     tokens=batch * steps,
                     ms_per_step={side: 1000 * t.median_s / steps for side, t in times.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--batch", default="8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampled", action="store_true", help="also run T=1 / top-p 0.95 sampling")
    parser.add_argument("--slots", default="", help="e.g. 128,1024,4096: decode step time vs cache slots only")
    _harness.add_arguments(parser)
    args = parser.parse_args()
    session = _harness.start("bench_sampler", args)
    session.settings["torch_threads"] = torch.get_num_threads()
    if args.slots:
        decode_seconds_vs_slots(session, [int(s) for s in args.slots.split(",")], args.repeats)
        session.finish()
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name not in ("tiny", "smollm2"):
                raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
            hf_model, model = tiny_pair(tmp) if name == "tiny" else smollm2_pair()
            for batch in (int(b) for b in args.batch.split(",")):
                for sampled in ([False, True] if args.sampled else [False]):
                    mode = "top-p 0.95" if sampled else "greedy"
                    session.log(f"{name} {mode} batch {batch} ...")
                    times, tokens = run_case(hf_model, model, batch, args.prompt_len, args.new_tokens, sampled,
                                             args.repeats)
                    session.add_case(f"{name} {mode} generate, batch {batch}, prompt <= {args.prompt_len}, "
                                     f"{args.new_tokens} new tokens", times, tokens=tokens)
    session.finish()


if __name__ == "__main__":
    main()
