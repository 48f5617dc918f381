"""Reading the field a ``*_field`` setting names from a data row (jsonl object or parquet row)."""

from __future__ import annotations

from typing import Any


def get_field(row: dict[str, Any], path: str) -> Any:
    """The value a ``*_field`` setting names: a top-level key, or a dotted path into nested
    columns (``reward_model.ground_truth``, ``extra_info.index``; a number indexes a list).
    A key that itself holds dots wins over the path. None when the row has no such field."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value
