"""Read local jsonl / parquet files into rows with `datasets`, with clear errors.

Rows are plain dicts. A file that `datasets` cannot parse is scanned again line
by line so the error names the offending line, never a deep stack trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


class DataError(Exception):
    """Bad input data; str() is one line naming the file and row or line."""


def _infer_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    raise DataError(f"{path}: cannot tell the format from the extension; set data.format to jsonl or parquet")


def iter_jsonl_objects(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` for each non-blank line of a JSON-lines file, streamed.

    ``where`` is ``"path:line"``; an unreadable file, a line that is not JSON or
    not a JSON object raises DataError naming it.
    """
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _first_bad_json_line(path: str) -> str | None:
    try:
        for _ in iter_jsonl_objects(path):
            pass
    except DataError as e:
        return str(e)
    return None


def load_rows(path: str, fmt: str = "auto") -> list[dict[str, Any]]:
    """All rows of a local jsonl or parquet file, in file order."""
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    fmt = _infer_format(path, fmt)
    if fmt == "jsonl":
        bad = _first_bad_json_line(path)  # cheap, and gives the line number datasets hides
        if bad:
            raise DataError(bad)
    import datasets  # lazy: ~1 s import

    datasets.disable_progress_bars()
    builder = "json" if fmt == "jsonl" else "parquet"
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # schema clashes between rows and the like
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: could not read as {fmt}: {first}") from None
    return ds.to_list()
