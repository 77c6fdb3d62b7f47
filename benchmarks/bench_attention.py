"""Causal self-attention fwd+bwd: our blockwise kernel vs PyTorch SDPA, SmolLM2-135M head shapes, fp32.

Both sides: q [B, T, 9 heads, 64], k / v [B, T, 3 KV heads, 64] (grouped), no padding, the
gradient of ``sum(out * probe)`` with respect to q, k and v. Ours is ``blockwise_attention``
with a full-sequence causal mask (query pieces of ``QUERY_BLOCK``); theirs is
``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, which
transformers' Llama uses on CPU. ``--query-block`` sets ours (one piece = the whole sequence
with ``--query-block 0``: the pre-piece kernel). Sides alternate; load gate, ``--allow-noisy``
and ``--json`` from ``benchmarks/_harness.py``.

    python benchmarks/bench_attention.py --shapes 4x256,2x512,1x1024 --repeats 5
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

from llds_jax.models.attention import QUERY_BLOCK, AttentionMask, blockwise_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def sides_for(batch: int, length: int, query_block: int):
    rng = np.random.default_rng(0)
    q, probe = (rng.standard_normal((batch, length, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((batch, length, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    mask = AttentionMask.causal(jnp.ones((batch, length), bool))
    pieces = query_block if query_block > 0 else length

    def loss(q_, k_, v_):
        return jnp.sum(blockwise_attention(q_, k_, v_, mask, block_size=max(pieces, 1), query_block=pieces)
                       * jnp.asarray(probe))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    arrays = [jnp.asarray(x) for x in (q, k, v)]

    tq, tk, tv = (torch.tensor(x).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    tprobe = torch.tensor(probe).transpose(1, 2)

    def theirs():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        (out * tprobe).sum().backward()
        tq.grad = tk.grad = tv.grad = None

    return {_harness.OURS: lambda: jax.block_until_ready(grad(*arrays)), "torch": theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4x256,2x512,1x1024", help="BATCHxLENGTH, comma-separated")
    parser.add_argument("--query-block", type=int, default=QUERY_BLOCK)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    _harness.add_arguments(parser)
    args = parser.parse_args()
    session = _harness.start("bench_attention", args)
    torch.set_num_threads(args.threads)
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        session.log(f"{batch}x{length} ...")
        times = _harness.alternate(sides_for(batch, length, args.query_block), args.repeats)
        session.add_case(f"causal attention fwd+bwd {batch}x{length}, query block {args.query_block or length}",
                         times, tokens=batch * length)
    session.finish()


if __name__ == "__main__":
    main()
