"""Tasks for agentic rollouts: tool-assisted arithmetic and write-a-function, plus a loader.

Two generated tasks, deterministic in ``(name, n, seed, split, knobs)``, with the
same disjoint train/test split rule as tandem/rl/data/tasks.py (``split_of`` on the
problem's key):

* ``calc_arithmetic`` (env "tool", reward "math"): multi-digit integer
  arithmetic such as ``4837*2913-58211``; hard to do in one's head, one
  ``calculator`` (or ``python``) call away from exact. Row fields as in
  tandem/rl/data/tasks.py plus ``env``.
* ``code_function`` (env "code", reward "code_unit_tests"): implement a small
  named function (one of several families with random constants). Hidden unit
  tests are ``assert`` lines in ``tests`` (the shape tandem/rl/rewards/code.py takes),
  with ``entry_point`` and a ``reference`` solution that passes them; the prompt
  shows the signature and one example, never the tests.

``load_agentic_jsonl(path)`` reads local files of the same shapes (only
``prompt`` or ``messages`` and ``answer`` or ``tests`` are required) and fails
with a `DataError` naming the line.

These tasks have their own registry (``AGENTIC_TASKS``), not ``tandem.rl.data.tasks.TASKS``,
so the single-turn task list stays as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.rl.core.registry import Registry
from tandem.rl.data.loading import DataError, iter_jsonl_objects
from tandem.rl.data.tasks import Split, split_of

__all__ = [
    "AGENTIC_TASKS",
    "AgenticProblem",
    "load_agentic_jsonl",
    "make_agentic_rows",
    "make_agentic_sft_rows",
]

MAX_DRAWS = 100_000


@dataclass(frozen=True)
class AgenticProblem:
    key: str  # canonical identity (decides the split)
    prompt: str
    fields: dict[str, Any]  # answer / tests / entry_point / reference ...


Transcript = Callable[[dict[str, Any], bool], list[dict[str, str]]]


@dataclass(frozen=True)
class AgenticTask:
    name: str
    env: str  # registered environment that plays it
    reward: str  # registered reward that scores the final answer
    generate: Callable[..., AgenticProblem]  # generate(rng, **knobs)
    transcript: Transcript | None = None  # worked episodes for SFT (make_agentic_sft_rows)


AGENTIC_TASKS: Registry[AgenticTask] = Registry("agentic task")


def _task(
    name: str, env: str, reward: str, transcript: Transcript | None = None
) -> Callable[[Callable[..., AgenticProblem]], Callable[..., AgenticProblem]]:
    """Register a generator; ``transcript(row, use_tool)`` writes a worked episode for SFT."""

    def deco(fn: Callable[..., AgenticProblem]) -> Callable[..., AgenticProblem]:
        AGENTIC_TASKS.register(name)(AgenticTask(name, env, reward, fn, transcript))
        return fn

    return deco


# ---- calc_arithmetic ------------------------------------------------------------------------


CALC_TOOLS = ("calculator", "python")


def calc_transcript(row: dict[str, Any], use_tool: bool) -> list[dict[str, str]]:
    """A worked calc_arithmetic episode for SFT, in the text a rollout would hold.

    With ``use_tool``: one Hermes ``<tool_call>`` (calculator expression, or a python
    program printing it), the tool's result as the tool turn (what the registered
    tool returns for it: the value, and for python its stdout line), then the boxed
    answer. Without: the boxed answer at once.
    """
    answer = {"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}
    if not use_tool:
        return [*row["messages"], answer]
    tool, expr = row["tool"], row["expression"]
    args = {"expression": expr} if tool == "calculator" else {"code": f"print({expr})"}
    call = json.dumps({"name": tool, "arguments": args})
    result = row["answer"] if tool == "calculator" else row["answer"] + "\n"
    return [
        *row["messages"],
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": result},
        answer,
    ]


@_task("calc_arithmetic", env="tool", reward="math", transcript=calc_transcript)
def calc_arithmetic(
    rng: random.Random,
    *,
    digits: int = 4,
    num_ops: int = 2,
    ops: str = "+-*",
    tool: str = "calculator",
) -> AgenticProblem:
    """Multi-digit integer arithmetic; one ``tool`` call (calculator or python) makes it exact."""
    if digits < 1 or num_ops < 1 or not ops or set(ops) - set("+-*") or tool not in CALC_TOOLS:
        raise ValueError(
            f"calc_arithmetic: need digits >= 1, num_ops >= 1, ops from '+-*', tool in "
            f"{CALC_TOOLS}; got {digits}, {num_ops}, {ops!r}, {tool!r}"
        )
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    expr = str(rng.randint(lo, 10**digits - 1))
    for _ in range(num_ops):
        expr += rng.choice(ops) + str(rng.randint(lo, 10**digits - 1))
    value = _eval_int(expr)
    prompt = (
        f"What is {expr}? You can use the {tool} tool. Give the final answer as \\boxed{{...}}."
    )
    return AgenticProblem(expr, prompt, {"answer": str(value), "expression": expr, "tool": tool})


def _eval_int(expr: str) -> int:
    """Value of an expression of non-negative integers and + - * (usual precedence)."""
    total, term, sign, num = 0, 1, 1, ""
    pending_mul = False
    for ch in expr + "+":
        if ch.isdigit():
            num += ch
            continue
        value = int(num)
        term = term * value if pending_mul else value
        num = ""
        if ch == "*":
            pending_mul = True
            continue
        total += sign * term
        sign, term, pending_mul = (1 if ch == "+" else -1), 1, False
    return total


# ---- code_function --------------------------------------------------------------------------

# Each family: (signature, description, reference source, argument generator). The
# description and reference use {a}, {b} constants drawn per problem.
_FAMILIES: dict[str, tuple[str, str, str, Callable[[random.Random], tuple]]] = {
    "affine": (
        "f(x: int) -> int",
        "returns {a} * x + {b}",
        "def f(x):\n    return {a} * x + {b}\n",
        lambda r: (r.randint(-50, 50),),
    ),
    "count_char": (
        "f(s: str) -> int",
        "returns how many times the character {c!r} occurs in s",
        "def f(s):\n    return s.count({c!r})\n",
        lambda r: ("".join(r.choice("abcde") for _ in range(r.randint(0, 12))),),
    ),
    "sum_multiples": (
        "f(n: int) -> int",
        "returns the sum of the integers in [0, n) divisible by {a} or by {b}",
        "def f(n):\n    return sum(i for i in range(n) if i % {a} == 0 or i % {b} == 0)\n",
        lambda r: (r.randint(0, 60),),
    ),
    "clamp": (
        "f(x: int) -> int",
        "returns x limited to the range [{lo}, {hi}]",
        "def f(x):\n    return max({lo}, min({hi}, x))\n",
        lambda r: (r.randint(-40, 40),),
    ),
    "rotate": (
        "f(xs: list) -> list",
        "returns xs rotated left by {a} positions (xs[{a} % len(xs):] + ...; "
        "an empty list stays empty)",
        "def f(xs):\n    if not xs:\n        return []\n    k = {a} % len(xs)\n    return "
        "xs[k:] + xs[:k]\n",
        lambda r: ([r.randint(0, 9) for _ in range(r.randint(0, 6))],),
    ),
}


@_task("code_function", env="code", reward="code_unit_tests")
def code_function(rng: random.Random, *, num_tests: int = 5, families: str = "") -> AgenticProblem:
    """Implement a small function (random family and constants), scored by hidden asserts."""
    names = [f for f in families.split(",") if f] or sorted(_FAMILIES)
    unknown = sorted(set(names) - set(_FAMILIES))
    if unknown or num_tests < 1:
        raise ValueError(
            f"code_function: need num_tests >= 1 and families from {sorted(_FAMILIES)}; "
            f"got {num_tests}, unknown {unknown}"
        )
    family = rng.choice(names)
    signature, describe, source, draw = _FAMILIES[family]
    lo = rng.randint(-10, 0)
    consts = {
        "a": rng.randint(2, 9),
        "b": rng.randint(2, 9),
        "c": rng.choice("abcde"),
        "lo": lo,
        "hi": lo + rng.randint(1, 20),
    }
    entry = f"{family}_{_const_tag(family, consts)}"  # constants in the name: distinct functions
    reference = source.format(**consts).replace("def f(", f"def {entry}(")
    ns: dict[str, Any] = {}
    exec(compile(reference, f"<{entry}>", "exec"), ns)  # our own reference, not model text
    fn = ns[entry]
    tests, seen = [], set()
    for _ in range(20 * num_tests):
        args = draw(rng)
        shown = ", ".join(repr(a) for a in args)
        if shown in seen:
            continue
        seen.add(shown)
        tests.append(f"assert {entry}({shown}) == {fn(*args)!r}")
        if len(tests) == num_tests + 1:
            break
    example = tests.pop().removeprefix("assert ")  # shown in the prompt, so not a hidden test
    prompt = (
        f"Write a Python function `{entry}{signature[1:]}` that {describe.format(**consts)}. "
        f"For example, {example}. Reply with the function in a ```python block."
    )
    key = f"{entry}|{describe.format(**consts)}"
    return AgenticProblem(
        key,
        prompt,
        {"tests": tests, "entry_point": entry, "reference": reference, "answer": reference},
    )


def _const_tag(family: str, c: dict[str, Any]) -> str:
    return {
        "affine": f"{c['a']}_{c['b']}",
        "sum_multiples": f"{c['a']}_{c['b']}",
        "count_char": str(c["c"]),
        "clamp": f"{c['lo']}_{c['hi']}".replace("-", "m"),
        "rotate": str(c["a"]),
    }[family]


# ---- rows -----------------------------------------------------------------------------------


def make_agentic_rows(
    name: str, n: int, seed: int, split: Split = "train", **knobs: Any
) -> list[dict[str, Any]]:
    """``n`` rows of agentic task ``name`` from ``split``; deterministic in all arguments.

    Problems are unique within a call while unseen ones remain; then they repeat.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    task = AGENTIC_TASKS.get(name)
    rng = random.Random(f"{name}|{split}|{seed}|{sorted(knobs.items())}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    draws = 0
    while len(rows) < n:
        draws += 1
        if draws > MAX_DRAWS + 100 * n:
            raise ValueError(
                f"agentic task {name!r}: cannot find {n} {split} problems for knobs {knobs}"
            )
        p = task.generate(rng, **knobs)
        if split_of(name, p.key) != split or (p.key in seen and draws < MAX_DRAWS):
            continue
        seen.add(p.key)
        rows.append(
            {
                "id": f"{name}/{split}/{seed}/{len(rows)}",
                "task": name,
                "env": task.env,
                "prompt": p.prompt,
                "messages": [{"role": "user", "content": p.prompt}],
                "reward": task.reward,
                "problem_id": hashlib.sha256(f"{name}\x00{p.key}".encode()).hexdigest()[:16],
                **p.fields,
            }
        )
    return rows


def make_agentic_sft_rows(
    name: str, n: int, seed: int, *, tool_rate: float = 1.0, schemas: int = 1, **knobs: Any
) -> list[dict[str, Any]]:
    """``n`` SFT chats of worked train episodes of ``name`` (the task's ``transcript``).

    A fraction ``tool_rate`` of them (seeded draw per row) call the tool; the rest
    answer at once. With ``schemas`` the rows carry the tool's JSON schema as
    ``tools``, which the chat template renders into the system turn as the "tool"
    environment does by default; ``schemas=0`` matches ``schemas_in_prompt = false``.
    """
    task = AGENTIC_TASKS.get(name)
    if task.transcript is None:
        raise ValueError(f"agentic task {name!r} has no worked transcripts for SFT")
    if not 0.0 <= tool_rate <= 1.0 or schemas not in (0, 1):
        raise ValueError(
            f"need 0 <= tool_rate <= 1 and schemas in (0, 1); got {tool_rate}, {schemas}"
        )
    from tandem.rl.envs.tools import tool_schemas

    rng = random.Random(f"sft|{name}|{seed}|{tool_rate}")
    out = []
    for row in make_agentic_rows(name, n, seed, "train", **knobs):
        rec: dict[str, Any] = {"messages": task.transcript(row, rng.random() < tool_rate)}
        if schemas:
            rec["tools"] = tool_schemas([row["tool"]])
        out.append(rec)
    return out


def _check_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one loaded row and fill the defaults (env, messages); DataError naming ``where``."""
    if "messages" in row:
        msgs = row["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise DataError(
                f"{where}: 'messages' must be a non-empty list of "
                '{"role": str, "content": str} objects'
            )
    elif isinstance(row.get("prompt"), str) and row["prompt"]:
        row["messages"] = [{"role": "user", "content": row["prompt"]}]
    else:
        raise DataError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    env = row.setdefault("env", "code" if "tests" in row else "tool")
    if env == "code":
        tests = row.get("tests")
        ok = (isinstance(tests, str) and tests.strip()) or (
            isinstance(tests, list)
            and tests
            and all(isinstance(t, str) and t.strip() for t in tests)
        )
        if not ok:
            raise DataError(
                f"{where}: code rows need 'tests': a string or a list of non-empty strings"
            )
        entry = row.get("entry_point")
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise DataError(f"{where}: 'entry_point' must be a Python identifier, got {entry!r}")
        row.setdefault("reward", "code_unit_tests")
    elif env == "tool":
        if "answer" not in row or row["answer"] is None:
            raise DataError(f"{where}: tool rows need an 'answer'")
        row["answer"] = str(row["answer"])
        row.setdefault("reward", "math")
    else:
        raise DataError(f"{where}: unknown 'env' {env!r} (expected 'tool' or 'code')")
    return row


def load_agentic_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a local JSON-lines file in the shapes above; DataError names the bad line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    rows = []
    for where, obj in iter_jsonl_objects(path):
        row = _check_row(obj, where)
        row.setdefault("id", f"{os.path.basename(path)}:{where.rsplit(':', 1)[1]}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows
