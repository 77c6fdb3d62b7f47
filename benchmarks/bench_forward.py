"""Forward and log-prob throughput: llds_jax (jit, fp32) vs transformers PyTorch (eager, fp32).

Both run on this CPU in the same process, on identical weights (ours are written with
``save_pretrained`` and loaded by transformers), same batch, same dtype (fp32). torch is
timed at each ``--torch-threads`` count (one side each); every side runs in alternation
(A, B, C, A, B, C per repeat) and the ratio against the fastest torch side is reported too.
Refuses to run on a loaded machine unless ``--allow-noisy`` (benchmarks/_harness.py);
``--json`` prints one JSON object. The log-prob row is what training needs:
per-token log π of the given ids plus entropy; ours via ``hidden_states`` + chunked
``token_logprobs``, torch via full logits + ``log_softmax`` (transformers' usual path). The
action-target row is the trainer's π_old / π_ref pass as it runs: a rollout-shaped row (two
actions, 31 % of the positions, as in ``bench_train_step.py``) scores only its action targets
(``scored_positions``), while torch, like verl's ``compute_log_prob``, scores every position and
masks afterwards. The decode row prefills half the length and
decodes 32 tokens one at a time, a Python loop of jitted calls (ours: ``forward_cached`` +
``KVCache``, with the layers' weights sliced out of their stacks once per generation as the
sampler does, ``Decoder.layer_weights``; torch: transformers' ``cache``), counting prefill and
decoded tokens.

    .venv/bin/python benchmarks/bench_forward.py --models tiny,smollm2 --batch 4 --length 256
"""

from __future__ import annotations

import argparse
import os
import tempfile

import _harness  # benchmarks/ is on sys.path when run as a script
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from llds_jax.models import from_pretrained, init_cache, save_pretrained
from llds_jax.models.logprobs import scored_positions, sequence_logprobs
from llds_jax.models.testing import tiny_model
from llds_jax.utils.assets import smollm2_gguf_path


def action_targets(batch: int, length: int) -> np.ndarray:
    """[B, T-1] target mask of two actions per row, spans (96, 136) and (196, 236) of 256 scaled to ``length``."""
    mask = np.zeros((batch, length), np.float32)
    for start, stop in ((96, 136), (196, 236)):
        mask[:, start * length // 256:stop * length // 256] = 1
    return mask[:, 1:]


def _ours_fns(model, ids, mask, targets):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, a, m: nnx.merge(graphdef, s)(a, m))
    logprobs = jax.jit(lambda s, a, m: sequence_logprobs(nnx.merge(graphdef, s), a, m, chunk_size=128))
    size = int(targets.sum(axis=1).max())

    @jax.jit
    def action_logprobs(s, a, m, t):
        positions, _ = scored_positions(t, size)
        return sequence_logprobs(nnx.merge(graphdef, s), a, m, chunk_size=128, positions=positions)

    ids, mask, targets = jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(targets)
    return (lambda: forward(state, ids, mask).block_until_ready(),
            lambda: jax.block_until_ready(logprobs(state, ids, mask)),
            lambda: jax.block_until_ready(action_logprobs(state, ids, mask, targets)))


def _torch_fns(model, ids, mask):
    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)

    @torch.no_grad()
    def forward():
        return model(input_ids=ids_t, attention_mask=mask_t).logits

    @torch.no_grad()
    def logprobs():
        logits = model(input_ids=ids_t, attention_mask=mask_t).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = torch.gather(logp_all, -1, ids_t[:, 1:, None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    return forward, logprobs, logprobs  # torch scores every position for the action-target row too


def _with_threads(fn, threads: int):
    """``fn`` run with torch's intra-op pool at ``threads`` (restored afterwards)."""
    def run():
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(previous)
    return run


def _decode_fns(model, torch_model, batch: int, prompt: int, steps: int):
    """Prefill ``prompt`` tokens, then ``steps`` one-token decode steps (greedy input fixed)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.config.vocab_size, (batch, prompt)).astype(np.int32)
    graphdef, state = nnx.split(model)
    # The layers' weights are sliced out of their stacks once per generation, as the sampler does
    # (``Decoder.layer_weights``); a call without them slices, i.e. copies, every layer's weights.
    hoist = jax.jit(lambda s: nnx.merge(graphdef, s).layer_weights())
    step = jax.jit(lambda s, w, t, c: nnx.merge(graphdef, s).forward_cached(t, c, layer_weights=w), donate_argnums=3)
    token = jnp.ones((batch, 1), jnp.int32)

    def ours():
        weights = hoist(state)
        logits, cache = step(state, weights, jnp.asarray(ids), init_cache(model.config, batch, prompt + steps))
        for _ in range(steps):
            logits, cache = step(state, weights, token, cache)
        return jax.block_until_ready(logits)

    @torch.no_grad()
    def theirs():
        out = torch_model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=True)
        cache, tok = out.cache, torch.ones((batch, 1), dtype=torch.long)
        for _ in range(steps):
            out = torch_model(input_ids=tok, cache=cache, use_cache=True)
            cache = out.cache
        return out.logits

    return ours, theirs


def bench(session, name: str, model, batch: int, length: int, repeats: int, torch_threads: list[int],
          decode_steps: int = 32) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    targets = action_targets(batch, length)
    scored = int(targets.sum(axis=1).max())
    cases = list(zip(("forward", "log-probs+entropy", f"log-probs+entropy of {scored} action targets/row (torch: all)"),
                     _ours_fns(model, ids, mask, targets), _torch_fns(torch_model, ids, mask)))
    cases.append((f"prefill {length // 2} + {decode_steps} decode", *_decode_fns(model, torch_model, batch,
                                                                                 length // 2, decode_steps)))
    for what, ours_fn, torch_fn in cases:
        session.log(f"{name} {what} ...")
        sides = {_harness.OURS: ours_fn}
        sides.update({f"torch_{n}_threads": _with_threads(torch_fn, n) for n in torch_threads})
        times = _harness.alternate(sides, repeats)
        per_row = length // 2 + decode_steps if what.startswith("prefill") else length
        session.add_case(f"{name} {what}, {batch}x{per_row}", times, tokens=batch * per_row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", default=f"1,{os.cpu_count()}",
                        help="torch thread counts to try; the fastest is reported")
    parser.add_argument("--decode-steps", type=int, default=32)
    _harness.add_arguments(parser)
    args = parser.parse_args()
    session = _harness.start("bench_forward", args)
    torch_threads = sorted({int(n) for n in args.torch_threads.split(",")})
    for name in args.models.split(","):
        if name == "tiny":
            model = tiny_model("qwen2", vocab_size=2048, hidden_size=256, num_layers=4, intermediate_size=1024,
                               num_heads=8, num_kv_heads=4, head_dim=32)
        elif name == "smollm2":
            model = from_pretrained(smollm2_gguf_path())
        else:
            raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
        bench(session, name, model, args.batch, args.length, args.repeats, torch_threads, args.decode_steps)
    session.settings.update(jax_platform=jax.devices()[0].platform, jax_devices=len(jax.devices()), dtype="float32")
    session.finish()


if __name__ == "__main__":
    main()
