"""Preference pairs: rows {context, chosen, rejected} -> token sequences with response masks.

A row's context is ``messages`` (a chat history) or ``prompt`` (a string, which
becomes one user turn); ``chosen`` and ``rejected`` are assistant replies, as
strings or message lists. A message list may repeat the context in front (as
many public data sets store whole conversations); that prefix is removed, and
with no context field at all the common prefix of the two lists is the context.
Each side is rendered through the tokenizer's chat template: the context plus
generation prompt is masked, the assistant turns of the reply (with their
end-of-turn tokens) are the response. Both sides of a pair share the context tokens.

``data.path = "synthetic:<name>"`` generates pairs in code (`SYNTHETIC_PAIRS`),
e.g. ``synthetic:addition_small``: chosen is the right sum, rejected a wrong one.
Synthetic sources carry their own held-out pairs from the task's test split
(problems disjoint from training); files hold out ``eval_fraction`` of rows.

Bad rows (missing field, empty reply, chosen equal to rejected, longer than
max_length) are counted and skipped, or raise DataError naming the file and row.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.rl.core.fields import get_field
from tandem.rl.core.registry import Registry
from tandem.rl.data.images import VisionData
from tandem.rl.data.loading import DataError, Rows, load_rows, message_problem, row_where
from tandem.rl.data.sft import BadRow, Example, tokenize_turns
from tandem.rl.data.tasks import make_task_rows

__all__ = [
    "SYNTHETIC_PAIRS",
    "SYNTHETIC_PREFIX",
    "PreferenceData",
    "PreferencePair",
    "build_preference_data",
    "collate_pairs",
    "load_preference_data",
    "tokenize_response",
]

SYNTHETIC_PREFIX = "synthetic:"
Messages = list[dict[str, Any]]


# ---------------------------------------------------------------------- tokenizing
def _check_messages(messages: Any, what: str) -> Messages:
    if isinstance(messages, list) and not messages:
        raise BadRow(f"empty {what}")
    if not isinstance(messages, list):
        raise BadRow(
            f"{what} must be a string or a list of messages, got {type(messages).__name__}"
        )
    if (problem := message_problem(messages)) is not None:
        raise BadRow(f"{what}: {problem}")
    return messages


def _as_context(context: Any) -> Messages:
    if isinstance(context, str):
        if not context:
            raise BadRow("empty prompt")
        return [{"role": "user", "content": context}]
    return _check_messages(context, "context")


def _as_reply(reply: Any, context: Messages, what: str, allow_empty: bool = False) -> Messages:
    """The reply turns after the context (a string is one assistant turn)."""
    if isinstance(reply, str):
        if not reply and not allow_empty:
            raise BadRow(f"empty {what}")
        return [{"role": "assistant", "content": reply}]
    turns = _check_messages(reply, what)
    if turns[: len(context)] == context:
        turns = turns[len(context) :]  # the whole conversation was stored
    if not any(m["role"] == "assistant" and m["content"] for m in turns):
        raise BadRow(f"{what}: no non-empty assistant message")
    return turns


def tokenize_response(context: str | Messages, response: str | Messages, tokenizer: Any) -> Example:
    """One side of a pair (or one reward-model query): context + response through the
    chat template, ``loss_mask`` on the response's assistant tokens.

    The reward model's trainer and `tandem.rl.recipes.reward_model.RewardModelScorer` both call
    this, so a scored completion is tokenized exactly as it was trained. An
    empty string response is allowed here (a policy may generate one).
    """
    ctx = _as_context(context)
    reply = _as_reply(response, ctx, "response", allow_empty=True)
    return tokenize_turns(ctx + reply, tokenizer, first=len(ctx))


def _row_sides(rec: dict[str, Any], fields: dict[str, str]) -> tuple[Messages, Messages, Messages]:
    """(context, chosen reply, rejected reply) of one row."""
    chosen, rejected = get_field(rec, fields["chosen"]), get_field(rec, fields["rejected"])
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise BadRow(f"missing field {fields[key]!r}")
    messages, prompt = get_field(rec, fields["messages"]), get_field(rec, fields["prompt"])
    if messages is not None:
        ctx = _as_context(messages)
    elif prompt is not None:
        ctx = _as_context(prompt)
    elif isinstance(chosen, list) and isinstance(rejected, list):
        n = 0  # no context field: the two conversations' common prefix is the context
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise BadRow(
                f"missing field: neither {fields['messages']!r} nor {fields['prompt']!r}, "
                "and chosen/rejected share no leading turns"
            )
        ctx = _check_messages(chosen[:n], "context")
    else:
        raise BadRow(f"missing field: neither {fields['messages']!r} nor {fields['prompt']!r}")
    c, r = _as_reply(chosen, ctx, "chosen"), _as_reply(rejected, ctx, "rejected")
    if c == r:
        raise BadRow("chosen equals rejected")
    return ctx, c, r


# ---------------------------------------------------------------------- pairs
@dataclass
class PreferencePair:
    chosen: Example  # context + chosen reply; loss_mask on the reply
    rejected: Example
    index: int  # position in its split; keys cached reference log-probs


@dataclass
class PreferenceData:
    train: list[PreferencePair]
    eval: list[PreferencePair]
    skipped: Counter = field(default_factory=Counter)  # reason -> count


def build_preference_data(
    records: list[dict[str, Any]],
    tokenizer: Any,
    *,
    source: str,
    max_length: int,
    on_bad_row: str = "skip",
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    row_numbers: list[int] | None = None,
    skipped: Counter | None = None,
    vision: VisionData | None = None,
) -> tuple[list[PreferencePair], Counter]:
    """Tokenize rows into pairs; bad rows are counted (into ``skipped``) or raise DataError.

    Error messages name a record's place: ``path:line`` when ``records`` is a
    `tandem.rl.data.loading.Rows`, else ``row_numbers[i]`` (a held-out split still names
    rows of the original file), else i.
    """
    fields = {
        "messages": messages_field,
        "prompt": prompt_field,
        "chosen": chosen_field,
        "rejected": rejected_field,
    }
    skipped = Counter() if skipped is None else skipped
    pairs: list[PreferencePair] = []
    for i, rec in enumerate(records):
        try:
            ctx, c, r = _row_sides(rec, fields)
            n = len(ctx)
            sides = [
                tokenize_turns(ctx + reply, tokenizer, first=n, vision=vision) for reply in (c, r)
            ]
            for ex in sides:
                if len(ex.input_ids) > max_length:
                    raise BadRow(
                        f"longer than max_length ({len(ex.input_ids)} > {max_length} tokens)"
                    )
                if sum(ex.loss_mask[1:]) == 0:
                    raise BadRow("no response token")
        except BadRow as e:
            if on_bad_row == "error":
                where = (
                    row_where(records, i, source)
                    if row_numbers is None or isinstance(records, Rows)
                    else f"{source}: row {row_numbers[i]}"
                )
                raise DataError(
                    f"{where}: {e} (set data.on_bad_row=skip to skip such rows)"
                ) from None
            skipped[str(e).split(" (")[0]] += 1
            continue
        pairs.append(PreferencePair(sides[0], sides[1], len(pairs)))
    return pairs, skipped


# ---------------------------------------------------------------------- synthetic
SyntheticFn = Callable[[int, int, str], list[dict[str, Any]]]  # (n, seed, split) -> rows
SYNTHETIC_PAIRS: Registry[SyntheticFn] = Registry("synthetic preference source")
SYNTHETIC_TRAIN_ROWS = 512
SYNTHETIC_EVAL_ROWS = 64


@SYNTHETIC_PAIRS.register("addition_small")
def addition_pairs(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """ "3+5=" with chosen "8" and rejected a uniformly drawn wrong sum in [0, 18].

    Problems come from tandem/rl/data/tasks.py's addition_small, so the test split's
    problems never appear in training: held-out accuracy measures generalisation.
    """
    rows = make_task_rows("addition_small", n, seed, split)  # type: ignore[arg-type]
    out = []
    for row in rows:
        rng = random.Random(row["id"])
        right = int(row["answer"])
        wrong = rng.choice([v for v in range(19) if v != right])
        out.append({"prompt": row["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return out


@SYNTHETIC_PAIRS.register("sorting")
def sorting_pairs(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """ "Sort in ascending order: 3 1 2" with chosen "1 2 3" and rejected an unsorted order
    of the same digits.

    Whether a reply is sorted is a local property (each neighbour pair is in
    order), so a tiny model learns this preference quickly and it carries over
    to the test split's unseen lists: the source for fast learning checks.
    """
    out: list[dict[str, Any]] = []
    draw = 0
    while len(out) < n:  # lists of one repeated digit have no unsorted order: draw again
        for row in make_task_rows("sorting", n, seed + 7919 * draw, split, length=4):  # type: ignore[arg-type]
            items = row["answer"].split()
            if len(set(items)) == 1 or len(out) == n:
                continue
            rng = random.Random(row["id"])
            wrong = items[:]
            while wrong == items:
                rng.shuffle(wrong)
            out.append(
                {"prompt": row["prompt"], "chosen": row["answer"], "rejected": " ".join(wrong)}
            )
        draw += 1
    return out


def _held_out(n: int, fraction: float, seed: int) -> set[int]:
    """A seeded, fixed set of row numbers to hold out (independent of data order on disk)."""
    k = round(n * fraction)
    if fraction > 0 and n > 1:
        k = min(max(k, 1), n - 1)
    g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    return set(torch.randperm(n, generator=g)[:k].tolist())


def load_preference_data(
    source: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    max_length: int,
    on_bad_row: str = "skip",
    eval_fraction: float = 0.0,
    eval_source: str | None = None,
    seed: int = 0,
    synthetic_rows: int = SYNTHETIC_TRAIN_ROWS,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    vision: VisionData | None = None,
) -> PreferenceData:
    """Train and held-out pairs from a jsonl/parquet file or a ``synthetic:<name>`` source.
    ``vision``: a vision-language policy's image settings (rows with image parts).

    Held-out pairs: all rows of ``eval_source`` when given, else the synthetic
    source's test split, else a seeded ``eval_fraction`` of the file's rows.
    """
    fields = dict(
        messages_field=messages_field,
        prompt_field=prompt_field,
        chosen_field=chosen_field,
        rejected_field=rejected_field,
    )
    train_nums: list[int] | None = None
    eval_nums: list[int] | None = None
    eval_name = source
    if source.startswith(SYNTHETIC_PREFIX):
        name = source[len(SYNTHETIC_PREFIX) :]
        if name not in SYNTHETIC_PAIRS:
            raise DataError(f"{source}: {SYNTHETIC_PAIRS.unknown_message(name)}")
        gen = SYNTHETIC_PAIRS.get(name)
        train_rows, eval_rows = (
            gen(synthetic_rows, seed, "train"),
            gen(SYNTHETIC_EVAL_ROWS, seed, "test"),
        )
        # generated rows use the default names
        fields = {k: k.removesuffix("_field") for k in fields}
    else:
        rows = load_rows(source, fmt)
        held = set() if eval_source is not None else _held_out(len(rows), eval_fraction, seed)
        train_nums = [i for i in range(len(rows)) if i not in held]
        eval_nums = sorted(held)
        train_rows, eval_rows = [
            Rows([rows[i] for i in nums], [row_where(rows, i, source) for i in nums])
            for nums in (train_nums, eval_nums)
        ]
    if eval_source is not None:
        eval_rows, eval_nums, eval_name = load_rows(eval_source, fmt), None, eval_source
    kw = dict(
        tokenizer=tokenizer, max_length=max_length, on_bad_row=on_bad_row, vision=vision, **fields
    )
    train, skipped = build_preference_data(train_rows, source=source, row_numbers=train_nums, **kw)  # type: ignore[arg-type]
    evals, skipped = build_preference_data(
        eval_rows,
        source=eval_name,
        row_numbers=eval_nums,  # type: ignore[arg-type]
        skipped=skipped,
        **kw,
    )
    if not train:
        raise DataError(f"{source}: no usable preference pairs ({dict(skipped)} skipped)")
    return PreferenceData(train, evals, skipped)


# ---------------------------------------------------------------------- batches
def collate_pairs(pairs: list[PreferencePair], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A micro-batch of B pairs -> 2B right-padded sequences: the B chosen, then the B rejected.

    ``tokens [2B, S]`` (whole sequences, not shifted), ``loss_mask [2B, S]`` (1 on
    response tokens), ``lengths [2B]`` (real tokens per row). Right padding keeps
    positions 0..len-1 and, under causal attention, leaves real tokens untouched.
    """
    sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    s = max(len(ex.input_ids) for ex in sides)
    tokens = torch.full((len(sides), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sides), s), dtype=torch.long)
    for i, ex in enumerate(sides):
        tokens[i, : len(ex.input_ids)] = torch.tensor(ex.input_ids)
        mask[i, : len(ex.loss_mask)] = torch.tensor(ex.loss_mask)
    lengths = torch.tensor([len(ex.input_ids) for ex in sides])
    return {"tokens": tokens, "loss_mask": mask, "lengths": lengths}
