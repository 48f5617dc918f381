"""The ``code_unit_tests`` reward: the fraction of a row's unit tests a completion passes.

``sample["tests"]`` is either a list of test snippets (typically ``assert`` lines, as in
MBPP) or one string of test code. A string made only of top-level ``assert``
statements is split into one test per assert; any other string is one test, and when
``sample["entry_point"]`` is given and the string defines ``check`` (HumanEval style)
the test is ``check(<entry_point>)``. The solution is the last fenced ```` ```python ````
block of the completion (else the last bare ```` ``` ```` block, else the whole text).

How a run is scored (why it is hard to fake):

* The solution and a harness run in rl/workers/sandbox.py. The harness first reads a per-call
  random nonce (``secrets.token_hex``, made in this process for this call) from its
  stdin, which is an unlinked file, and then points fd 0 at /dev/null; it keeps a
  private duplicate of the real stdout fd and points fd 1 at /dev/null too, so
  whatever the solution prints (``print``, a replaced ``sys.stdout``, ``os.write(1,
  ...)``) goes nowhere. The nonce is in no file and no environment variable.
* Each test runs separately under ``try/except BaseException`` (``sys.exit`` inside a
  test is a failure, not an exit) with a per-test timer. Only after the last test does
  the harness write ``__TANDEM_RESULT__ <nonce> <passed>/<total>`` to its private fd and
  ``os._exit(0)`` (no atexit hooks, no lingering threads).
* The reward is ``passed / total`` only if that exact line, with this call's nonce and
  the expected total, is the last line of stdout, the exit status is 0 and no sandbox
  limit was hit; anything else (``os._exit`` before the tests, a forged result line,
  a crash, a timeout, a flood of output) scores 0.

Limits, honestly: the solution runs in the same interpreter as the harness, so code
that deliberately introspects it (``sys._getframe().f_back.f_locals``, ``gc``,
``/proc/self/mem``) can read the nonce or patch the tests, and objects that lie in
``__eq__`` pass ``assert`` comparisons. The nonce defeats early exits and printed
fake results, not an adversary that attacks the harness itself; only running the
tests in a separate process would. ``wall_time_s`` bounds the whole run, so a slow
solution can score 0 even if each test would pass on its own.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from rl.rewards.registry import register_reward
from rl.workers.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["build_harness", "code_unit_tests", "extract_code", "normalize_tests",
           "score_result"]

RESULT_MARK = "__TANDEM_RESULT__"
SOLUTION_FILE = "solution.py"
_PY_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)
_BARE_FENCE_RE = re.compile(r"```[ \t]*\n(.*?)```", re.S)

# The harness is trusted code; it receives (tests, entry_point, per_test_s) as a JSON
# literal. Everything it needs later is bound to locals before the solution runs.
_HARNESS = r'''
import builtins as _builtins, os as _os, signal as _signal, sys as _sys


class _TestTimeout(BaseException):
    pass


def _tandem_harness(tests, entry_point, per_test_s):
    write, exit_, read, dup, dup2, close = (
        _os.write, _os._exit, _os.read, _os.dup, _os.dup2, _os.close)
    setitimer, ITIMER_REAL, setsig, SIGALRM = (
        _signal.setitimer, _signal.ITIMER_REAL, _signal.signal, _signal.SIGALRM)
    compile_, exec_, len_, str_, type_ = compile, exec, len, str, type
    err = _sys.stderr.write
    nonce = read(0, 4096).decode("ascii").strip()
    null = _os.open(_os.devnull, _os.O_RDWR)
    dup2(null, 0)  # the nonce file is gone: fd 0 now reads /dev/null
    out = dup(1)  # private copy of the real stdout (not inherited across exec)
    dup2(null, 1)  # the solution's prints go nowhere
    close(null)

    def on_alarm(signum, frame):
        raise _TestTimeout(f"test took longer than {per_test_s} s")

    def guarded(label, source, ns):
        setsig(SIGALRM, on_alarm)
        setitimer(ITIMER_REAL, per_test_s)
        try:
            exec_(compile_(source, label, "exec"), ns)
            return True
        except BaseException as exc:  # a failing test, sys.exit and timeouts alike
            setitimer(ITIMER_REAL, 0)
            try:
                err(f"[{label}] {type_(exc).__name__}: {str_(exc)[:300]}\n")
            except BaseException:
                pass
            return False
        finally:
            setitimer(ITIMER_REAL, 0)

    ns = {"__name__": "solution", "__builtins__": _builtins}
    with open(SOLUTION_FILE, encoding="utf-8") as f:
        source = f.read()
    guarded(SOLUTION_FILE, source, ns)
    if entry_point is not None and entry_point in ns:
        ns["candidate"] = ns[entry_point]
    passed = 0
    for i, test in enumerate(tests):
        if entry_point is not None and entry_point not in ns:
            break
        if guarded(f"test_{i}", test, ns):
            passed += 1
    write(out, f"\n{RESULT_MARK} {nonce} {passed}/{len_(tests)}\n".encode("ascii"))
    exit_(0)


_tandem_harness(*_PARAMS)
'''


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


def build_harness(tests: Sequence[str], entry_point: str | None, per_test_s: float) -> str:
    """Source of the harness program (reads the nonce from stdin, never embeds it)."""
    if entry_point is not None and not entry_point.isidentifier():
        raise ValueError(f"entry_point {entry_point!r} is not a Python identifier")
    params = json.dumps([list(tests), entry_point, float(per_test_s)])
    return (f"RESULT_MARK = {RESULT_MARK!r}\nSOLUTION_FILE = {SOLUTION_FILE!r}\n"
            f"import json as _json\n_PARAMS = _json.loads({params!r})\n{_HARNESS}")


def score_result(res: SandboxResult, nonce: str, total: int) -> float:
    """passed/total from the harness's last line, or 0.0 if it is missing or forged."""
    if res.exit_code != 0 or res.limit_hit is not None:
        return 0.0
    lines = res.stdout.splitlines()
    if not lines:
        return 0.0
    m = re.fullmatch(rf"{RESULT_MARK} (\S+) (\d+)/(\d+)", lines[-1])
    if m is None or not secrets.compare_digest(m.group(1), nonce):
        return 0.0
    passed, got_total = int(m.group(2)), int(m.group(3))
    if got_total != total or passed > total:
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
    tests = normalize_tests(sample["tests"], entry_point)
    if not tests:
        raise ValueError("sample['tests'] is empty")
    nonce = secrets.token_hex(16)
    limits = SandboxLimits(cpu_time_s=cpu_time_s, wall_time_s=wall_time_s,
                           memory_mb=memory_mb)
    res = run_python(build_harness(tests, entry_point, per_test_timeout_s),
                     stdin=nonce + "\n", limits=limits,
                     files={SOLUTION_FILE: extract_code(completion)})
    return score_result(res, nonce, len(tests))
