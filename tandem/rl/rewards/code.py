"""The ``code_unit_tests`` reward: the fraction of a row's unit tests a completion passes.

``sample["tests"]`` is either a list of test snippets (typically ``assert`` lines, as in
MBPP) or one string of test code. A string made only of top-level ``assert``
statements is split into one test per assert; any other string is one test, and when
``sample["entry_point"]`` is given and the string defines ``check`` (HumanEval style)
the test is ``check(<entry_point>)``. The solution is the last fenced ```` ```python ````
block of the completion (else the last bare ```` ``` ```` block, else the whole text).

How a run is scored (why it is hard to fake): tandem/rl/rewards/code_harness.py runs the
solution and the tests in two separate sandboxed runs (tandem/rl/sandbox/__init__.py), each with
its own uid and, where the kernel allows, its own namespaces. The solution's run never
holds the tests: the tests' run calls the solution's functions over a socket and gets
plain data back, compares it itself, and writes ``{"passed", "total"}`` to a pipe the
solution's run does not have (not stdout). So the solution cannot read the tests, print
or write a fake result, exit early with success, patch ``unittest`` or the test runner,
or return objects whose ``__eq__`` lies. Every name the tests read resolves in the tests'
run first (their own names, the entry point, builtins, stdlib modules), so defining
``abs``, ``sorted`` or a class ``math`` in the solution changes nothing the tests read
(docs/rewards.md, tests/rewards/test_code_shadowing.py).

Test styles: ``assert`` snippets (one test each), a HumanEval ``check`` (one test), and
unittest modules: the ``TestCase`` classes are loaded and run (an ``if __name__ ==
"__main__": unittest.main()`` guard or an unguarded ``unittest.main()`` changes
nothing), each test method one test, skipped ones not counted. The reward is
``passed / total``; 0 when the tests' run fails or hits a sandbox limit.

Limits, honestly: values cross as data (see code_harness.py), so tests that need the
solution's own objects beyond calls, attributes, items and iteration, or check that a
call mutated its argument, fail. ``wall_time_s`` bounds each run, so a slow solution can
score 0 even if each test would pass on its own.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.rl.rewards.registry import register_reward
from tandem.rl.sandbox import SandboxLimits, SandboxResult, start_python

__all__ = ["code_unit_tests", "extract_code", "normalize_tests", "score_report"]

SOLUTION_FILE = "solution.py"
HARNESS_FILE = "tandem_harness.py"
_PY_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)
_BARE_FENCE_RE = re.compile(r"```[ \t]*\n(.*?)```", re.S)
_MAX_REPORT = 4096


@functools.cache
def _harness_source() -> str:
    """code_harness.py's text: copied into both runs as ``HARNESS_FILE``."""
    with open(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_harness.py"),
        encoding="utf-8",
    ) as f:
        return f.read()


def extract_code(completion: str) -> str:
    """The last ```python block, else the last bare ``` block, else the whole text."""
    for pattern in (_PY_FENCE_RE, _BARE_FENCE_RE):
        blocks = pattern.findall(completion)
        if blocks:
            return blocks[-1]
    return completion


def normalize_tests(tests: str | Sequence[str], entry_point: str | None = None) -> list[str]:
    """One source string per test (see the module docstring for the rules)."""
    if isinstance(tests, str):
        try:
            body = ast.parse(tests).body
        except SyntaxError:
            body = []
        if body and all(isinstance(stmt, ast.Assert) for stmt in body):
            return [ast.get_source_segment(tests, stmt) or ast.unparse(stmt) for stmt in body]
        if entry_point is not None and re.search(r"^def check\(", tests, re.M):
            return [f"{tests}\n\ncheck({entry_point})\n"]
        return [tests]
    out = [t for t in tests if isinstance(t, str) and t.strip()]
    if len(out) != len(tests):
        raise ValueError("sample['tests'] must be a string or a list of non-empty strings")
    return out


def score_report(res: SandboxResult, report: bytes) -> float:
    """passed/total from the tests' run's report, or 0.0 if that run failed."""
    if res.exit_code != 0 or res.limit_hit is not None:
        return 0.0
    try:
        counts = json.loads(report)
        passed, total = int(counts["passed"]), int(counts["total"])
    except (ValueError, KeyError, TypeError):
        return 0.0
    if total <= 0 or not 0 <= passed <= total:
        return 0.0
    return passed / total


@register_reward("code_unit_tests")
def code_unit_tests(
    completion: str,
    sample: Mapping[str, Any],
    *,
    cpu_time_s: int = 10,
    wall_time_s: float = 20.0,
    memory_mb: int = 512,
    per_test_timeout_s: float = 2.0,
) -> float:
    """Fraction of ``sample["tests"]`` that the completion's code passes, in [0, 1]."""
    entry_point = sample.get("entry_point") or None
    if entry_point is not None and not entry_point.isidentifier():
        raise ValueError(f"entry_point {entry_point!r} is not a Python identifier")
    tests = normalize_tests(sample["tests"], entry_point)
    if not tests:
        raise ValueError("sample['tests'] is empty")
    limits = SandboxLimits(cpu_time_s=cpu_time_s, wall_time_s=wall_time_s, memory_mb=memory_mb)
    per_test = float(per_test_timeout_s)
    server_main = (
        f"import tandem_harness\ntandem_harness.serve(3, {SOLUTION_FILE!r}, {per_test!r})\n"
    )
    runner_main = (
        f"import json, tandem_harness\n"
        f"tandem_harness.run_tests(3, 4, json.loads({json.dumps(tests)!r}), "
        f"{entry_point!r}, {per_test!r})\n"
    )
    to_runner, to_server = socket.socketpair()
    report_r, report_w = os.pipe()
    server = runner = None
    try:
        server = start_python(
            server_main,
            limits=limits,
            capture_output=False,
            files={HARNESS_FILE: _harness_source(), SOLUTION_FILE: extract_code(completion)},
            fds={3: to_server.fileno()},
        )
        runner = start_python(
            runner_main,
            limits=limits,
            files={HARNESS_FILE: _harness_source()},
            fds={3: report_w, 4: to_runner.fileno()},
        )
    finally:  # the runs hold their own copies now; keeping ours would hide their EOFs
        to_runner.close()
        to_server.close()
        os.close(report_w)
        if runner is None and server is not None:
            server.kill()
            server.wait()
            os.close(report_r)
    try:
        res = runner.wait()
        report = os.read(report_r, _MAX_REPORT)
    finally:
        os.close(report_r)
        server.kill()
        server.wait()
    return score_report(res, report)
