"""An episode as a session: the canonical token sequence, the append-only check, the samples.

A session holds the tokens its model actually saw: the first request's rendered prompt,
then per turn the sampled tokens (loss mask True, with their log-probs) and what the
harness appended since (the next request's new messages, rendered; mask False). Sampled
tokens are never re-tokenized, so the trained ids are the sampled ids by construction.

The append-only check: a later request's conversation, rendered with the chat template,
must start with the text of the tokens the session holds (its ``history_text``); then only
the remainder is tokenized and appended. A harness that edits an earlier turn, a template
that rewrites history (Qwen3 drops earlier reasoning), different ``tools``, or a sequence
that already stopped (a real eos, the context limit) fails it; the session then starts a
new *segment* (a new training sample, its prompt the whole rendered conversation) instead
of re-tokenizing the old one. With ``prompt_token_ids`` (token-in) the check is on ids:
the new ids must start with the session's ids. Pure Python (the tokenizer is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.rl.generator.sequence import Sequence


@dataclass
class Task:
    """An episode the RL rollout hands to the harness (training mode)."""

    id: str
    group: int  # the pooled prompt it plays
    row: dict[str, Any]
    seed: int | None
    greedy: bool = False
    claimed_at: float | None = None  # set by the HTTP thread when a harness takes it


@dataclass
class Session:
    """One conversation. ``segments``: the generator sequences it sampled (usually one)."""

    id: str
    task: Task | None = None
    ephemeral: bool = False  # one request without a session: closed after its turn
    segments: list[tuple[int, Sequence]] = field(default_factory=list)  # (engine key, sequence)
    history_text: str = ""
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    busy: bool = False  # a turn is in flight
    closed: str | None = None  # "reward" | "abort" | "timeout" | "disconnect" | "done"
    reward: float | None = None
    turn_rewards: dict[int, float] = field(default_factory=dict)
    forks: int = 0  # segments started because a request was not append-only
    touched: float = 0.0  # time.monotonic() of its last turn's start or end (session expiry)

    @property
    def seq(self) -> Sequence | None:
        return self.segments[-1][1] if self.segments else None

    def total_reward(self) -> float | None:
        if self.reward is None and not self.turn_rewards:
            return None
        return (self.reward or 0.0) + sum(self.turn_rewards.values())


def plan_turn(
    session: Session,
    tok: Any,
    messages: list[dict[str, Any]] | None,
    prompt_ids: list[int] | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[str, list[int], str]:
    """How a request continues ``session``: ``("append", ids, text)`` (ids to append to the
    current sequence; text: their rendering) or ``("new", prompt_ids, text)`` (a new segment).
    Raises ValueError when the request appends nothing to a live sequence."""
    seq = session.seq
    if prompt_ids is not None:  # token-in: the check is on ids
        if (
            seq is not None
            and not seq.is_finished
            and prompt_ids[: seq.num_tokens] == seq.token_ids
        ):
            new = prompt_ids[seq.num_tokens :]
            if not new:
                raise ValueError(
                    "prompt_token_ids: the session already holds these ids; append the next turn's"
                )
            return "append", new, tok.decode(new)
        return "new", list(prompt_ids), tok.decode(prompt_ids)
    assert messages is not None
    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    if (
        seq is not None
        and not seq.is_finished
        and tools == session.tools
        and full.startswith(session.history_text)
    ):
        delta = full[len(session.history_text) :]
        ids = tok.encode(delta) if delta else []
        if not ids:
            raise ValueError(
                "messages: nothing new after the session's last turn; append the next messages"
            )
        return "append", ids, delta
    return "new", tok.encode(full), full


def samples_of(session: Session) -> list[dict[str, Any]]:
    """The session's training samples: per segment that sampled a token, its prompt, the
    completion (sampled and appended tokens), the loss mask and the sampled tokens' log-probs."""
    out = []
    for _, seq in session.segments:
        mask = seq.completion_sampled_mask
        if not any(mask):
            continue
        raw = iter(seq.raw_logprobs)
        out.append(
            {
                "prompt_ids": seq.token_ids[: seq.num_prompt_tokens],
                "completion_ids": seq.completion_token_ids,
                "loss_mask": mask,
                "gen_logprobs": [next(raw) if m else 0.0 for m in mask],
                "finish_reason": "length" if seq.finish_reason == "length" else "stop",
            }
        )
    return out
