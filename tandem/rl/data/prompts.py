"""Prompt datasets for RL: local jsonl/parquet or synthetic tasks, chat-templated.

A row is a question (``prompt`` field) or a conversation (``messages``) plus a
ground truth (``answer``); everything else in the row travels with it to the
reward functions. ``synthetic:<task>`` generates rows in code (tandem/rl/data/tasks.py),
with the task's held-out split for evaluation.

`PromptStream` is one endless global sequence of rows (per-epoch shuffles of
one order) that every rank reads in step: a step takes the next positions of the
stream and `deal` splits them over the data-parallel ranks, so the union of a
step's prompts does not depend on the number of ranks. Its position is a single
integer, the same on every rank, saved in checkpoints: a resume on any world
size continues with the next unseen prompt. A prompt's position in the stream is
its id in `rollout_seed`, which keys its samples' random streams.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, TypeVar

from tandem.rl.core.fields import get_field
from tandem.rl.data.images import VisionData, prepare_messages, with_images
from tandem.rl.data.loading import DataError, EpochOrder, load_rows, message_problem, row_where

SYNTHETIC = "synthetic:"
T = TypeVar("T")


def load_prompt_rows(
    path: str, fmt: str, *, split: str, seed: int, n_synthetic: int
) -> list[dict[str, Any]]:
    if path.startswith(SYNTHETIC):
        from tandem.rl.data.tasks import TASKS, make_task_rows, parse_synthetic

        name, knobs = parse_synthetic(path[len(SYNTHETIC) :])
        from tandem.rl.data.agentic_tasks import AGENTIC_TASKS, make_agentic_rows

        if name in AGENTIC_TASKS:
            # multi-turn tasks (env.name): code rows carry hidden tests, not an answer
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
    images: Any = None  # tandem.models.vlm.PromptImages of a row with images (vision-language
    # policies)


def prompt_messages(
    row: dict[str, Any], prompt_field: str, messages_field: str
) -> list[dict[str, Any]]:
    """The conversation a row's prompt is rendered from: its messages field, or its prompt
    field, which holds either text (one user turn) or a list of {role, content} messages (as in
    verl's and TRL's conversational prompt datasets). ValueError (one line) if neither."""
    msgs, field = get_field(row, messages_field), messages_field
    if msgs is None:
        q, field = get_field(row, prompt_field), prompt_field
        if q is None or q == "":
            raise ValueError(
                f"missing field: neither {messages_field!r} nor {prompt_field!r} "
                "(data.messages_field / data.prompt_field name them)"
            )
        if isinstance(q, str):
            return [{"role": "user", "content": q}]
        if not isinstance(q, list):
            raise ValueError(
                f"field {prompt_field!r} must be text or a list of {{role, "
                f"content}} messages, got {type(q).__name__} (data.prompt_field / "
                "data.messages_field name the fields)"
            )
        msgs = q
    if (problem := message_problem(msgs)) is not None:
        raise ValueError(
            f"field {field!r}: {problem} (data.messages_field names the messages field)"
        )
    return msgs


def encode_prompts(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    *,
    source: str,
    prompt_field: str,
    messages_field: str,
    answer_field: str,
    max_prompt_tokens: int,
    on_bad_row: str = "skip",
    vision: VisionData | None = None,
) -> tuple[list[Prompt], dict[str, int]]:
    """Chat-template and tokenize; bad rows (a missing field, or one of the wrong type, or an
    unreadable image) are counted (or raise DataError naming the file and line). ``vision``:
    a vision-language policy's image settings (tandem/rl/data/images.py); image tokens are
    expanded to their images' rows and the prompt carries its `PromptImages`."""
    out: list[Prompt] = []
    skipped: dict[str, int] = {}
    has_template = getattr(tokenizer, "chat_template", None) is not None
    for i, row in enumerate(rows):
        try:
            answer = get_field(row, answer_field)
            if answer is None:
                raise ValueError(f"missing field {answer_field!r} (data.answer_field names it)")
            if not isinstance(answer, str):
                raise ValueError(
                    f"field {answer_field!r} must be a string, got {type(answer).__name__}"
                )
            msgs = prepare_messages(prompt_messages(row, prompt_field, messages_field), vision)
            if not has_template and not isinstance(msgs[-1]["content"], str):
                raise ValueError("a prompt with images needs a tokenizer with a chat template")
            text = (
                tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                if has_template
                else msgs[-1]["content"]
            )
            ids, images, _ = with_images(msgs, tokenizer.encode(text), vision)
            if len(ids) > max_prompt_tokens:
                raise ValueError(f"prompt longer than {max_prompt_tokens} tokens")
        except ValueError as e:
            if on_bad_row == "error":
                raise DataError(
                    f"{row_where(rows, i, source)}: {e} (set data.on_bad_row=skip to "
                    "skip such rows)"
                ) from None
            reason = str(e).split(" (")[0]  # counted without the hint
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        out.append(Prompt(i, ids, {**row, "answer": answer}, images))
    if not out:
        raise DataError(f"{source}: no usable prompt rows ({skipped} skipped)")
    return out, skipped


class PromptStream:
    """The global chain of rows: position g is row ``perm(g // num_rows)[g % num_rows]``.

    Every rank holds the same cursor and takes the same positions; `deal` says which
    of them a rank generates for.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, cursor: int = 0) -> None:
        self.num_rows = num_rows
        self.cursor = cursor  # how many positions of the global chain have been taken
        self.order = EpochOrder(num_rows, seed * 7_919, shuffle)
        self.requeued: list[int] = []  # positions taken but given back untrained: taken again first

    def take(self, n: int) -> list[tuple[int, int]]:
        """The next n (position, row index) pairs: given-back positions first (lowest first),
        then the global chain's."""
        out = []
        for _ in range(n):
            if self.requeued:
                g = self.requeued.pop(0)
            else:
                g = self.cursor
                self.cursor += 1
            out.append((g, self.order.row(g)))
        return out

    def requeue(self, positions: list[int]) -> None:
        """Give back taken positions that will not train (asynchronous RL drops a group whose
        samples would break the staleness bound): they are taken again before new ones."""
        self.requeued = sorted(set(self.requeued) | set(positions))

    @property
    def epoch(self) -> int:
        return self.cursor // self.num_rows


def deal(items: list[T], rank: int, size: int) -> list[T]:
    """Rank ``rank``'s share of ``items``: every ``size``-th from ``rank`` on.

    Strided rather than contiguous so that contiguous minibatches of the global list
    are the union of contiguous minibatches of the ranks' lists (when the counts divide).
    """
    return items[rank::size]


def rollout_seed(job_seed: int, step: int, position: int) -> int:
    """The sampling seed of the prompt at stream ``position`` in ``step`` (its samples use
    seed + sample index): a hash of (job seed, step, prompt id), never of rank or batch slot,
    so the same samples come out on any number of ranks and any batch composition."""
    h = hashlib.blake2b(struct.pack("<qqq", job_seed, step, position), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2  # 62 bits: seed + sample index stays below 2**63
