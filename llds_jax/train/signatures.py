"""How many input signatures each jitted step function was traced for: the "one compile per function per run" check.

Why not jit's own ``fn._cache_size()``: it reads the C++ dispatch cache, an LRU shared by every jitted function in
the process (8,192 entries). In a long-lived process — a pytest worker that runs hundreds of tests, or a driver
that builds many programs — it evicts a learner's entries and then reads 0 although nothing recompiled, and after
an eviction jit may trace a signature again that it has compiled before. What forces a new program is a new
*signature* (the arguments' tree structure, shapes and dtypes), so that is what is counted: tracing the same
signature twice counts once, a new shape counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


def signature(args) -> tuple:
    """The arguments' tree structure plus each leaf's shape and dtype (hashable)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


class SignatureLog:
    """Distinct signatures traced per named function; ``counted`` wraps a function before it is jitted."""

    def __init__(self):
        self._seen: dict[str, set] = {}

    def counted(self, name: str, fn: Callable) -> Callable:
        self._seen.setdefault(name, set())

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self._seen[name].add(signature((args, kwargs)))
            return fn(*args, **kwargs)

        return traced

    def reusing(self, name: str, owner: str, owner_jitted: Callable, own_jitted: Callable) -> Callable:
        """``name``'s calls, run by ``owner_jitted`` (``owner``'s program, same code and shardings) when ``owner``
        has traced the call's signature already, else by ``own_jitted``. The π_ref pass is π_old's program whenever
        π_ref has π_θ's dtypes: two jit objects would compile the same program twice. Each call's signature is
        recorded under ``name``, so ``counts()`` still says how many programs ``name`` needed."""
        seen = self._seen.setdefault(name, set())
        owner_seen = self._seen.setdefault(owner, set())

        def call(*args, **kwargs):
            key = signature((args, kwargs))
            seen.add(key)
            return (owner_jitted if key in owner_seen else own_jitted)(*args, **kwargs)

        return call

    def count(self, name: str) -> int:
        return len(self._seen.get(name, ()))

    def counts(self) -> dict[str, int]:
        """Every function wrapped so far, by name."""
        return {name: len(seen) for name, seen in self._seen.items()}
