"""The code_unit_tests reward cannot be faked by shadowing: every name the test code reads
resolves in the test runner (builtins, stdlib modules, the tests' own names); the solution
supplies only the names the tests read that none of those provide (its functions and classes).

Before the runner resolved names itself (the solution's top-level names were copied into the
tests' namespace), each wrong solution in CASES scored 1.0, as did the forged message, and the
all-builtins and modules tests failed; each honest solution scores 1.0."""

from __future__ import annotations

import builtins
import json

import pytest

from tandem.rl.rewards.code import code_unit_tests
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


HUMANEVAL_ABS = {
    "entry_point": "truncate_number",
    "tests": (
        "def check(candidate):\n"
        "    assert abs(candidate(3.5) - 0.5) < 1e-6\n"
        "    assert abs(candidate(1.25) - 0.25) < 1e-6\n"
    ),
}
UNITTEST_LEN = {
    "tests": (
        "import unittest\n\n"
        "class TestTokens(unittest.TestCase):\n"
        "    def test_count(self):\n"
        "        self.assertEqual(len(tokens('a b c')), 3)\n\n"
        "    def test_empty(self):\n"
        "        self.assertEqual(len(tokens('')), 0)\n"
    )
}

# (wrong solution that shadows a name the tests read, honest solution, row)
CASES = {
    "abs-humaneval": (
        "abs = lambda x: 0\ndef truncate_number(x):\n    return 7.0",
        "def truncate_number(x):\n    return x % 1.0",
        HUMANEVAL_ABS,
    ),
    "sorted-asserts": (
        "sorted = lambda *a, **k: []\ndef evens(xs):\n    return [9]",
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
        {"tests": ["assert sorted(evens([4, 1, 2])) == sorted([2, 4])"]},
    ),
    "math-mbpp": (
        "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef area(r):\n    return 0",
        "import math\ndef area(r):\n    return math.pi * r * r",
        {"tests": ["assert math.isclose(area(2), 12.566, rel_tol=0.001)"]},
    ),
    "len-unittest": (
        "import builtins\nlen = lambda x: builtins.len(x[0].split())\n"
        "def tokens(s):\n    return [s]",
        "def tokens(s):\n    return s.split()",
        UNITTEST_LEN,
    ),
    # beyond the list
    "all-any": (
        "all = lambda *a, **k: True\nany = lambda *a, **k: False\ndef parse(s):\n    return s",
        "def parse(s):\n    return [int(x) for x in s.split(',')]",
        {
            "tests": [
                "out = parse('1,2')\nassert all([type(x) is int for x in out])\n"
                "assert not any([x == ',' for x in out])"
            ]
        },
    ),
    "star-import": (
        "abs = lambda x: 0\ndef truncate_number(x):\n    return 7.0",
        "def truncate_number(x):\n    return x % 1.0",
        {"tests": ["from solution import *\nassert abs(truncate_number(3.5) - 0.5) < 1e-6"]},
    ),
    "module-attribute": (
        "class re:\n    fullmatch = staticmethod(lambda *a, **k: True)\n"
        "def slug(s):\n    return '!!'",
        "def slug(s):\n    return s.lower().replace(' ', '-')",
        {"tests": ["assert re.fullmatch(r'[a-z-]+', slug('A B'))"]},
    ),
}
# Cases that held before too (kept: the same rule covers them): an exception class the tests
# name, and a helper the tests define.
HELD_BEFORE = {
    "exception-class": (
        "ValueError = Exception\ndef check_age(n):\n    raise KeyError(n)",
        "def check_age(n):\n    if n < 0:\n        raise ValueError(n)\n    return n",
        {
            "tests": [
                "try:\n    check_age(-1)\nexcept ValueError:\n    pass\n"
                "else:\n    raise AssertionError('no ValueError')"
            ]
        },
    ),
    "test-helper": (
        "def is_sorted(xs):\n    return True\ndef sort_it(xs):\n    return xs",
        "def sort_it(xs):\n    return sorted(xs)",
        {
            "tests": [
                "def is_sorted(xs):\n    return list(xs) == sorted(xs)\n\n"
                "assert is_sorted(sort_it([3, 1, 2]))"
            ]
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES) + list(HELD_BEFORE))
def test_shadowing_a_name_the_tests_read_does_not_pay(case: str) -> None:
    wrong, honest, row = {**CASES, **HELD_BEFORE}[case]
    assert code_unit_tests(fenced(wrong), row) == 0.0
    assert code_unit_tests(fenced(honest), row) == 1.0


def _builtin_check(name: str, indent: str) -> str:
    """Test code asserting that ``name`` reads as the runner's builtin (NameError if none)."""
    lines = [
        "try:",
        f"    value = {name}",
        "except NameError:",
        "    value = None",
        f"assert value is getattr(_b, {name!r}, None), {name!r}",
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


SHADOW_ALL = (
    "_g = globals()\n"
    "for _n in {names!r}:\n"
    "    _g[_n] = lambda *a, **k: True\n"
    "def f():\n    return 1\n"
)


@pytest.mark.parametrize("style", ["asserts", "humaneval", "unittest"])
def test_no_builtin_name_comes_from_the_solution(style: str) -> None:
    """Every builtin, shadowed by the solution at once, still reads as the runner's own, in
    assert snippets, a HumanEval ``check`` and a unittest module."""
    names = sorted(n for n in dir(builtins) if not n.startswith("__"))
    assert len(names) > 100
    if style == "asserts":
        row = {
            "tests": [
                "import builtins as _b\nassert f() == 1\n" + _builtin_check(n, "") for n in names
            ]
        }
    elif style == "humaneval":
        body = "".join(_builtin_check(n, "    ") for n in names)
        row = {
            "entry_point": "f",
            "tests": "import builtins as _b\n\n"
            "def check(candidate):\n    assert candidate() == 1\n" + body,
        }
    else:
        methods = "".join(
            f"    def test_{i}(self):\n        assert f() == 1\n" + _builtin_check(n, "        ")
            for i, n in enumerate(names)
        )
        row = {
            "tests": "import builtins as _b\nimport unittest\n\n"
            "class TestNames(unittest.TestCase):\n" + methods
        }
    honest = "def f():\n    return 1"
    assert code_unit_tests(fenced(honest), row) == 1.0
    assert code_unit_tests(fenced(SHADOW_ALL.format(names=names) + honest), row) == 1.0


MODULES = [
    "bisect",
    "collections",
    "copy",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "os",
    "random",
    "re",
    "statistics",
    "string",
    "sys",
    "typing",
    "unittest",
]


def test_stdlib_modules_the_tests_read_are_the_runners() -> None:
    """A test reading a module it did not import (MBPP relies on the solution's imports) gets
    the runner's real module, whatever the solution bound to that name."""
    row = {
        "tests": [
            f"import sys as _s\nassert f() == 1 and {m} is _s.modules[{m!r}]" for m in MODULES
        ]
    }
    fakes = "".join(f"class {m}:\n    pass\n" for m in MODULES)
    honest = "def f():\n    return 1"
    assert code_unit_tests(fenced(fakes + honest), row) == 1.0
    assert code_unit_tests(fenced("import operator as math\n" + honest), row) == 1.0
    # MBPP style: the test reads math and relies on the solution's import, or on none
    mbpp = {"tests": ["assert math.isclose(area(1), 3.14159, rel_tol=1e-4)"]}
    area = "def area(r):\n    return 3.14159265 * r * r"
    assert code_unit_tests(fenced("import math\n" + area), mbpp) == 1.0
    assert code_unit_tests(fenced(area), mbpp) == 1.0


def test_a_forged_ready_message_gives_no_more_than_a_definition() -> None:
    """The solution controls the server's process, so it can send the list of its names
    itself (here with ``__builtins__`` and ``abs`` pointing at its own function): the runner
    still reads only the names the tests read, and never a builtin or a dunder from it."""
    names = {
        "__builtins__": ["d", [["abs", ["h", 1, "function"]]]],
        "abs": ["h", 1, "function"],
        "truncate_number": ["h", 0, "function"],
    }
    frame = json.dumps({"ready": names, "error": None})
    code = (
        "import os, struct\n"
        "def truncate_number(x):\n    return 7.0\n"
        "def fake(*a, **k):\n    return 0\n"
        f"_msg = {frame!r}.encode()\n"
        "os.write(3, struct.pack('>I', len(_msg)) + _msg)\n"
    )
    assert code_unit_tests(fenced(code), HUMANEVAL_ABS) == 0.0


def test_a_module_alias_the_tests_read_is_never_the_solutions() -> None:
    """Tests that read ``np`` without importing it mean numpy: a solution's own ``np`` (a class
    with a lenient ``isclose``) is not taken (it was, and scored 1.0)."""
    wrong = (
        "class np:\n    isclose = staticmethod(lambda *a, **k: True)\ndef area(r):\n    return 0"
    )
    row = {"tests": ["assert np.isclose(area(2), 12.566, rtol=0.001)"]}
    assert code_unit_tests(fenced(wrong), row) == 0.0
