"""The "by_source" reward: each row is scored by the reward function its data source names.

verl's RL datasets carry a ``data_source`` column ("openai/gsm8k", "lighteval/MATH", ...)
and verl picks a scorer by it; with ``reward.functions = ["by_source"]`` Tandem does the same
through its reward registry. A source is looked up in ``routes`` (``[reward.kwargs.by_source]
routes = {"my/source" = "exact_match"}``), then in the built-in table below, then as a
reward function's own name. A row whose source routes nowhere raises (the pool scores it 0
and counts an error for "by_source", with this message), so nothing is scored silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.rl.core.fields import get_field
from tandem.rl.rewards.registry import REWARDS, register_reward

# verl's math sources, all scored by final-answer equivalence ("math": \boxed{}, "#### x", ...)
BUILTIN_ROUTES = {
    "openai/gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
}


def route(source: Any, routes: Mapping[str, str] | None = None) -> str | None:
    """The reward function a data source names, or None."""
    if not isinstance(source, str):
        return None
    name = (routes or {}).get(source) or BUILTIN_ROUTES.get(source)
    if name is None and source in REWARDS.names():
        name = source
    return name


@register_reward("by_source")
def by_source(
    completion: str,
    sample: Mapping[str, Any],
    *,
    field: str = "data_source",
    routes: Mapping[str, str] | None = None,
) -> float:
    source = get_field(dict(sample), field)
    name = route(source, routes)
    if name is None or name == "by_source":
        raise ValueError(
            f"{field}={source!r} names no reward function: add it to "
            f"[reward.kwargs.by_source] routes (e.g. routes = {{{source!r} = "
            f'"math"}})'
        )
    return float(REWARDS.get(name)(completion, sample))


def _check_routes(field: str = "data_source", routes: Mapping[str, str] | None = None) -> None:
    """At start (`get_reward`): every route names a reward function other than by_source."""
    for source, name in (routes or {}).items():
        if name == "by_source" or name not in REWARDS.names():
            raise ValueError(
                f"routes: {source!r} = {name!r} names no reward function "
                f"(known: {', '.join(n for n in REWARDS.names() if n != 'by_source')})"
            )


by_source.check_kwargs = _check_routes
