"""Synthetic verifiable tasks generated in code: arithmetic, countdown, sorting, tiny addition,
and pictures of coloured shapes for vision-language policies.

Rows are deterministic given ``(name, n, seed, split, knobs)`` and the train and
test splits never share a problem, whatever the seeds and knobs: every problem
has a key (its canonical text), and a hash of ``(task, key)`` alone puts it in
"test" (``TEST_FRACTION`` of keys) or "train". Generation draws problems from a
seeded RNG and keeps those that fall in the requested split.

Within a split problems are unique while the split still has unseen problems; a
small space (``addition_small`` has 100 problems) is detected as exhausted after
many consecutive repeats, and from then on problems repeat (i.i.d. draws), so
any ``n`` can be asked for.

Each row: ``id`` (stable: same arguments, same id), ``task``, ``prompt``,
``messages`` (one user turn), ``answer`` (ground-truth string), ``reward`` (the
registered reward that verifies it, also in ``TASK_REWARD``), ``problem_id``
(hash of the key) and task-specific fields (countdown: ``numbers``, ``target``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.rl.core.registry import Registry
from tandem.rl.rewards.basic import eval_arithmetic

__all__ = [
    "TASKS",
    "TASK_REWARD",
    "TEST_FRACTION",
    "Problem",
    "TaskSpec",
    "make_task_rows",
    "split_of",
    "write_jsonl",
]

Split = Literal["train", "test"]
TEST_FRACTION = 0.2  # share of each task's problem keys held out; fixed so splits never move
MAX_FRUITLESS_DRAWS = 100_000  # draws in a row outside the split before giving up


@dataclass(frozen=True)
class Problem:
    key: str  # canonical identity: equal keys are the same problem
    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)  # more row fields


@dataclass(frozen=True)
class TaskSpec:
    name: str
    reward: str  # registered reward function that verifies the answer
    generate: Callable[..., Problem]  # generate(rng, **knobs) -> Problem
    description: str


TASKS: Registry[TaskSpec] = Registry("task")
TASK_REWARD: dict[str, str] = {}


def _task(name: str, reward: str) -> Callable[[Callable[..., Problem]], Callable[..., Problem]]:
    def deco(fn: Callable[..., Problem]) -> Callable[..., Problem]:
        doc = (fn.__doc__ or "").strip().splitlines()
        TASKS.register(name)(TaskSpec(name, reward, fn, doc[0] if doc else ""))
        TASK_REWARD[name] = reward
        return fn

    return deco


def split_of(task: str, key: str) -> Split:
    """The split a problem belongs to; depends on the task name and key only."""
    h = hashlib.sha256(f"{task}\x00{key}".encode()).digest()
    return "test" if int.from_bytes(h[:8], "big") / 2**64 < TEST_FRACTION else "train"


def _problem_id(task: str, key: str) -> str:
    return hashlib.sha256(f"{task}\x00{key}".encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


@_task("arithmetic", reward="math")
def arithmetic(
    rng: random.Random, *, digits: int = 2, num_ops: int = 1, ops: str = "+-*"
) -> Problem:
    """Evaluate an integer expression, e.g. "What is 23+48?" (usual precedence)."""
    if digits < 1 or num_ops < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(
            "arithmetic: need digits >= 1, num_ops >= 1, ops from '+-*'; "
            f"got {digits}, {num_ops}, {ops!r}"
        )
    expr = str(_operand(rng, digits))
    for _ in range(num_ops):
        expr += rng.choice(ops) + str(_operand(rng, digits))
    value, _ = eval_arithmetic(expr)
    return Problem(key=expr, prompt=f"What is {expr}?", answer=str(int(value)))


def _countdown_expression(rng: random.Random, numbers: list[int]) -> tuple[int, str] | None:
    """Combine a random subset (>= 2) of ``numbers`` with + - * / keeping integers > 0."""
    k = rng.randint(2, len(numbers))
    items = [(v, str(v)) for v in rng.sample(numbers, k)]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, sa), (b, sb) = items[i], items[j]
        choices = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
        op = rng.choice(choices)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        items = [it for idx, it in enumerate(items) if idx not in (i, j)] + [
            (value, f"({sa}{op}{sb})")
        ]
    value, expr = items[0]
    return (value, expr[1:-1]) if value > 0 else None


@_task("countdown", reward="countdown")
def countdown(
    rng: random.Random, *, num_numbers: int = 4, max_number: int = 25, max_target: int = 999
) -> Problem:
    """Reach a target with + - * / using each given number at most once."""
    if num_numbers < 2 or max_number < 1 or max_target < 1:
        raise ValueError("countdown: need num_numbers >= 2, max_number >= 1, max_target >= 1")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        made = _countdown_expression(rng, numbers)
        if made is not None and made[0] <= max_target:
            break
    target, expr = made
    listed = ", ".join(map(str, numbers))
    prompt = (
        f"Using the numbers [{listed}], write an arithmetic expression that equals {target}. "
        "You may use +, -, * and / and each number at most once."
    )
    key = f"{sorted(numbers)}->{target}"
    return Problem(
        key=key, prompt=prompt, answer=expr, extra={"numbers": numbers, "target": target}
    )


_ALPHABETS = {"digits": "0123456789", "letters": "abcdefghijklmnopqrstuvwxyz"}


@_task("sorting", reward="sequence")
def sorting(rng: random.Random, *, length: int = 5, alphabet: str = "digits") -> Problem:
    """Sort a short list of digits or letters; the answer is the space-separated sorted list."""
    if length < 1 or alphabet not in _ALPHABETS:
        raise ValueError(f"sorting: need length >= 1 and alphabet in {sorted(_ALPHABETS)}")
    items = [rng.choice(_ALPHABETS[alphabet]) for _ in range(length)]
    shown = " ".join(items)
    return Problem(
        key=shown, prompt=f"Sort in ascending order: {shown}", answer=" ".join(sorted(items))
    )


@_task("addition_small", reward="exact_match")
def addition_small(rng: random.Random, *, max_value: int = 9, stray: float = 0.0) -> Problem:
    """Tiny a+b for a from-scratch character model: prompt "3+5=", answer "8".

    ``stray``: share of rows whose ``sft_reply`` (what SFT trains on) is the
    answer followed by a stray "!" ("8!"): a habit that exact match scores 0 and
    RL removes (the quickstart's starting policy has it; the answer itself and
    the reward's ground truth are unchanged).
    """
    if max_value < 1:
        raise ValueError(f"addition_small: need max_value >= 1, got {max_value}")
    if not 0.0 <= stray <= 1.0:
        raise ValueError(f"addition_small: need 0 <= stray <= 1, got {stray}")
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    reply = f"{a + b}!" if stray and rng.random() < stray else str(a + b)
    return Problem(
        key=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b), extra={"sft_reply": reply}
    )


@_task("needle", reward="exact_match")
def needle(
    rng: random.Random,
    *,
    length: int = 2000,
    depth: int = 200,
    min_length: int = 0,
    stray: float = 0.0,
) -> Problem:
    """Long-context retrieval for a character model: the digit in a haystack ("qz 7ab...?" -> "7").

    The haystack is ``length`` random lowercase letters and spaces ending in "?" (with
    ``min_length``, a length drawn uniformly from ``[min_length, length]``); the digit (the
    answer) replaces one of its first ``depth`` characters, so it sits more than
    ``length - depth`` positions before the question. ``stray``: share of rows whose
    ``sft_reply`` (what SFT trains on) is the digit followed by a stray "!" (as addition_small).
    """
    lo = min_length or length
    if not 0 < depth < lo <= length or not 0.0 <= stray <= 1.0:
        raise ValueError(
            f"needle: need 0 < depth < min_length <= length and 0 <= stray <= 1, got "
            f"depth={depth}, min_length={min_length}, length={length}, stray={stray}"
        )
    chars = [rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(rng.randint(lo, length))]
    digit = str(rng.randrange(10))
    chars[rng.randrange(depth)] = digit
    text = "".join(chars) + "?"
    reply = f"{digit}!" if stray and rng.random() < stray else digit
    return Problem(key=text, prompt=text, answer=digit, extra={"sft_reply": reply})


@_task("shapes", reward="exact_match")
def shapes(
    rng: random.Random, *, stray: float = 0.0, canvas: int = 56, ask: str = "both"
) -> Problem:
    """A picture of one coloured shape (Pillow); the question asks its colour or its shape.

    For vision-language policies: the row's ``messages`` hold the picture (a PNG ``data:``
    URI) and the question, "What colour is the shape?" ("red") or "What shape is it?"
    ("circle"); ``ask`` = "colour" or "shape" asks only one. The shape's size and centre are
    drawn too, so held-out pictures are new. ``stray`` as in ``addition_small``: that share
    of ``sft_reply``s end with a stray "!".
    """
    from tandem.rl.data.shapes import COLOURS, SHAPES, data_uri, draw

    if ask not in ("both", "colour", "shape") or not 0.0 <= stray <= 1.0 or canvas < 28:
        raise ValueError(
            "shapes: need ask in both/colour/shape, 0 <= stray <= 1, canvas >= 28; "
            f"got {ask!r}, {stray}, {canvas}"
        )
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    size = rng.randint(canvas * 2 // 5, canvas * 3 // 4)
    cx, cy = (rng.randint(size // 2 + 1, canvas - size // 2 - 1) for _ in range(2))
    which = rng.choice(["colour", "shape"]) if ask == "both" else ask
    question = "What colour is the shape?" if which == "colour" else "What shape is it?"
    answer = colour if which == "colour" else shape
    reply = f"{answer}!" if stray and rng.random() < stray else answer
    picture = {"type": "image", "image": data_uri(draw(shape, colour, cx, cy, size, canvas))}
    messages = [{"role": "user", "content": [picture, {"type": "text", "text": question}]}]
    return Problem(
        key=f"{which}|{shape}|{colour}|{size}|{cx},{cy}",
        prompt=question,
        answer=answer,
        extra={"messages": messages, "sft_reply": reply},
    )


# ---------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------


def _check_knobs(spec: TaskSpec, knobs: Mapping[str, Any]) -> None:
    params = list(inspect.signature(spec.generate).parameters)[1:]  # after rng
    bad = sorted(set(knobs) - set(params))
    if bad:
        raise ValueError(
            f"task {spec.name!r}: unknown knob(s) {bad} (choose from: {', '.join(params)})"
        )


def make_task_rows(
    name: str, n: int, seed: int, split: Split, **knobs: Any
) -> list[dict[str, Any]]:
    """``n`` rows of task ``name`` from ``split``; deterministic in all arguments."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    spec = TASKS.get(name)
    _check_knobs(spec, knobs)
    rng = random.Random(f"{name}|{split}|{seed}|{sorted(knobs.items())}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    exhausted = False
    repeats = fruitless = 0
    while len(rows) < n:
        p = spec.generate(rng, **knobs)
        if split_of(name, p.key) != split:
            fruitless += 1
            if fruitless > MAX_FRUITLESS_DRAWS:
                raise ValueError(
                    f"task {name!r}: the {split} split has no problems for knobs {knobs}"
                )
            continue
        fruitless = 0
        if p.key in seen and not exhausted:
            repeats += 1
            exhausted = repeats > max(1000, 20 * len(seen))
            continue
        repeats = 0
        seen.add(p.key)
        rows.append(
            {
                "id": f"{name}/{split}/{seed}/{len(rows)}",
                "task": name,
                "prompt": p.prompt,
                "messages": [{"role": "user", "content": p.prompt}],
                "answer": p.answer,
                "reward": spec.reward,
                "problem_id": _problem_id(name, p.key),
                **p.extra,
            }
        )
    return rows


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> str:
    """Write rows as JSON lines (UTF-8) atomically; creates parent folders. Returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def parse_synthetic(spec: str) -> tuple[str, dict[str, Any]]:
    """``"addition_small?max_value=19"`` -> ("addition_small", {"max_value": 19}); values as
    ints/floats/strs."""
    name, _, query = spec.partition("?")
    knobs: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        for cast in (int, float):
            try:
                knobs[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            knobs[key] = value
    return name, knobs
