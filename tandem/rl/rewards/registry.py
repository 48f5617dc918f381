"""The reward-function registry: one signature, looked up by name.

A reward function scores one completion against its dataset row::

    @register_reward("my_reward")
    def my_reward(completion: str, sample: Mapping[str, Any], *, strict: bool = True) -> float:
        ...

* ``sample`` is the dataset row (fields such as ``"answer"``, ``"tests"``, ``"task"``).
* Return a float (usually 1.0 / 0.0). Raising is allowed: ``RewardPool`` turns an
  exception into a score of 0 and counts an error.
* Configuration goes in keyword-only arguments with defaults, so a config can bind
  them with ``functools.partial`` (``RewardPool(reward_kwargs={"my_reward": {...}})``
  does this and checks the names at construction).
* The function must be defined at module top level: ``RewardPool`` sends it to
  spawned worker processes by reference (module + name), so the worker must be able
  to import its module. Modules of rewards registered when a worker starts are
  imported by the worker before it takes work.

Built-in rewards live in ``tandem.rl.rewards.math``, ``tandem.rl.rewards.basic`` and
``tandem.rl.rewards.code`` and are registered by importing ``tandem.rl.rewards``. A new built-in
module is added to the imports in ``tandem/rl/rewards/__init__.py``; user modules can be loaded by
dotted path with ``load_reward_modules``.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.rl.core.registry import Registry

RewardFn = Callable[[str, Mapping[str, Any]], float]

REWARDS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a top-level reward function under ``name``."""
    return REWARDS.register(name)


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """Look up ``name`` (RegistryError with the registry's message if unknown).

    With ``kwargs``, returns ``functools.partial(fn, **kwargs)`` after checking
    that the function accepts them (TypeError naming the reward otherwise).
    """
    fn = REWARDS.get(name)
    if not kwargs:
        return fn
    try:
        inspect.signature(fn).bind_partial("", {}, **kwargs)
        hints = typing.get_type_hints(fn)
        for key, value in kwargs.items():
            if key in hints and not _is_a(value, hints[key]):
                raise TypeError(f"{key} must be {_type_name(hints[key])}, got {value!r}"[:300])
        check = getattr(fn, "check_kwargs", None)  # the function's own check of its settings
        if check is not None:
            check(**kwargs)
    except (TypeError, ValueError) as e:
        raise TypeError(f"reward function {name!r}: bad config {sorted(kwargs)}: {e}") from None
    return functools.partial(fn, **kwargs)


def _is_a(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from TOML) fits a reward's keyword annotation: str, int, float, bool,
    None, Literal, unions, and lists / mappings of those; anything else is not checked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint in (str, bool):
        return type(value) is hint
    if hint in (int, float):  # a bool is not a number here; an int is a float
        return type(value) is int or (hint is float and type(value) is float)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, collections.abc.Sequence):
        return isinstance(value, (list, tuple)) and (
            not args or all(_is_a(v, args[0]) for v in value)
        )
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping) and (
            len(args) != 2 or all(_is_a(k, args[0]) and _is_a(v, args[1]) for k, v in value.items())
        )
    return True


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "")


def reward_module(fn: RewardFn) -> str:
    """The dotted module a (possibly partial-wrapped) reward function lives in."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", "") or ""


def registered_modules() -> list[str]:
    """Importable modules that define the registered rewards (``__main__`` excluded)."""
    mods = {reward_module(REWARDS.get(n)) for n in REWARDS.names()}
    return sorted(m for m in mods if m and m not in ("__main__", "__mp_main__"))


def load_reward_modules(modules: Iterable[str]) -> None:
    """Import modules by dotted path so the rewards they define are registered."""
    for mod in modules:
        importlib.import_module(mod)
