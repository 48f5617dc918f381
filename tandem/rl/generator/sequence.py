"""Per-request state of the generator: `SamplingParams` and `Sequence`.

A `Sequence` is one rollout: its prompt, every token appended since (sampled by
the policy or appended by an environment between turns), the log-probs of the
sampled ones, and where its KV lives (``block_table``, ``num_computed_tokens``).
The scheduler and block manager own the state transitions; everything else only
reads it. Pure Python, no torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED, with PAUSED between turns."""

    WAITING = "waiting"  # queued; may already hold KV blocks (forked, resumed)
    RUNNING = "running"  # admitted: scheduled every step while budget allows
    PAUSED = "paused"  # between turns: not scheduled, keeps its blocks unless preempted
    FINISHED = "finished"  # stopped, hit a length limit, or aborted; holds no blocks


MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (docs/serving.md); logits / 1e-5 fit float32


@dataclass
class SamplingParams:
    """How one sequence samples. Validated on construction and again at admission.

    ``seed`` fixes the sequence's randomness: the token at index i depends only on
    (seed, i) and the logits, never on the batch or on preemption. Identical seeds
    give identical samples, so give the members of a group distinct seeds.
    """

    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_tokens: int = 256  # cap on sampled tokens (environment tokens do not count)
    seed: int | None = None  # None: the runner derives one
    stop_token_ids: list[int] = field(default_factory=list)  # stop even with ignore_eos
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperature 0, or a positive one below ``MIN_TEMPERATURE``: logits divided by it
        overflow float32 (1e-300 made every logit inf and sampled token 0), and the
        distribution it means is the argmax's already."""
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(
                f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}"
            )
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(
                f"SamplingParams.min_p must be in [0, 1] (0 = off), got {self.min_p!r}"
            )
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise ValueError(
                f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        bad = [
            s for s in self.stop_token_ids if not isinstance(s, int) or isinstance(s, bool) or s < 0
        ]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids must be ints >= 0, got {bad!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")


class Sequence:
    """One request's tokens, masks, log-probs and KV bookkeeping.

    Invariants the scheduler keeps: ``token_ids[:num_computed_tokens]`` have K/V
    in the blocks of ``block_table`` (block j holds positions [j*bs, (j+1)*bs));
    an unfinished sequence always has at least one uncomputed token (the last
    one, whose logits give the next sample).
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        params: SamplingParams | None = None,
        group_id: int | None = None,
        images: object = None,
    ) -> None:
        tokens = [int(t) for t in prompt_token_ids]
        if not tokens:
            raise ValueError(f"sequence {seq_id}: the prompt is empty; it needs at least one token")
        self.seq_id = seq_id
        self.token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.sampled: list[bool] = [False] * len(tokens)  # per token: sampled by the policy
        self.logprobs: list[float] = []  # per sampled token, under the sampling distribution
        self.raw_logprobs: list[float] = []  # per sampled token, log_softmax of raw logits
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.state_slot: int | None = None  # linear-attention models: its recurrent state's slot
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.group_id = group_id
        self.params = params if params is not None else SamplingParams()
        self.arrival = -1  # set by the scheduler: order of add_group calls, then group order
        # the prompt's PromptImages (vision-language models), shared by its group
        self.images = images

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, generated={self.num_generated}, "
            f"blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens the policy sampled (environment tokens excluded)."""
        return len(self.logprobs)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def completion_token_ids(self) -> list[int]:
        """Everything after the prompt: sampled and environment tokens, in order."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def completion_sampled_mask(self) -> list[bool]:
        """``sampled`` for the completion tokens: the loss mask of the rollout."""
        return self.sampled[self.num_prompt_tokens :]

    def append_sampled(self, token_id: int, logprob: float, raw_logprob: float) -> None:
        self.token_ids.append(token_id)
        self.sampled.append(True)
        self.logprobs.append(logprob)
        self.raw_logprobs.append(raw_logprob)

    def append_external(self, token_ids: Iterable[int]) -> None:
        """Tokens the policy did not sample (tool output, user turn): mask False."""
        new = [int(t) for t in token_ids]
        self.token_ids.extend(new)
        self.sampled.extend([False] * len(new))
