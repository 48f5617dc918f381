"""Simple rewards: exact match, output format, length penalty, sequences, countdown.

Every function has the shared signature ``fn(completion, sample, **config) -> float``;
config is keyword-only with defaults, so ``functools.partial`` (or
``RewardPool(reward_kwargs=...)``) binds it:

* ``exact_match``   -- ``case_sensitive=False``
* ``format``        -- ``pattern=DEFAULT_FORMAT`` (a regex that must match the whole completion)
* ``length_penalty`` -- ``soft_chars=1024, hard_chars=2048`` (characters, not tokens:
  reward functions see text only)
* ``sequence``      -- ``case_sensitive=True``
* ``countdown``     -- ``use_all=False``

"The answer" of a completion is what ``extract_answer`` finds without the
last-number fallback (boxed, ``<answer>`` tag, "answer is"), else the whole text
after ``</think>``, stripped.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from tandem.rl.rewards.math import answer_section, extract_answer
from tandem.rl.rewards.registry import register_reward

__all__ = [
    "DEFAULT_FORMAT",
    "countdown_reward",
    "eval_arithmetic",
    "exact_match",
    "final_answer",
    "format_reward",
    "length_penalty",
    "sequence_match",
]

# <think>...</think> then a non-empty answer; no further think tags anywhere. Each part
# can end in one place only (the think block at its first </think>, the answer's leading
# space at its first non-space character, which may not open a tag), so a failing match
# backtracks in linear time; an unguarded \S between two tempered stars both let a stray
# "<think>" in and made failures quadratic (3 s on 16k characters).
DEFAULT_FORMAT = r"\s*<think>(?:(?!</?think>).)*</think>\s*(?!</?think>)\S(?:(?!</?think>).)*"

MAX_EXPR_CHARS = 200


def final_answer(completion: str) -> str:
    """The answer part of a completion (see module doc); may be empty."""
    ans = extract_answer(completion, fallback_last_number=False)
    return (ans if ans is not None else answer_section(completion)).strip()


def _canon(s: str, case_sensitive: bool) -> str:
    s = " ".join(s.split())
    return s if case_sensitive else s.casefold()


@register_reward("exact_match")
def exact_match(
    completion: str, sample: Mapping[str, Any], *, case_sensitive: bool = False
) -> float:
    """1.0 when the answer equals ``sample["answer"]`` up to outer/inner whitespace (and case)."""
    return float(
        _canon(final_answer(completion), case_sensitive)
        == _canon(str(sample["answer"]), case_sensitive)
    )


@register_reward("format")
def format_reward(
    completion: str, sample: Mapping[str, Any], *, pattern: str = DEFAULT_FORMAT
) -> float:
    """1.0 when the whole completion matches ``pattern`` (re.DOTALL), else 0.0.

    The default pattern runs in time linear in the completion. A custom pattern is the
    caller's: a backtracking one is bounded only by ``RewardPool``'s timeout (``re``
    checks for signals, so SIGALRM interrupts it).
    """
    return float(re.fullmatch(pattern, completion, flags=re.DOTALL) is not None)


@register_reward("length_penalty")
def length_penalty(
    completion: str, sample: Mapping[str, Any], *, soft_chars: int = 1024, hard_chars: int = 2048
) -> float:
    """0 up to ``soft_chars``, falling linearly to -1 at ``hard_chars`` and beyond.

    A penalty, so it is added with a positive weight. Length is in characters.
    """
    if hard_chars <= soft_chars:
        raise ValueError(
            f"length_penalty: hard_chars ({hard_chars}) must exceed soft_chars ({soft_chars})"
        )
    over = len(completion) - soft_chars
    return -min(1.0, max(0.0, over / (hard_chars - soft_chars)))


_SEQ_SPLIT_RE = re.compile(r"[\s,;\[\]()]+")


def _items(s: str, case_sensitive: bool) -> list[str]:
    items = [t for t in _SEQ_SPLIT_RE.split(s) if t]
    return items if case_sensitive else [t.casefold() for t in items]


@register_reward("sequence")
def sequence_match(
    completion: str, sample: Mapping[str, Any], *, case_sensitive: bool = True
) -> float:
    """1.0 when the answer lists the same items as ``sample["answer"]``, in order.

    Items are separated by whitespace, commas, semicolons or brackets, so
    ``"[1, 2, 3]"`` matches ``"1 2 3"``; ``"123"`` is one item and does not.
    """
    want = _items(str(sample["answer"]), case_sensitive)
    return float(bool(want) and _items(final_answer(completion), case_sensitive) == want)


# ---------------------------------------------------------------------------
# countdown: a safe arithmetic evaluator (ast walk; no eval)
# ---------------------------------------------------------------------------

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}  # fmt: skip


def _eval_node(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left = _eval_node(node.left, used)
        right = _eval_node(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def eval_arithmetic(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an expression of non-negative integers, ``+ - * /`` and parentheses,
    and the integer literals it uses (in order). ValueError for anything else.

    Unary minus, powers, names and calls are refused; so is text over
    ``MAX_EXPR_CHARS`` characters.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"not an expression: {e}") from None
    used: list[int] = []
    return _eval_node(tree.body, used), used


_MATH_OPS = (("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("\\div", "/"),
             ("÷", "/"), ("−", "-"), ("\\left", ""), ("\\right", ""), ("$", ""))  # fmt: skip


@register_reward("countdown")
def countdown_reward(completion: str, sample: Mapping[str, Any], *, use_all: bool = False) -> float:
    """1.0 when the answer is an expression of ``sample["numbers"]`` equal to ``sample["target"]``.

    Each given number may be used at most once (exactly once with ``use_all``);
    ``+ - * /`` and parentheses only, exact rational arithmetic. A trailing
    ``= target`` is allowed.
    """
    expr = final_answer(completion)
    for a, b in _MATH_OPS:
        expr = expr.replace(a, b)
    expr = expr.split("=")[0]
    try:
        value, used = eval_arithmetic(expr)
    except ValueError:
        return 0.0
    have = Counter(int(n) for n in sample["numbers"])
    need = Counter(used)
    if any(need[n] > have[n] for n in need) or (use_all and need != have):
        return 0.0
    return float(value == Fraction(sample["target"]))
