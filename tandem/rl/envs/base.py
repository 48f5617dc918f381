"""The environment contract for multi-turn (agentic) rollouts, and its registry.

An `Environment` is configuration (which tools, which reward); it makes one
`Episode` per rollout. An episode is the state of one conversation::

    episode = env.new_episode()
    messages = episode.reset(row)              # initial chat messages (system, user, ...)
    result = episode.step(assistant_text)      # after every assistant turn
    # result.observation_messages: what the environment says back, e.g.
    #   [{"role": "tool", "content": "42"}]; rendered through the chat template
    # result.done / result.reward: the episode ended, with this final reward

Why episodes are plain picklable objects: the rollout driver (tandem/rl/rollout/agentic.py)
runs ``step`` in CPU worker processes (tandem/rl/workers/env_pool.py) and ships the episode to
the worker and back with every step. Nothing lives in a worker between steps, so
any worker can take any step, a dead worker loses no conversation, and a step
that failed can be retried from the state before it. Consequently an episode and
its environment must pickle small: keep configuration and conversation data in
them, and build heavy or unpicklable helpers (tool closures, reward partials)
lazily, dropping them in ``__getstate__`` (see `LazyState`).

The turn limit and the total token limit are enforced by the driver, not by the
environment: the driver calls ``step`` on every finished assistant turn (so the
last answer is always scored) and then stops the episode if a limit is reached.

Environments are registered by name in ``ENVIRONMENTS`` and built from a config
as ``make_env(name, kwargs)``; the class (or factory) must live in an importable
module so worker processes can unpickle its episodes.
"""

from __future__ import annotations

import abc
import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.rl.core.registry import Registry
from tandem.rl.core.reward_range import reward_problem
from tandem.rl.fault.inject import tool_delay

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Episode",
    "LazyState",
    "Message",
    "StepResult",
    "make_env",
    "row_messages",
    "step_episode",
]

Message = dict[str, Any]  # a chat message: {"role": ..., "content": ...}


@dataclass
class StepResult:
    """What an environment returns after one assistant turn.

    ``reward`` is the episode's final reward when ``done`` (None: the environment
    gives none, the trainer's reward functions decide). ``info`` holds per-step
    counters (floats) that the driver sums over the episode, e.g. ``tool_calls``,
    ``tool_errors``, ``sandbox_limit_hits``.
    """

    observation_messages: list[Message]
    done: bool
    reward: float | None = None
    info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.observation_messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"StepResult: every observation message needs 'role' and 'content', got {m!r}"
                )
        if self.reward is not None:
            why = reward_problem(self.reward)
            if why is not None:
                raise ValueError(f"StepResult: reward {why}")
            self.reward = float(self.reward)


class LazyState:
    """Mixin: attributes named in ``_lazy`` are dropped when pickled and rebuilt on use.

    Why: tools hold closures and rewards may be ``functools.partial`` objects; both
    are cheap to rebuild from configuration in the worker and need not travel.
    """

    _lazy: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._lazy:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class Episode(abc.ABC):
    """One conversation with an environment (see the module docstring)."""

    @abc.abstractmethod
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """Start on dataset ``row``; return the initial chat messages (no assistant turn)."""

    @abc.abstractmethod
    def step(self, assistant_text: str) -> StepResult:
        """React to one assistant turn (its text, without the end-of-turn token)."""


class Environment(abc.ABC):
    """Configuration of a kind of episode; picklable and cheap to construct."""

    name: str = "environment"

    @abc.abstractmethod
    def new_episode(self) -> Episode:
        """A fresh episode (call ``reset(row)`` on it next)."""

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """OpenAI-format tool schemas for the chat template's ``tools=`` (None: no tools)."""
        return None

    def clone_episode(self, episode: Episode) -> Episode:
        """An independent copy of a reset episode (the n samples of one row)."""
        return copy.deepcopy(episode)


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment")


def make_env(name: str, kwargs: Mapping[str, Any] | None = None) -> Environment:
    """Build the registered environment ``name`` from its config ``kwargs``.

    Unknown names raise RegistryError listing the registered ones; bad kwargs raise
    TypeError naming the environment.
    """
    cls = ENVIRONMENTS.get(name)
    try:
        return cls(**dict(kwargs or {}))
    except TypeError as e:
        raise TypeError(f"environment {name!r}: bad config {sorted(kwargs or {})}: {e}") from None


def row_messages(row: Mapping[str, Any], system_prompt: str | None = None) -> list[Message]:
    """The initial messages of a dataset row: ``row["messages"]``, else one user turn
    of ``row["prompt"]``; ``system_prompt`` is prepended when the row has none."""
    if "messages" in row and row["messages"]:
        messages = [dict(m) for m in row["messages"]]
    elif "prompt" in row:
        messages = [{"role": "user", "content": str(row["prompt"])}]
    else:
        raise ValueError(f"row {row.get('id', '?')!r} has neither 'messages' nor 'prompt'")
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def step_episode(episode: Episode, assistant_text: str) -> tuple[Episode, StepResult]:
    """One step, as run in a pool worker: the advanced episode travels back with its result
    (held first by the slow-tools drill, TANDEM_INJECT_TOOL_DELAY, when it is set)."""
    if delay := tool_delay(assistant_text):
        time.sleep(delay)
    result = episode.step(assistant_text)
    if not isinstance(result, StepResult):
        raise TypeError(
            f"{type(episode).__name__}.step returned {type(result).__name__}, not StepResult"
        )
    return episode, result
