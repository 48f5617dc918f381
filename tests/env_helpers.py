"""Test-only environments and model helpers for the agentic tests (not tests themselves).

They live in an importable module, not in a test file, because spawned pool
workers unpickle episodes by reference and must import their classes. Importing
this module registers "sleepy", "again" and "tool_pid" in ``ENVIRONMENTS``. It imports torch
and the model code only inside the helpers that need them, so a worker that unpickles a sleepy
episode starts in a fraction of a second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.rl.envs.base import (
    ENVIRONMENTS,
    Environment,
    Episode,
    Message,
    StepResult,
    row_messages,
)
from tandem.rl.envs.tool_env import ToolEnv, ToolEpisode

# The quickstart with the "again" environment (AgainEnv): two turns, scored by the environment
AGAIN_FLAGS = (
    "--env.name=again",
    "--env.max_turns=2",
    "--env.max_total_tokens=128",
    "--rollout.max_tokens=12",
    "--reward.functions=",
    "--reward.modules=tests.env_helpers",
)


class SleepyEnv(Environment):
    """Sleeps ``sleep_s`` per step and answers ``turns`` times before ending the episode.

    ``raise_on_turn`` / ``crash_on_turn`` make that turn's step raise or kill the
    worker (only for rows with ``"faulty": True`` when ``only_faulty_rows``).
    The final reward is the number of turns the episode saw.
    """

    name = "sleepy"

    def __init__(
        self,
        sleep_s: float = 0.1,
        turns: int = 3,
        raise_on_turn: int | None = None,
        crash_on_turn: int | None = None,
        only_faulty_rows: bool = False,
    ) -> None:
        self.sleep_s, self.turns = sleep_s, turns
        self.raise_on_turn, self.crash_on_turn = raise_on_turn, crash_on_turn
        self.only_faulty_rows = only_faulty_rows

    def new_episode(self) -> SleepyEpisode:
        return SleepyEpisode(self)


class SleepyEpisode(Episode):
    def __init__(self, env: SleepyEnv) -> None:
        self.env = env
        self.turn = 0
        self.row: dict[str, Any] = {}
        self.seen: list[str] = []

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.row = dict(row)
        return row_messages(row)

    def step(self, assistant_text: str) -> StepResult:
        env = self.env
        self.turn += 1
        faulty = self.row.get("faulty", False) or not env.only_faulty_rows
        if faulty and env.crash_on_turn == self.turn and os.getpid() != self.row.get("parent_pid"):
            os._exit(3)
        if faulty and env.raise_on_turn == self.turn:
            raise RuntimeError(f"sleepy env broke on turn {self.turn}")
        time.sleep(env.sleep_s)
        self.seen.append(assistant_text)
        if self.turn >= env.turns:
            return StepResult([], done=True, reward=float(self.turn), info={"tool_calls": 0.0})
        return StepResult([{"role": "user", "content": f"ok {self.turn}"}], done=False)


class AgainEnv(Environment):
    """Asks the row's question a second time; the second answer scores 1 if it starts with "2".

    A two-turn episode the quickstart policy can play from the start (the
    observation is a question like the ones it was trained on), with a reward
    it can learn in a few RL steps, as in tests/recipes/test_rl_loop.py.
    """

    name = "again"

    def new_episode(self) -> AgainEpisode:
        return AgainEpisode()


class AgainEpisode(Episode):
    def __init__(self) -> None:
        self.turn = 0
        self.question = ""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.question = str(row["prompt"])
        return row_messages(row)

    def step(self, assistant_text: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": self.question}], done=False)
        return StepResult([], done=True, reward=float(assistant_text.strip().startswith("2")))


class PidToolEnv(ToolEnv):
    """The "tool" environment (tandem/rl/envs/tool_env.py) that also appends, per step, the
    pid of the process that submitted it (the env worker's parent; the worker itself when run
    inline) to the file ``log``: which trainer rank ran the tools, and how often."""

    name = "tool_pid"

    def __init__(self, log: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = log

    def new_episode(self) -> PidToolEpisode:
        return PidToolEpisode(self)


class PidToolEpisode(ToolEpisode):
    def step(self, assistant_text: str) -> StepResult:
        with open(self.env.log, "a") as f:  # one short line per write: appends do not interleave
            f.write(f"{os.getppid()} {os.getpid()}\n")
        return super().step(assistant_text)


if "sleepy" not in ENVIRONMENTS:
    ENVIRONMENTS.register("sleepy")(SleepyEnv)
if "again" not in ENVIRONMENTS:
    ENVIRONMENTS.register("again")(AgainEnv)
if "tool_pid" not in ENVIRONMENTS:
    ENVIRONMENTS.register("tool_pid")(PidToolEnv)

if TYPE_CHECKING:
    import torch

    from tandem.models.tokenizer import Tokenizer
    from tandem.models.transformer import Transformer


def char_tokenizer(tmp: Path) -> Tokenizer:
    from tandem.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(tmp / "tok")


def tiny_model(seed: int = 0, logit_bias: Mapping[int, float] | None = None) -> Transformer:
    """debug-qwen3 from ``init_weights(seed)``, fp32, eval.

    ``logit_bias`` becomes a bias of the output layer (test only): generation and the
    training forward both run ``model.output``, so log-prob equality still holds, and
    a random model can be made to end turns every few tokens.
    """
    import torch

    from tandem.models.flavors import get_flavor
    from tandem.models.transformer import Transformer

    model = Transformer(get_flavor("debug-qwen3"))
    model.init_weights(seed=seed)
    if logit_bias:
        bias = torch.zeros(model.args.vocab_size)
        for tid, value in logit_bias.items():
            bias[tid] = value
        model.output.bias = torch.nn.Parameter(bias)
    return model.eval()


def agentic_model(tok: Tokenizer, seed: int = 0, eot_bias: float = 4.5) -> Transformer:
    """A tiny model whose turns end with <|im_end|> after a few tokens (about 1 in
    ``1 + 360 / e**eot_bias``), never samples <|endoftext|> or ids the tokenizer lacks."""
    from tandem.models.flavors import get_flavor

    bias = {i: -30.0 for i in range(tok.vocab_size, get_flavor("debug-qwen3").vocab_size)}
    bias[tok.token_to_id("<|endoftext|>")] = -30.0
    bias[tok.token_to_id("<|im_end|>")] = eot_bias
    return tiny_model(seed, bias)


def train_logprobs(model: Transformer, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(token) of every completion token from one training forward of prompt+completion."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)  # [S, V]
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)]
