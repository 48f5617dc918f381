"""The "math" reward: extract a final answer and check it against the ground truth.

`extract_answer` takes the last ``\\boxed{...}``, ``<answer>``, "answer is X" line or
(optionally) last number, after any ``</think>``. `verify` asks Hugging Face's
``math-verify`` (LaTeX only) and, for a plain-text prediction it calls unequal, our own
`is_equiv` (normalised strings, exact rationals, tuples, sympy built by a small LaTeX
parser here, since completions are untrusted and never reach ``sympify``/``eval``). Calls
can still be slow on huge expressions: score in ``RewardPool`` workers, whose timeout and
memory cap bound each call. The rules in full: docs/rewards.md.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sympy

from tandem.rl.rewards.registry import register_reward

__all__ = [
    "answer_section",
    "extract_answer",
    "extract_boxed",
    "is_equiv",
    "math_reward",
    "normalize_answer",
    "parse_number",
    "to_sympy",
    "verify",
]

MAX_SYMBOLIC_CHARS = 300  # longer answers skip the sympy check
MAX_ANSWER_CHARS = 1000  # longer answers are compared as strings only
MAX_POW_BITS = 20_000  # refuse numeric powers whose result would exceed this many bits

# ---------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_PHRASE_RE = re.compile(r"(?:answer\s+is\s*:?|answer\s*:|####)[ \t]*(?P<rest>[^\n]*)", re.I)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def answer_section(text: str) -> str:
    """The text after the last ``</think>`` (the whole text when there is none)."""
    i = text.rfind("</think>")
    return text if i < 0 else text[i + len("</think>") :]


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each unescaped "{" -> index of its matching "}" (one linear pass)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c in "{}" and i > 0 and text[i - 1] == "\\":  # \{ and \} do not count
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` (or ``\\boxed 5``)."""
    pairs: dict[int, int] | None = None
    for m in reversed(list(_BOX_RE.finditer(text))):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            pairs = _brace_pairs(text) if pairs is None else pairs
            if j in pairs:
                return text[j + 1 : pairs[j]].strip()
        elif j > m.end():  # "\boxed 5": the next whitespace-free run
            run = re.match(r"[^\s$]+", text[j:])
            if run:
                return run.group(0)
    return None


def _clean_phrase(rest: str) -> str:
    """The answer at the start of ``rest``: a box, a $...$ span, or text up to the sentence end."""
    rest = rest.strip()
    rest = re.sub(r"^\*+|\*+$", "", rest).strip()  # markdown bold
    inner = extract_boxed(rest)
    if inner is not None:
        return inner
    if rest.startswith("$") and "$" in rest[1:]:
        return rest[1 : rest.index("$", 1)].strip()
    return _SENTENCE_END_RE.split(rest, maxsplit=1)[0].strip()


def _last_phrase(text: str) -> str | None:
    """The rest of the line after the last "answer is" / "answer:" / "####" (overlaps allowed)."""
    for start in reversed([m.start() for m in re.finditer(r"(?i)answer|####", text)]):
        m = _PHRASE_RE.match(text, start)
        if m:
            return m.group("rest")
    return None


