"""Triton kernel tests on a machine without CUDA: under the interpreter, in this process
when it can, else in a fresh one.

``TRITON_INTERPRET=1`` only works if set before ``triton`` is first imported (tests/conftest.py
and the test modules set it). If another module imported triton first, the interpreter is
unusable in this process: a test module then skips its Triton tests (`skip_reason`) and
reruns itself whole in a clean subprocess (`rerun_in_clean_subprocess`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.kernels.dispatch import triton_available, triton_interpreting

ROOT = Path(__file__).resolve().parents[2]
SKIP_REASON = (
    "triton was imported before TRITON_INTERPRET was set; covered by test_all_in_clean_subprocess"
)


def in_process() -> bool:
    """Whether Triton kernels can run in this process (CUDA, or the interpreter in force)."""
    if triton_available() and not torch.cuda.is_available():
        import triton.language  # noqa: F401  (decorated for the interpreter if we came first)
    return torch.cuda.is_available() or triton_interpreting()


def rerun_in_clean_subprocess(test_file: str) -> None:
    """Run ``test_file`` under pytest in a fresh interpreter with ``TRITON_INTERPRET=1``; fail
    with its output if any test there fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def interpreter_guard(test_file: str):  # noqa: ANN201 - (fixture, test function)
    """What a Triton test module binds at its top level, after setting ``TRITON_INTERPRET``: an
    autouse fixture that skips the tests named ``*triton*`` when Triton kernels cannot run in
    this process, and ``test_all_in_clean_subprocess``, which then reruns the whole file in a
    fresh interpreter (and passes at once when they can run here)."""
    usable = in_process()

    @pytest.fixture(autouse=True)
    def needs_usable_triton(request: pytest.FixtureRequest) -> None:
        if "triton" in request.node.name and not usable:
            pytest.skip(SKIP_REASON)

    def test_all_in_clean_subprocess() -> None:
        if not usable:
            rerun_in_clean_subprocess(test_file)

    return needs_usable_triton, test_all_in_clean_subprocess
