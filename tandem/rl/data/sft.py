"""Supervised fine-tuning data: chat or prompt/completion rows -> packed rows.

The loss covers assistant tokens only. A chat row is rendered through the
tokenizer's chat template one assistant turn at a time: the text before each
assistant reply (the rendered history plus the generation prompt) is masked,
the reply and its end-of-turn token are trained. Rows are then packed into
rows of at most ``max_length`` tokens; each packed row carries document ids
and per-document positions so attention stays inside a document.

Bad rows (missing field, empty conversation, longer than max_length) are
counted and skipped, or raise DataError naming the file and row, by setting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.rl.core.fields import get_field
from tandem.rl.data.images import VisionData, prepare_messages, with_images
from tandem.rl.data.loading import DataError, EpochOrder, load_rows, message_problem, row_where

IGNORE = -100  # target id that takes no loss


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is trained (an assistant token)
    images: Any = None  # tandem.models.vlm.PromptImages of a chat with images (M-RoPE positions of
    # all its tokens)


class BadRow(ValueError):
    """A row that cannot become a training example; str() says why."""


def tokenize_chat(
    messages: Any, tokenizer: Any, tools: Any = None, vision: VisionData | None = None
) -> Example:
    """Token ids and loss mask of a chat: assistant turns trained, the rest context.

    ``tools`` (a list of JSON tool schemas, the row's ``tools`` field) is rendered
    by the chat template as it is at generation time, so tool-calling
    transcripts (assistant ``<tool_call>`` turns, ``tool`` results) train the
    format the policy will see in an agentic rollout. ``vision``: a vision-language
    policy's image settings; image parts become their images' tokens (never trained)."""
    if (problem := message_problem(messages)) is not None:
        raise BadRow(problem)
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise BadRow("tools must be a list of JSON objects (tool schemas)")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant message to train on")
    return tokenize_turns(messages, tokenizer, tools=tools, vision=vision)


def tokenize_turns(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    *,
    first: int = 0,
    tools: Any = None,
    vision: VisionData | None = None,
) -> Example:
    """Tokens of ``messages`` through the chat template; the assistant turns at index >= ``first``
    are trained (mask 1). The template is rendered turn by turn so the mask follows the rendered
    text, whatever the template adds around each turn; it must be prefix-stable. ``vision``: a
    vision-language policy's image settings (image parts become their images' tokens)."""
    try:
        messages = prepare_messages(messages, vision)
    except ValueError as e:
        raise BadRow(str(e)) from None
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # text already tokenized
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(
            messages[:i], tools=tools, add_generation_prompt=True
        )
        after = tokenizer.apply_chat_template(messages[: i + 1], tools=tools)
        if not before.startswith(done) or not after.startswith(before):
            raise BadRow("chat template is not prefix-stable; cannot locate assistant turns")
        for text, trained in ((before[len(done) :], 0), (after[len(before) :], 1)):
            piece = tokenizer.encode(text)
            ids += piece
            mask += [trained] * len(piece)
        done = after
    full = tokenizer.apply_chat_template(messages, tools=tools)
    if not full.startswith(done):
        raise BadRow("chat template is not prefix-stable; cannot locate assistant turns")
    tail = tokenizer.encode(full[len(done) :])
    try:
        ids, images, (mask,) = with_images(messages, ids + tail, vision, mask + [0] * len(tail))
    except ValueError as e:
        raise BadRow(str(e)) from None
    return Example(ids, mask, images)


def tokenize_prompt_completion(prompt: Any, completion: Any, tokenizer: Any) -> Example:
    for what, value in (("prompt", prompt), ("completion", completion)):
        if value is not None and not isinstance(value, str):
            raise BadRow(f"{what} must be a string, got {type(value).__name__}")
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise BadRow("prompt and completion must be non-empty strings")
    p = tokenizer.encode(prompt)
    c = tokenizer.encode(completion) + tokenizer.eos_token_ids[:1]
    return Example(p + c, [0] * len(p) + [1] * len(c))


@dataclass
class PackedRow:
    tokens: list[int]
    targets: list[int]  # next token where trained, IGNORE elsewhere
    positions: list[int]
    doc_ids: list[int]
    images: list[Any] = field(default_factory=list)  # per document: its PromptImages or None (text)

    @property
    def num_targets(self) -> int:
        return sum(t != IGNORE for t in self.targets)


def example_to_row(ex: Example) -> PackedRow:
    """Shift by one: token t predicts token t+1 when t+1 is trained."""
    n = len(ex.input_ids) - 1
    targets = [ex.input_ids[t + 1] if ex.loss_mask[t + 1] else IGNORE for t in range(n)]
    return PackedRow(ex.input_ids[:-1], targets, list(range(n)), [0] * n, [ex.images])


def pack_rows(rows: list[PackedRow], max_length: int) -> list[PackedRow]:
    """Greedy packing in order: append documents until the next would overflow."""
    packed: list[PackedRow] = []
    cur = PackedRow([], [], [], [])
    for r in rows:
        if cur.tokens and len(cur.tokens) + len(r.tokens) > max_length:
            packed.append(cur)
            cur = PackedRow([], [], [], [])
        doc = cur.doc_ids[-1] + 1 if cur.doc_ids else 0
        cur.tokens += r.tokens
        cur.targets += r.targets
        cur.positions += r.positions
        cur.doc_ids += [doc] * len(r.tokens)
        cur.images += r.images
    if cur.tokens:
        packed.append(cur)
    return packed


@dataclass
class SFTData:
    rows: list[PackedRow]
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    num_examples: int = 0


def build_sft_data(
    records: list[dict[str, Any]],
    tokenizer: Any,
    *,
    source: str,
    max_length: int,
    pack: bool = True,
    on_bad_row: str = "skip",
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    vision: VisionData | None = None,
) -> SFTData:
    """Tokenize, filter and pack; bad rows are counted or raise DataError. ``vision``: a
    vision-language policy's image settings (chats with image parts)."""
    out = SFTData(rows=[])
    singles: list[PackedRow] = []
    for i, rec in enumerate(records):
        try:
            messages = get_field(rec, messages_field)
            prompt, completion = get_field(rec, prompt_field), get_field(rec, completion_field)
            if messages is not None:
                ex = tokenize_chat(messages, tokenizer, rec.get("tools"), vision)
            elif isinstance(prompt, list) and isinstance(completion, list):
                # TRL's conversational form
                ex = tokenize_chat(prompt + completion, tokenizer, rec.get("tools"), vision)
            elif prompt is not None or completion is not None:
                ex = tokenize_prompt_completion(prompt, completion, tokenizer)
            else:
                raise BadRow(
                    f"missing field: neither {messages_field!r} nor {prompt_field!r}"
                    f"/{completion_field!r}"
                )
            if len(ex.input_ids) - 1 > max_length:
                raise BadRow(
                    f"longer than max_length ({len(ex.input_ids) - 1} > {max_length} tokens)"
                )
            if sum(ex.loss_mask[1:]) == 0:
                raise BadRow("no trained token")
        except BadRow as e:
            if on_bad_row == "error":
                raise DataError(
                    f"{row_where(records, i, source)}: {e} (set data.on_bad_row=skip "
                    "to skip such rows)"
                ) from None
            out.skipped[str(e).split(" (")[0]] += 1
            continue
        singles.append(example_to_row(ex))
    out.num_examples = len(singles)
    out.rows = pack_rows(singles, max_length) if pack else singles
    if not out.rows:
        raise DataError(f"{source}: no usable rows ({dict(out.skipped)} skipped)")
    return out


