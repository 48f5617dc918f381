"""The "tool" environment: the policy may call tools, then answers; the answer is scored.

Each assistant turn is parsed with ``tandem.rl.envs.tools.parse_tool_calls``. If it has
``<tool_call>`` blocks, each is dispatched to the configured tools (``python``
runs in tandem/rl/sandbox/__init__.py, ``calculator`` is an AST whitelist) and every result comes
back as one ``{"role": "tool", "content": ...}`` observation; a malformed call
is an ``Error: ...`` observation, never an exception. A turn without tool calls
is the final answer: the episode ends and the configured reward function from
``tandem.rl.rewards`` (default "math") scores it against the row. A reward function that
raises scores 0 and is counted (``reward_errors``), as in ``RewardPool``.

Per-step info (summed over the episode by the driver): ``tool_calls``,
``tool_errors`` (``Error:`` results and python runs with a non-zero exit),
``sandbox_limit_hits`` (python runs stopped by a sandbox limit). The last two are
read from the python tool's documented output format (``[stopped: ...]``,
``[exit code N]`` lines); the program can print those lines itself, so they are
diagnostics, never rewards.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.rl.envs.base import (
    ENVIRONMENTS,
    Environment,
    Episode,
    LazyState,
    Message,
    StepResult,
    row_messages,
)
from tandem.rl.envs.tools import (
    TOOLS,
    Tool,
    ToolCallError,
    dispatch,
    make_python_tool,
    parse_tool_calls,
)
from tandem.rl.rewards.registry import RewardFn, get_reward
from tandem.rl.sandbox import SandboxLimits

__all__ = ["ToolEnv", "ToolEnvConfig", "ToolEpisode"]

_STOPPED_RE = re.compile(r"^\[stopped: .*\]$", re.M)
_EXIT_RE = re.compile(r"^\[exit code -?\d+\]$", re.M)


@dataclass(frozen=True)
class ToolEnvConfig:
    """Settings of the tool environment (the ``env_kwargs`` of a config).

    ``python_limits`` are `SandboxLimits` fields for the python tool (e.g.
    ``{"wall_time_s": 5}``); ``reward_kwargs`` bind the reward's keyword options.
    ``schemas_in_prompt = false`` keeps the tools' JSON schemas out of the chat
    template's system turn (a few hundred tokens each), leaving the tools to be
    named by ``system_prompt`` or the task's prompt; for small-context models.
    """

    tools: tuple[str, ...] = ("python", "calculator")
    reward: str = "math"
    reward_kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    max_tool_calls_per_turn: int = 4
    max_tool_output_chars: int = 2000
    python_limits: Mapping[str, Any] = field(default_factory=dict)
    schemas_in_prompt: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        for name in self.tools:
            TOOLS.get(name)  # RegistryError naming the unknown tool
        if self.max_tool_calls_per_turn < 1:
            raise ValueError(
                f"max_tool_calls_per_turn must be >= 1, got {self.max_tool_calls_per_turn}"
            )
        if self.max_tool_output_chars < 64:
            raise ValueError(
                f"max_tool_output_chars must be >= 64, got {self.max_tool_output_chars}"
            )
        SandboxLimits(**dict(self.python_limits))  # validates the names and values
        get_reward(self.reward, **dict(self.reward_kwargs))  # validates name and kwargs


@ENVIRONMENTS.register("tool")
class ToolEnv(LazyState, Environment):
    """Tool calling then a scored final answer; see the module docstring."""

    name = "tool"
    _lazy = ("_tools", "_reward_fn")

    def __init__(self, **kwargs: Any) -> None:
        self.config = self._make_config(kwargs)
        self._tools: dict[str, Tool] | None = None
        self._reward_fn: RewardFn | None = None

    @classmethod
    def _make_config(cls, kwargs: Mapping[str, Any]) -> ToolEnvConfig:
        return ToolEnvConfig(**kwargs)

    # ---- lazily built helpers (not pickled) -----------------------------------------------
    @property
    def tools(self) -> dict[str, Tool]:
        if self._tools is None:
            tools = {}
            for name in self.config.tools:
                tool = TOOLS.get(name)
                if name == "python" and self.config.python_limits:
                    tool = make_python_tool(SandboxLimits(**dict(self.config.python_limits)))
                tools[name] = tool
            self._tools = tools
        return self._tools

    @property
    def reward_fn(self) -> RewardFn:
        if self._reward_fn is None:
            self._reward_fn = get_reward(self.config.reward, **dict(self.config.reward_kwargs))
        return self._reward_fn

    # ---- Environment ------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        if not self.config.schemas_in_prompt:
            return None
        return [t.schema() for t in self.tools.values()] or None

    def new_episode(self) -> ToolEpisode:
        return ToolEpisode(self)

    def check_row(self, row: Mapping[str, Any]) -> None:
        """Raise ValueError when ``row`` lacks what the reward needs."""
        if "answer" not in row:
            raise ValueError(f"tool env: row {row.get('id', '?')!r} has no 'answer' field")

    def run_calls(self, text: str) -> tuple[list[Message], dict[str, float]]:
        """Dispatch every tool call of ``text``: observations and counters."""
        calls = parse_tool_calls(text, self.tools)
        info = {"tool_calls": float(len(calls)), "tool_errors": 0.0, "sandbox_limit_hits": 0.0}
        obs: list[Message] = []
        limit = self.config.max_tool_calls_per_turn
        for i, call in enumerate(calls):
            if i >= limit:
                out = f"Error: at most {limit} tool calls per turn; this one was not run"
            else:
                out = dispatch(call, self.tools, max_chars=self.config.max_tool_output_chars)
            if out.startswith("Error:") or isinstance(call, ToolCallError) or _EXIT_RE.search(out):
                info["tool_errors"] += 1
            if _STOPPED_RE.search(out):
                info["sandbox_limit_hits"] += 1
            obs.append({"role": "tool", "content": out})
        return obs, info

    def score(self, text: str, row: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """The final reward; a raising reward function scores 0 and is counted."""
        try:
            return float(self.reward_fn(text, row)), {}
        except Exception:  # a broken verifier must not kill the rollout; it is counted
            return 0.0, {"reward_errors": 1.0}


class ToolEpisode(Episode):
    """State of one tool-calling conversation: the row and the turn count."""

    def __init__(self, env: ToolEnv) -> None:
        self.env = env
        self.row: dict[str, Any] = {}
        self.turns = 0

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.env.check_row(row)
        self.row = dict(row)
        self.turns = 0
        return row_messages(row, self.env.config.system_prompt)

    def step(self, assistant_text: str) -> StepResult:
        self.turns += 1
        obs, info = self.env.run_calls(assistant_text)
        if obs:
            return StepResult(obs, done=False, info=info)
        reward, extra = self.env.score(assistant_text, self.row)
        return StepResult([], done=True, reward=reward, info={**info, **extra})
