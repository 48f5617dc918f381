"""Read local jsonl / parquet files into rows with `datasets`, with clear errors.

Rows are plain dicts. A file that `datasets` cannot parse is scanned again line
by line so the error names the offending line, never a deep stack trace.
"""

from __future__ import annotations

import json
import os
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


def _first_bad_json_line(path: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
            if not isinstance(obj, dict):
                return f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
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
