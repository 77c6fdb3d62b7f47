"""Where a training micro-batch's time goes: the pieces of one fwd+bwd, ours vs torch, same shapes.

Times (sides alternated, medians of ``--repeats``, through ``benchmarks/_harness.py``: load gate,
``--allow-noisy``, ``--json``) at one micro-batch of SmolLM2-135M shapes with random weights: the
whole loss (decoder + chunked log-prob head), the decoder stack alone and the log-prob head alone.
A speed-up < 1 names the piece that loses to torch.

    python benchmarks/profile_update_pieces.py --layers 30 --repeats 3
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
               intermediate_size=1536, tie_embeddings=True, rms_eps=1e-5)


def jax_pieces(layers: int, batch: int, length: int, remat: str):
    from llds_jax.models.logprobs import token_logprobs
    from llds_jax.models.testing import tiny_model

    model = tiny_model("llama", **{**SMOLLM2, "num_layers": layers, "remat": remat, "max_position_embeddings": 2048})
    graph, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, SMOLLM2["vocab_size"], (batch, length)), jnp.int32)
    mask = jnp.ones((batch, length), bool)

    def full_loss(p):
        m = nnx.merge(graph, p)
        hidden = m.hidden_states(ids, mask)
        table, vocab_major = m.output_head()
        logp, ent = token_logprobs(hidden[:, :-1], table, ids[:, 1:], vocab_major=vocab_major, chunk_size=128)
        return jnp.sum(logp) + 1e-3 * jnp.sum(ent)

    probe = jnp.asarray(rng.standard_normal((batch, length, SMOLLM2["hidden_size"])), jnp.float32)

    def stack_loss(p):
        return jnp.sum(nnx.merge(graph, p).hidden_states(ids, mask) * probe)

    hidden0 = probe[:, :-1] * 0.5
    # SmolLM2 ties its embeddings: the head reads the [V, D] table as stored, as the model does.
    unembed0 = jnp.asarray(0.02 * rng.standard_normal((SMOLLM2["vocab_size"], SMOLLM2["hidden_size"])), jnp.float32)

    def head_loss(h, u):
        logp, ent = token_logprobs(h, u, ids[:, 1:], vocab_major=True, chunk_size=128)
        return jnp.sum(logp) + 1e-3 * jnp.sum(ent)

    full = jax.jit(jax.grad(full_loss))
    stack = jax.jit(jax.grad(stack_loss))
    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    return {
        "full": lambda: jax.block_until_ready(full(params)),
        "stack": lambda: jax.block_until_ready(stack(params)),
        "head": lambda: jax.block_until_ready(head(hidden0, unembed0)),
    }, (full, params)


def torch_pieces(layers: int, batch: int, length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=SMOLLM2["vocab_size"], hidden_size=576, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().train()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(3, SMOLLM2["vocab_size"], (batch, length))).long()
    attn = torch.ones_like(ids)
    probe = torch.randn(batch, length, 576)

    def full():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1)
        logp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        (logp.sum() + 1e-3 * ent.sum()).backward()
        model.zero_grad(set_to_none=True)

    def stack():
        h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        (h * probe).sum().backward()
        model.zero_grad(set_to_none=True)

    hidden0 = (probe[:, :-1] * 0.5).requires_grad_()
    unembed0 = (0.02 * torch.randn(SMOLLM2["vocab_size"], 576)).requires_grad_()

    def head():
        logits = hidden0 @ unembed0.T
        lp = torch.log_softmax(logits, -1)
        logp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        (logp.sum() + 1e-3 * ent.sum()).backward()
        hidden0.grad = unembed0.grad = None

    return {"full": full, "stack": stack, "head": head}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--pieces", default="full,stack,head")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    _harness.add_arguments(parser)
    args = parser.parse_args()
    session = _harness.start("profile_update_pieces", args)
    torch.set_num_threads(args.threads)
    ours, _ = jax_pieces(args.layers, args.batch, args.length, args.remat)
    theirs = torch_pieces(args.layers, args.batch, args.length)
    for name in args.pieces.split(","):
        session.log(f"{name} ...")
        times = _harness.alternate({_harness.OURS: ours[name], "torch": theirs[name]}, args.repeats)
        session.add_case(f"{name} fwd+bwd, {args.layers} layers, {args.batch}x{args.length}", times,
                         tokens=args.batch * args.length)
    session.finish()


if __name__ == "__main__":
    main()
