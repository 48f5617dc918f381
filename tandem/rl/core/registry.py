"""Named registries for pluggable pieces (advantage estimators, losses, rewards, ...).

Algorithms are data: callers look a piece up by the name a config gives and call
it; they never branch on the name. An unknown name is an error that lists the
registered names and the nearest match.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Raised for an unknown or duplicate registry name; str() is one clear line."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    """A mapping from names to objects, filled with the ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._caps: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **caps: Any) -> Callable[[T], T]:
        """Decorator; ``caps`` are what callers may ask of the entry instead of
        comparing its name (e.g. ``needs_values=True`` for an estimator that needs a critic)."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise RegistryError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            self._caps[name] = caps
            return obj

        return deco

    def cap(self, name: str, key: str, default: Any = None) -> Any:
        """A capability the entry ``name`` declared at registration (``default`` if none)."""
        self.get(name)  # unknown names raise the usual one-line error
        return self._caps[name].get(key, default)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        names = sorted(self._items)
        near = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown {self.kind} {name!r}{hint} (choose from: {', '.join(names)})"

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
