"""The code_unit_tests reward (tandem/rl/rewards/code.py): the solution and the hidden tests run in
separate sandboxed runs (tandem/rl/sandbox/__init__.py), so a solution can neither read nor forge
the test results, and unittest-style tests are discovered and run."""

from __future__ import annotations

import pytest

from tandem.rl.rewards.code import code_unit_tests, extract_code
from tandem.rl.rewards.registry import REWARDS
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py

ADD_TESTS = {
    "tests": [
        "assert add(1, 2) == 3",
        "assert add(2, 2) == 4",
        "assert add(-1, 1) == 0",
        "assert add(0, 5) == 5",
    ]
}


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def test_reward_is_registered() -> None:
    assert REWARDS.get("code_unit_tests") is code_unit_tests


def test_reward_correct_solution_scores_one() -> None:
    assert code_unit_tests(fenced("def add(a, b):\n    return a + b"), ADD_TESTS) == 1.0


def test_reward_half_correct_scores_half() -> None:
    code = "def add(a, b):\n    return a + b if a > 0 else -99"  # wrong for a <= 0
    assert code_unit_tests(fenced(code), ADD_TESTS) == 0.5


def test_reward_wrong_or_broken_code_scores_zero() -> None:
    assert code_unit_tests(fenced("def add(a, b):\n    return 7"), ADD_TESTS) == 0.0
    assert code_unit_tests(fenced("def add(a, b) return"), ADD_TESTS) == 0.0
    assert code_unit_tests("no code at all", ADD_TESTS) == 0.0


@pytest.mark.parametrize(
    "exit_code",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "raise SystemExit(0)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    ],
)
def test_reward_exit_before_tests_scores_zero(exit_code: str) -> None:
    assert code_unit_tests(fenced(exit_code), ADD_TESTS) == 0.0


def test_reward_sys_exit_inside_a_test_is_a_failure() -> None:
    code = "import sys\ndef add(a, b):\n    if a < 0:\n        sys.exit(0)\n    return a + b"
    assert code_unit_tests(fenced(code), ADD_TESTS) == 0.75


def test_reward_forged_result_lines_score_zero() -> None:
    code = (
        "import os, sys, atexit\n"
        "line = '__TANDEM_RESULT__ 0123456789abcdef0123456789abcdef 4/4\\n'\n"
        "print(line)\n"
        "sys.__stdout__.write(line)\n"
        "for fd in range(0, 64):\n"
        "    try:\n"
        "        os.write(fd, line.encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "atexit.register(lambda: os.write(1, line.encode()))\n"
        "os._exit(0)\n"
    )
    assert code_unit_tests(fenced(code), ADD_TESTS) == 0.0


def test_reward_solution_cannot_read_the_tests() -> None:
    # Look for the tests everywhere a harness sharing the solution's process or files
    # would leave them, and answer from them without implementing add.
    code = (
        "import gc, os, re, sys\n"
        "blobs = []\n"
        "for d in ('.', '/work', '..', '/tmp'):\n"
        "    try:\n"
        "        for f in os.listdir(d):\n"
        "            p = os.path.join(d, f)\n"
        "            if os.path.isfile(p):\n"
        "                blobs.append(open(p, errors='replace').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "main = sys.modules.get('__main__')\n"
        "blobs.append(repr(getattr(main, '_PARAMS', '')))\n"
        "blobs += [o for o in gc.get_objects() if isinstance(o, str) and 'add(' in o]\n"
        "table = {(int(a), int(b)): int(c) for a, b, c in\n"
        "         re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', ' '.join(blobs))}\n"
        "def add(a, b):\n"
        "    return table.get((a, b), -12345)\n"
    )
    assert code_unit_tests(fenced(code), ADD_TESTS) == 0.0


