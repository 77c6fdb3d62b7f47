"""Generation throughput: ``llds_jax.sampling.generate`` (jit, fp32) vs transformers ``generate`` (PyTorch, fp32).

Same weights on both sides (ours are loaded from what transformers saved, or both from the
SmolLM2 GGUF), same left-padded batch, same number of new tokens (EOS disabled so every
row generates all of them), same decoding (greedy, or T=1 / top-p 0.95 sampling), in one
process, alternating the two sides. Reported: generated tokens per second of the whole
``generate`` call (prefill included on both sides), median of ``--repeats`` after a warm-up
call (JAX compiles there).

    .venv/bin/python benchmarks/bench_sampler.py --models tiny,smollm2 --batch 8,32 \
        --prompt-len 64 --new-tokens 64

``--slots 128,1024,4096`` instead measures one decode step (ours only) against the KV
cache's slot count, on a random 8-layer Llama (d 256, vocab 8192), batch 8: the reason
the rollout's session grows its cache instead of allocating ``max_context`` slots.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from _timing import median_seconds  # benchmarks/ is on sys.path when run as a script

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

    t_ours = median_seconds(ours, repeats)
    t_theirs = median_seconds(theirs, repeats)
    tokens = batch * new_tokens
    return tokens / t_ours, tokens / t_theirs


def decode_ms_per_step_vs_slots(slots: list[int], batch: int = 8, steps: int = 32):
    from flax import nnx

    from llds_jax.models.testing import tiny_model
    from llds_jax.sampling import SamplingParams, decode_loop
    from llds_jax.sampling.generate import resolve_stop_table

    model = tiny_model("llama", vocab_size=8192, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate_size=512)
    graphdef, params = nnx.split(model)
    sampling = SamplingParams.create(temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=resolve_stop_table((), None, model.config.vocab_size))
    prompt = jax.numpy.ones((batch, 16), jax.numpy.int32)
    print(f"decode step vs cache slots: random 8-layer Llama d256 vocab 8192, batch {batch}, {steps} steps")
    for count in slots:
        def run(count=count):
            cache = decode_loop.new_cache(model.config, batch, count)
            logits, cache = decode_loop.extend(graphdef, params, prompt, jax.numpy.ones_like(prompt, bool), cache)
            jax.block_until_ready(logits)
            start = time.perf_counter()
            state = decode_loop.decode(graphdef, params, logits, cache, jax.numpy.zeros((batch,), bool),
                                       jax.numpy.full((batch,), steps), jax.random.key(0), sampling, width=steps)
            jax.block_until_ready(state.tokens)
            return time.perf_counter() - start

        run()
        best = min(run() for _ in range(2))
        print(f"  {count:5d} slots: {1000 * best / steps:7.1f} ms/step", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--batch", default="8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampled", action="store_true", help="also run T=1 / top-p 0.95 sampling")
    parser.add_argument("--slots", default="", help="e.g. 128,1024,4096: decode step time vs cache slots only")
    args = parser.parse_args()
    if args.slots:
        decode_ms_per_step_vs_slots([int(s) for s in args.slots.split(",")])
        return
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"threads={torch.get_num_threads()}, cpus={os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}")
    print(f"prompt ≤ {args.prompt_len} (left-padded), {args.new_tokens} new tokens, fp32 both sides")
    print(f"{'model':8} {'decoding':8} {'batch':>5} {'llds_jax tok/s':>15} {'torch tok/s':>12} {'speed-up':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            hf_model, model = tiny_pair(tmp) if name == "tiny" else smollm2_pair()
            for batch in (int(b) for b in args.batch.split(",")):
                for sampled in ([False, True] if args.sampled else [False]):
                    ours, theirs = run_case(hf_model, model, batch, args.prompt_len, args.new_tokens, sampled,
                                            args.repeats)
                    mode = "top-p" if sampled else "greedy"
                    print(f"{name:8} {mode:8} {batch:5d} {ours:15.1f} {theirs:12.1f} {ours / theirs:8.2f}x",
                          flush=True)


if __name__ == "__main__":
    main()