def extract_answer(text: str, fallback_last_number: bool = True) -> str | None:
    """The final answer in a completion, or None when there is none (see module doc)."""
    text = answer_section(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG_RE.findall(text)
    if tags and tags[-1].strip():
        return _clean_phrase(tags[-1])
    phrase = _last_phrase(text)
    if phrase is not None:
        ans = _clean_phrase(phrase)
        if ans:
            return ans
    if fallback_last_number:
        nums = _NUMBER_RE.findall(text)
        if nums:
            return nums[-1]
    return None


# ---------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------

_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_DROP = (
    "\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\qquad", "\\quad",
    "^{\\circ}", "^\\circ", "\\circ", "\\degree", "°", "\\$", "$", "\\(", "\\)", "\\[", "\\]",
)  # fmt: skip
_UNIT_RE = re.compile(r"^([-+]?[\d.,/]*\d)(?:\s+[a-zA-Z]{2,}\.?)+$")


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer (see module doc); idempotent."""
    s = s.strip()
    for _ in range(3):  # nested \text{\textbf{...}}
        s = _TEXT_CMD_RE.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\%", "%").replace("−", "-").replace("\\ ", " ").replace("~", " ")
    for tok in _DROP:
        s = s.replace(tok, "")
    s = s.strip().rstrip(".").strip()
    if s.count("=") == 1:  # "x = 5" -> "5"
        m = re.match(r"^[a-zA-Z]\s*=\s*(\S.*)$", s)
        if m:
            s = m.group(1)
    m = _UNIT_RE.match(s)  # "12 cm", "5 dollars" -> number
    if m:
        s = m.group(1)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12 (LaTeX: one digit each)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)  # \sqrt2
    # thousands separators: 1,234,567 -> 1234567
    s = re.sub(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])", lambda m: m.group(0).replace(",", ""), s)
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    # drop whitespace, but keep one space between a command and a following letter
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    return s


# ---------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------

_DEC = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_DEC_RE = re.compile(rf"^{_DEC}$")
_SCI_RE = re.compile(rf"^({_DEC})[eE]([+-]?\d{{1,3}})$")
_SLASH_RE = re.compile(rf"^({_DEC})/({_DEC})$")
_FRAC_RE = re.compile(rf"^([+-]?)\\frac\{{({_DEC})\}}\{{({_DEC})\}}$")


def parse_number(s: str) -> Fraction | None:
    """Exact value of a normalised plain number (int, decimal, a/b, \\frac{a}{b}, 1e3)."""
    if _DEC_RE.match(s):
        return Fraction(s)
    m = _SCI_RE.match(s)
    if m:
        return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
    m = _SLASH_RE.match(s)
    if m and Fraction(m.group(2)) != 0:
        return Fraction(m.group(1)) / Fraction(m.group(2))
    m = _FRAC_RE.match(s)
    if m and Fraction(m.group(3)) != 0:
        v = Fraction(m.group(2)) / Fraction(m.group(3))
        return -v if m.group(1) == "-" else v
    return None


def _number_values(s: str) -> list[Fraction] | None:
    """Candidate values of a number; a percentage p% may mean p or p/100."""
    if s.endswith("%"):
        v = parse_number(s[:-1])
        return None if v is None else [v, v / 100]
    v = parse_number(s)
    return None if v is None else [v]


# ---------------------------------------------------------------------------
# LaTeX -> sympy (a small recursive-descent parser; no eval)
# ---------------------------------------------------------------------------


class _ParseError(Exception):
    pass


@functools.cache
def _sympy() -> Any:
    """sympy, imported on first use: every process that loads the reward registry (each rank
    and each reward worker) would otherwise pay its import (about 1 s on a busy 2-core machine)
    before any symbolic answer is seen."""
    import sympy

    return sympy


def prepare_worker() -> None:
    """Called once by each reward worker before it takes work (tandem/rl/workers)."""
    _sympy()


_TOKEN_RE = re.compile(r"\s*(\\[a-zA-Z]+|\d+(?:\.\d+)?|\.\d+|[a-zA-Z]+|\*\*|[-+*/^(){}\[\]])")
# names -> sympy attributes (sympy is imported on first use: `_sympy`)
_FUNCS = {"sin": "sin", "cos": "cos", "tan": "tan", "ln": "log", "log": "log", "exp": "exp",
          "sqrt": "sqrt"}  # fmt: skip
_CONSTS = {"pi": "pi", "infty": "oo"}
_GREEK = {"alpha", "beta", "gamma", "delta", "theta", "lambda", "mu", "sigma", "phi", "omega"}
_MUL_OPS = {"*", "\\cdot", "\\times"}
_DIV_OPS = {"/", "\\div"}


def _tokenize(s: str) -> list[str]:
    toks: list[str] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m:
            raise _ParseError(f"bad character {s[pos]!r}")
        tok = m.group(1)
        pos = m.end()
        if tok == "**":
            toks.append("^")
        elif tok[0].isalpha() and tok not in _FUNCS and tok not in _CONSTS:
            toks.extend(tok)  # "xy" -> x * y
        else:
            toks.append(tok)
    return toks


class _Parser:
    def __init__(self, toks: list[str]) -> None:
        self.toks = toks
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _ParseError(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> sympy.Expr:
        e = self.expr()
        if self.peek() is not None:
            raise _ParseError(f"trailing {self.peek()!r}")
        return e

    def expr(self) -> sympy.Expr:
        e = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            e = e + rhs if op == "+" else e - rhs
        return e

    def _starts_atom(self, tok: str | None) -> bool:
        if tok is None:
            return False
        return (
            tok[0].isalnum()
            or tok[0] == "."
            or tok in ("(", "{")
            or (tok.startswith("\\") and tok not in _MUL_OPS and tok not in _DIV_OPS)
        )

    def term(self) -> sympy.Expr:
        e = self.unary()
        while True:
            tok = self.peek()
            if tok in _MUL_OPS:
                self.take()
                e = e * self.unary()
            elif tok in _DIV_OPS:
                self.take()
                d = self.unary()
                if d == 0:
                    raise _ParseError("division by zero")
                e = e / d
            elif self._starts_atom(tok):  # implicit multiplication: 2x, 2\sqrt{2}, x(y+1)
                e = e * self.power()
            else:
                return e

    def unary(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        tok = self.peek()
        if tok is not None and tok.isdigit() and len(tok) > 1:  # LaTeX x^23 is x^2 * 3
            self.toks[self.i : self.i + 1] = [tok[0], tok[1:]]
        exp = self.unary() if self.peek() == "-" else self.atom()
        return _safe_pow(base, exp)

    def group(self) -> sympy.Expr:
        """A brace group, or a single atom (``\\frac{1}2``)."""
        if self.peek() == "{":
            self.take()
            e = self.expr()
            self.take("}")
            return e
        return self.atom()

    def atom(self) -> sympy.Expr:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return _sympy().Rational(tok)
        if tok in ("(", "{"):
            e = self.expr()
            self.take(")" if tok == "(" else "}")
            return e
        name = tok[1:] if tok.startswith("\\") else tok
        if name == "frac":
            num = self.group()
            den = self.group()
            if den == 0:
                raise _ParseError("division by zero")
            return num / den
        if name == "sqrt":
            if self.peek() == "[":
                self.take()
                n = self.expr()
                self.take("]")
                return _safe_pow(self.group(), 1 / n)
            return _sympy().sqrt(self.group())
        if name in _CONSTS:
            return getattr(_sympy(), _CONSTS[name])
        if name in _FUNCS:
            if self.peek() == "(":
                return getattr(_sympy(), _FUNCS[name])(self.atom())
            arg = self.group() if self.peek() == "{" else self.power()
            return getattr(_sympy(), _FUNCS[name])(arg)
        if (len(tok) == 1 and tok.isalpha()) or (tok.startswith("\\") and name in _GREEK):
            return _sympy().Symbol(name)
        raise _ParseError(f"unsupported token {tok!r}")


def _safe_pow(base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
    """``base ** exp``, refusing powers whose exact value would be enormous."""
    if exp.is_Rational:
        whole = abs(int(exp.p)) // int(exp.q) + 1
        if base.is_Rational and base not in (0, 1, -1):
            width = max(int(abs(base.p)).bit_length(), int(base.q).bit_length())
            if whole * width > MAX_POW_BITS:
                raise _ParseError("power too large")
        elif whole > 10_000:
            raise _ParseError("power too large")
    return base**exp


def to_sympy(s: str) -> sympy.Expr | None:
    """Parse a normalised LaTeX/plain expression into sympy; None if unsupported."""
    if not s or len(s) > MAX_SYMBOLIC_CHARS:
        return None
    try:
        return _Parser(_tokenize(s)).parse()
    except (_ParseError, ZeroDivisionError, TypeError, ValueError, OverflowError, RecursionError):
        return None


# ---------------------------------------------------------------------------
# equivalence
# ---------------------------------------------------------------------------


def _split_top_level(s: str) -> list[str]:
    """Split on commas outside brackets: "(1,2),3" -> ["(1,2)", "3"]."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def _strip_brackets(s: str) -> tuple[str, str]:
    """("(", "1,2") for "(1,2)" when the outer brackets match each other."""
    pairs = {"(": ")", "[": "]", "\\{": "\\}"}
    for o, c in pairs.items():
        if s.startswith(o) and s.endswith(c) and _balanced_parens(s[len(o) : -len(c)]):
            return o, s[len(o) : -len(c)]
    return "", s


def _balanced_parens(s: str) -> bool:
    depth = 0
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


def _symbolic_equal(a: str, b: str) -> bool:
    ea, eb = to_sympy(a), to_sympy(b)
    if ea is None or eb is None:
        return False
    try:
        if ea == eb:
            return True
        return bool(_sympy().simplify(ea - eb) == 0)
    except Exception:  # sympy raises a zoo of types on odd input
        return False


def _equiv_normalized(a: str, b: str) -> bool:
    if not a or not b:
        return False
    if a == b:
        return True
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return False
    va, vb = _number_values(a), _number_values(b)
    if va is not None and vb is not None:
        return any(x == y for x in va for y in vb)
    oa, ia = _strip_brackets(a)
    ob, ib = _strip_brackets(b)
    pa, pb = _split_top_level(ia), _split_top_level(ib)
    if len(pa) > 1 or len(pb) > 1:
        if oa != ob or len(pa) != len(pb):
            return False
        if oa == "\\{":  # a set: any order
            return _match_unordered(pa, pb)
        return all(map(_equiv_normalized, pa, pb))
    return _symbolic_equal(a, b)


def _match_unordered(pa: list[str], pb: list[str]) -> bool:
    rest = list(pb)
    for x in pa:
        hit = next((i for i, y in enumerate(rest) if _equiv_normalized(x, y)), None)
        if hit is None:
            return False
        rest.pop(hit)
    return True


def is_equiv(a: str, b: str) -> bool:
    """Whether two answers are the same (string, number, tuple, or sympy; see module doc)."""
    if a is None or b is None:
        return False
    return _equiv_normalized(normalize_answer(str(a)), normalize_answer(str(b)))


@functools.cache
def _math_verify() -> Any:
    """math-verify, imported on first use: ``import tandem.rl.rewards`` stays light, and only a
    process that scores math answers pays its import (about 0.1 s over sympy's)."""
    import math_verify

    # It warns once that its timeouts are off: they are, on purpose (see module doc).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _math_verify_equal(gold: str, pred: str) -> bool:
    mv = _math_verify()
    latex_only = [mv.LatexExtractionConfig()]
    parsed = [
        mv.parse(f"${text}$", extraction_config=latex_only, parsing_timeout=None)
        for text in (gold, pred)
    ]
    return bool(mv.verify(parsed[0], parsed[1], timeout_seconds=None))


def verify(gold: str, pred: str, verifier: str = "math_verify") -> bool:
    """Whether the predicted answer equals the ground truth (see module doc)."""
    if verifier == "own":
        return is_equiv(pred, gold)
    if verifier != "math_verify":
        raise ValueError(f"verifier must be 'math_verify' or 'own', got {verifier!r}")
    if _math_verify_equal(gold, pred):
        return True
    return "\\" not in pred and is_equiv(pred, gold)


@register_reward("math")
def math_reward(
    completion: str,
    sample: Mapping[str, Any],
    *,
    fallback_last_number: bool = True,
    verifier: str = "math_verify",
) -> float:
    """1.0 when the completion's final answer equals ``sample["answer"]``, else 0.0.

    A ground truth that is itself a worked solution with a ``\\boxed{}`` answer is
    reduced to that answer first. ``fallback_last_number`` (config) lets a bare
    last number count as the answer when no boxed / "answer is" form exists.
    ``verifier``: "math_verify" (default) or "own" (``is_equiv`` alone, as before).
    """
    pred = extract_answer(completion, fallback_last_number=fallback_last_number)
    if pred is None:
        return 0.0
    truth = str(sample["answer"])
    truth = extract_boxed(truth) or truth
    return 1.0 if verify(truth, pred, verifier) else 0.0