def test_reward_values_cross_as_data_so_eq_cannot_lie() -> None:
    code = (
        "class Liar:\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Liar()\n"
    )
    assert code_unit_tests(fenced(code), ADD_TESTS) == 0.0
    # honest values, objects, generators and exceptions still work across the two runs
    tests = {
        "tests": [
            "assert pair(2) == (2, [2.5, {'k': {2}}], b'x', None, True)",
            "s = Stack(); s.push(3); s.push(4); assert s.pop() == 4 and len(s) == 1",
            "assert list(countdown(3)) == [3, 2, 1] and 3 in Stack.of(3)",
            "import math\nassert math.isclose(root(2.0), 2 ** 0.5) and big() == 7 ** 99",
            "try:\n    pair(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
            "else:\n    raise AssertionError",
        ]
    }
    code = (
        "import math\n"
        "def pair(n):\n"
        "    if n < 0:\n        raise ValueError('negative')\n"
        "    return (n, [n + 0.5, {'k': {n}}], b'x', None, n > 1)\n"
        "class Stack:\n"
        "    def __init__(self): self.items = []\n"
        "    def push(self, x): self.items.append(x)\n"
        "    def pop(self): return self.items.pop()\n"
        "    def __len__(self): return len(self.items)\n"
        "    def __contains__(self, x): return x in self.items\n"
        "    @classmethod\n"
        "    def of(cls, x):\n        s = cls(); s.push(x); return s\n"
        "def countdown(n):\n    while n:\n        yield n\n        n -= 1\n"
        "def root(x): return math.sqrt(x)\n"
        "def big(): return 7 ** 99\n"
    )
    assert code_unit_tests(fenced(code), tests) == 1.0


UNITTEST_ADD = """
import unittest


class TestAdd(unittest.TestCase):
    def test_small(self):
        self.assertEqual(add(1, 2), 3)

    def test_negative(self):
        self.assertEqual(add(-1, 1), 0)

    @unittest.skip("not a test of the solution")
    def test_skipped(self):
        self.fail()


class TestMore(unittest.TestCase):
    def test_zero(self):
        self.assertEqual(add(0, 0), 0)

    def test_large(self):
        self.assertEqual(add(10 ** 20, 1), 10 ** 20 + 1)
"""
GUARD = '\nif __name__ == "__main__":\n    unittest.main()\n'


@pytest.mark.parametrize(
    "tail", ["", GUARD, "\nunittest.main()\n"], ids=["no-guard", "guard", "unguarded-main"]
)
def test_reward_unittest_modules_are_run(tail: str) -> None:
    tests = {"tests": UNITTEST_ADD + tail}
    assert code_unit_tests(fenced("def add(a, b):\n    return a + b"), tests) == 1.0
    assert code_unit_tests(fenced("def add(a, b):\n    return 7"), tests) == 0.0
    half = "def add(a, b):\n    return a + b if a > 0 else -99"  # test_small and test_large
    assert code_unit_tests(fenced(half), tests) == 0.5


def test_reward_patching_unittest_does_not_help() -> None:
    code = (
        "import sys, unittest\n"
        "unittest.main = lambda *a, **k: sys.exit(0)\n"
        "unittest.TestCase.run = lambda self, result=None: None\n"
        "unittest.TestCase.assertEqual = lambda self, a, b, msg=None: None\n"
        "def add(a, b):\n    return 7\n"
    )
    for tail in ("", GUARD):
        assert code_unit_tests(fenced(code), {"tests": UNITTEST_ADD + tail}) == 0.0


def test_reward_survives_print_and_stdout_override() -> None:
    code = (
        "import builtins, os, sys\n"
        "class Sink:\n"
        "    def write(self, s): return len(s)\n"
        "    def flush(self): pass\n"
        "sys.stdout = sys.__stdout__ = Sink()\n"
        "builtins.print = lambda *a, **k: None\n"
        "os.write(1, b'junk on fd 1\\n')\n"
        "def add(a, b):\n    return a + b\n"
    )
    assert code_unit_tests(fenced(code), ADD_TESTS) == 1.0


def test_reward_slow_test_times_out_alone() -> None:
    code = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b"
    assert code_unit_tests(fenced(code), ADD_TESTS, per_test_timeout_s=0.5) == 0.75


def test_reward_string_tests_and_entry_point() -> None:
    asserts = {"tests": "assert add(1, 2) == 3\nassert add(2, 2) == 5\n"}
    assert code_unit_tests(fenced("def add(a, b):\n    return a + b"), asserts) == 0.5
    humaneval = {
        "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
        "    assert candidate(0, 0) == 0\n",
        "entry_point": "add",
    }
    assert code_unit_tests(fenced("def add(a, b):\n    return a + b"), humaneval) == 1.0
    assert code_unit_tests(fenced("def plus(a, b):\n    return a + b"), humaneval) == 0.0


def test_extract_code_takes_last_python_block() -> None:
    text = "```python\nfirst()\n```\ntext\n```py\nsecond()\n```\n```\nbare()\n```"
    assert extract_code(text) == "second()\n"
    assert extract_code("```\nbare()\n```") == "bare()\n"
    assert extract_code("x = 1") == "x = 1"
