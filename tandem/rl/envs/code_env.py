"""The "code" environment: the policy writes a function, may test it, is scored on hidden tests.

The conversation is the tool loop of tandem/rl/envs/tool_env.py with other defaults:
the only tool is ``python`` (so the policy can try its code on its own examples;
set ``tools=()`` to offer none) and the final turn, the first one without a tool
call, is scored by ``code_unit_tests``: the fraction of the row's hidden
``tests`` its last fenced code block passes, in the sandbox. The tests are never
shown to the policy. Rows need ``tests`` (and optionally ``entry_point``), the
shape tandem/rl/rewards/code.py documents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.rl.envs.base import ENVIRONMENTS
from tandem.rl.envs.tool_env import ToolEnv, ToolEnvConfig

__all__ = ["CodeEnv", "CODE_SYSTEM_PROMPT"]

CODE_SYSTEM_PROMPT = (
    "You write Python functions. You may run code with the python tool to test it. "
    "When you are done, reply with the complete solution in one ```python block."
)


@ENVIRONMENTS.register("code")
class CodeEnv(ToolEnv):
    """Tool loop with python only, final answer scored by hidden unit tests."""

    name = "code"

    @classmethod
    def _make_config(cls, kwargs: Mapping[str, Any]) -> ToolEnvConfig:
        defaults: dict[str, Any] = {
            "tools": ("python",),
            "reward": "code_unit_tests",
            "system_prompt": CODE_SYSTEM_PROMPT,
        }
        return ToolEnvConfig(**{**defaults, **kwargs})

    def check_row(self, row: Mapping[str, Any]) -> None:
        if not row.get("tests"):
            raise ValueError(f"code env: row {row.get('id', '?')!r} has no 'tests' field")
