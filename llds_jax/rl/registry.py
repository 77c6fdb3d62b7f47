"""Name -> function tables, so every algorithmic choice is a config string.

One tiny class instead of four ad-hoc dicts: lookups of unknown names fail with the
list of known ones (a typo in a config must never silently fall back to a default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions; `register` is a decorator, `get` fails loudly."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            for name in names:
                if name in self._table:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._table[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table