def collate(rows: list[PackedRow], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad rows to a [B, S] batch; padding has doc id -1 and no target."""
    s = max(len(r.tokens) for r in rows)

    def pad(xs: list[int], v: int) -> list[int]:
        return xs + [v] * (s - len(xs))

    return {
        "tokens": torch.tensor([pad(r.tokens, pad_id) for r in rows]),  # [B, S]
        "targets": torch.tensor([pad(r.targets, IGNORE) for r in rows]),  # [B, S]
        "positions": torch.tensor([pad(r.positions, 0) for r in rows]),  # [B, S]
        "doc_ids": torch.tensor([pad(r.doc_ids, -1) for r in rows]),  # [B, S]
    }


class StepSampler:
    """Which rows step s uses: a pure function of (seed, step), so resume is exact.

    The row order is an endless chain of per-epoch permutations; step s takes
    the global batch [s*B, (s+1)*B) of that chain, and data-parallel rank r
    takes every dp-th row of it.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.num_rows, self.batch_size = num_rows, batch_size
        self.order = EpochOrder(num_rows, seed * 1_000_003, shuffle)

    def global_batch(self, step: int) -> list[int]:
        start = step * self.batch_size
        return [self.order.row(i) for i in range(start, start + self.batch_size)]

    def epoch_of(self, step: int) -> int:
        return step * self.batch_size // self.num_rows

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        return self.global_batch(step)[dp_rank::dp_size]


def load_sft_records(path: str, fmt: str, *, seed: int, n_synthetic: int) -> list[dict[str, Any]]:
    """Rows of a jsonl/parquet file, or ``synthetic:<task>`` train rows as chats answered
    correctly (with the row's ``sft_reply`` where the task gives one); for an agentic
    task, worked episodes (``make_agentic_sft_rows``: knobs ``tool_rate``, ``schemas``)."""
    if not path.startswith("synthetic:"):
        return load_rows(path, fmt)
    from tandem.rl.data.tasks import TASKS, make_task_rows, parse_synthetic

    name, knobs = parse_synthetic(path[len("synthetic:") :])
    from tandem.rl.data.agentic_tasks import AGENTIC_TASKS, make_agentic_sft_rows

    if name in AGENTIC_TASKS:  # worked multi-turn episodes (tool calls and their results)
        try:
            return make_agentic_sft_rows(name, n_synthetic, seed, **knobs)
        except (ValueError, TypeError) as e:
            raise DataError(f"data.path: {path}: {e}") from None
    if name not in TASKS:
        raise DataError(f"data.path: {TASKS.unknown_message(name)}")
    try:
        rows = make_task_rows(name, n_synthetic, seed, "train", **knobs)
    except ValueError as e:
        raise DataError(f"data.path: {path}: {e}") from None
    return [
        {
            "messages": r["messages"]
            + [{"role": "assistant", "content": r.get("sft_reply", r["answer"])}]
        }
        for r in rows
    ]
