"""Fixtures of the sandbox tests (tests/sandbox/test_sandbox*.py)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def temp_root() -> Iterator[str]:
    """A world-searchable temp root (a per-run uid must reach its work dir in it);
    the test fails if a run leaves anything in it."""
    root = tempfile.mkdtemp(prefix="tandem-sbx-test-")
    os.chmod(root, 0o711)
    try:
        yield root
        assert os.listdir(root) == [], "sandbox left files in the temp root"
    finally:
        for name in os.listdir(root):
            subprocess.run(["rm", "-rf", os.path.join(root, name)], check=False)
        os.rmdir(root)
