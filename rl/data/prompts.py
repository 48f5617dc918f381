"""Prompt datasets for RL: local jsonl/parquet or synthetic tasks, chat-templated.

A row is a question (``prompt`` field) or a conversation (``messages``) plus a
ground truth (``answer``); everything else in the row travels with it to the
reward functions. ``synthetic:<task>`` generates rows in code (rl/data/tasks.py),
with the task's held-out split for evaluation.

`PromptStream` hands each data-parallel rank its own endless sequence of rows
(per-epoch shuffles of one global order); its position is a single integer per
rank, saved in checkpoints, so resume continues with the next unseen prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl.data.loading import DataError, load_rows, message_problem, row_where

SYNTHETIC = "synthetic:"


def load_prompt_rows(path: str, fmt: str, *, split: str, seed: int, n_synthetic: int) -> list[dict[str, Any]]:
    if path.startswith(SYNTHETIC):
        from rl.data.tasks import TASKS, make_task_rows, parse_synthetic

        name, knobs = parse_synthetic(path[len(SYNTHETIC):])
        from rl.data.agentic_tasks import AGENTIC_TASKS, make_agentic_rows

        if name in AGENTIC_TASKS:  # multi-turn tasks (env.name): code rows carry hidden tests, not an answer
            try:
                rows = make_agentic_rows(name, n_synthetic, seed, split, **knobs)  # type: ignore[arg-type]
            except ValueError as e:
                raise DataError(f"data.path: {path}: {e}") from None
            return [{**r, "answer": r.get("answer", "")} for r in rows]
        if name not in TASKS:
            raise DataError(f"data.path: {TASKS.unknown_message(name)}")
        try:
            return make_task_rows(name, n_synthetic, seed, split, **knobs)  # type: ignore[arg-type]
        except ValueError as e:
            raise DataError(f"data.path: {path}: {e}") from None
    return load_rows(path, fmt)


@dataclass
class Prompt:
    index: int  # row index in its dataset
    token_ids: list[int]
    row: dict[str, Any]


def prompt_messages(row: dict[str, Any], prompt_field: str, messages_field: str) -> list[dict[str, Any]]:
    """The conversation a row's prompt is rendered from: its messages, or one user turn; ValueError if neither."""
    msgs = row.get(messages_field)
    if msgs is None:
        q = row.get(prompt_field)
        if q is None or q == "":
            raise ValueError(f"missing field: neither {messages_field!r} nor {prompt_field!r}")
        if not isinstance(q, str):
            raise ValueError(f"field {prompt_field!r} must be a string, got {type(q).__name__}")
        msgs = [{"role": "user", "content": q}]
    if (problem := message_problem(msgs)) is not None:
        raise ValueError(f"field {messages_field!r}: {problem}")
    return msgs


def encode_prompts(rows: list[dict[str, Any]], tokenizer: Any, *, source: str, prompt_field: str,
                   messages_field: str, answer_field: str, max_prompt_tokens: int,
                   on_bad_row: str = "skip") -> tuple[list[Prompt], dict[str, int]]:
    """Chat-template and tokenize; bad rows (a missing field, or one of the wrong type) are
    counted (or raise DataError naming the file and line)."""
    out: list[Prompt] = []
    skipped: dict[str, int] = {}
    has_template = getattr(tokenizer, "chat_template", None) is not None
    for i, row in enumerate(rows):
        try:
            if answer_field not in row or row[answer_field] is None:
                raise ValueError(f"missing field {answer_field!r}")
            if not isinstance(row[answer_field], str):
                raise ValueError(f"field {answer_field!r} must be a string, got {type(row[answer_field]).__name__}")
            msgs = prompt_messages(row, prompt_field, messages_field)
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True) if has_template else msgs[-1]["content"]
            ids = tokenizer.encode(text)
            if len(ids) > max_prompt_tokens:
                raise ValueError(f"prompt longer than {max_prompt_tokens} tokens")
        except ValueError as e:
            if on_bad_row == "error":
                raise DataError(f"{row_where(rows, i, source)}: {e} (set data.on_bad_row=skip to skip such rows)") from None
            reason = str(e)
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        out.append(Prompt(i, ids, {**row, "answer": row[answer_field]}))
    if not out:
        raise DataError(f"{source}: no usable prompt rows ({skipped} skipped)")
    return out, skipped


class PromptStream:
    """Rank r reads positions r, r+dp, r+2dp, ... of the global epoch-shuffled chain."""

    def __init__(self, num_rows: int, seed: int, dp_rank: int, dp_size: int, shuffle: bool = True,
                 cursor: int = 0) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cursor = cursor  # how many rows this rank has taken
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 7_919 + epoch)
                self._perms[epoch] = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.num_rows))
        return self._perms[epoch]

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            g = self.cursor * self.dp_size + self.dp_rank
            out.append(self._perm(g // self.num_rows)[g % self.num_rows])
            self.cursor += 1
        return out

    @property
    def epoch(self) -> int:
        return (self.cursor * self.dp_size + self.dp_rank) // self.num_rows
