"""Read local jsonl / parquet files (or a folder of them) into rows, with clear errors.

Rows are plain dicts with the types the file holds: JSON lines are parsed one by
one with ``json`` (no schema is inferred across rows, so one odd row never
changes the others), parquet files with pyarrow. `load_rows` returns `Rows`, a
list that also knows where each row came from (``path:line``), so a bad row is
reported by file and line. Whether a row's fields have the right types is the
consumer's check (tandem/rl/data/prompts.py, sft.py, preference.py): a wrong type is a
bad row, skipped and counted or an error by ``data.on_bad_row``.

Whole-file problems are a `DataError` naming the file (and line): not found,
empty, not UTF-8, not JSON, not parquet, or a folder with no data files.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any, SupportsIndex, overload

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)


class DataError(Exception):
    """Bad input data; str() is one line naming the file and row or line."""


class Rows(list):
    """Rows in file order; ``where[i]`` says where row i came from (``path:line``).
    Slices keep their places."""

    def __init__(self, rows: Iterable[dict[str, Any]] = (), where: Iterable[str] = ()) -> None:
        super().__init__(rows)
        self.where = list(where)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Rows: ...

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        if isinstance(i, slice):
            return Rows(super().__getitem__(i), self.where[i])
        return super().__getitem__(i)


def row_where(rows: list[dict[str, Any]], i: int, source: str) -> str:
    """Where row ``i`` of ``rows`` came from: ``path:line`` for `Rows`, else ``source: row i``."""
    if isinstance(rows, Rows) and len(rows.where) == len(rows):
        return rows.where[i]
    return f"{source}: row {i}"


IMAGE_KEYS = ("image", "image_url")


def is_image_part(part: dict[str, Any]) -> bool:
    """A content part that holds an image (``{"type": "image", "image": ...}`` or an
    ``image_url``)."""
    return part.get("type") == "image" or any(part.get(k) is not None for k in IMAGE_KEYS)


def _parts_problem(content: list[Any]) -> str | None:
    for p in content:
        if not isinstance(p, dict):
            return f"a content part must be an object, got {type(p).__name__}"
        if not is_image_part(p) and (
            p.get("type", "text") != "text" or not isinstance(p.get("text"), str)
        ):
            return (
                f"a content part must be {{'type': 'text', 'text': ...}} or an image, got keys "
                f"{sorted(p)}"
            )
    return None


def message_problem(messages: Any) -> str | None:
    """Why ``messages`` is not a non-empty list of {"role": str, "content": str or a list of
    text / image parts}, or None."""
    if messages is None or messages == []:
        return "empty conversation"
    if not isinstance(messages, list):
        return f"messages must be a list of messages, got {type(messages).__name__}"
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return "each message needs 'role' and 'content'"
        if isinstance(m["content"], list) and isinstance(m["role"], str):
            if (problem := _parts_problem(m["content"])) is not None:
                return problem
            continue
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            bad = "role" if not isinstance(m["role"], str) else "content"
            return f"a message's {bad!r} must be a string, got {type(m[bad]).__name__}"
    return None


def _infer_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise DataError(
        f"{path}: cannot tell the format from the extension; set data.format to jsonl or parquet"
    )


def _open_binary(path: str) -> Any:
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
            "of the line); data files must be UTF-8"
        ) from None


def _parse_object(text: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def iter_jsonl_objects(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` for each non-blank line of a JSON-lines file (``.gz`` too), streamed.

    ``where`` is ``"path:line"``; an unreadable file, a line that is not UTF-8,
    not JSON or not a JSON object raises DataError naming it.
    """
    path = os.fspath(path)
    with _open_binary(path) as f:
        try:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                line = _decode(raw, where)
                if line.strip():
                    yield where, _parse_object(line, where)
        except (OSError, EOFError) as e:  # a damaged .gz
            raise DataError(f"{path}: cannot read: {e}") from None


def _json_array(path: str, text: str) -> Rows:
    """A ``.json`` file holding one JSON array of objects (what `datasets` also reads)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    rows = Rows()
    for i, obj in enumerate(items):
        where = f"{path}: item {i}"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        rows.append(obj)
        rows.where.append(where)
    return rows


def _load_jsonl(path: str) -> Rows:
    if path.endswith(".json"):
        with _open_binary(path) as f:
            head = f.read(1 << 16)
        if head.lstrip()[:1] == b"[":
            with _open_binary(path) as f:
                return _json_array(path, _decode(f.read(), path))
    rows = Rows()
    for where, obj in iter_jsonl_objects(path):
        rows.append(obj)
        rows.where.append(where)
    return rows


def _load_parquet(path: str) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable parquet file ({first})") from None
    rows = table.to_pylist()
    return Rows(rows, (f"{path}: row {i}" for i in range(len(rows))))


def _load_file(path: str, fmt: str) -> Rows:
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty file (no rows)")
    rows = _load_jsonl(path) if _infer_format(path, fmt) == "jsonl" else _load_parquet(path)
    if not rows:
        raise DataError(f"{path}: no rows (only blank lines)")
    return rows


def data_files(folder: str, fmt: str = "auto") -> list[str]:
    """The data files directly in ``folder`` (not its subfolders), sorted by name: those
    with a jsonl / parquet extension (``fmt="auto"``), or those of ``fmt``."""
    suffixes = {
        "auto": JSONL_SUFFIXES + PARQUET_SUFFIXES,
        "jsonl": JSONL_SUFFIXES,
        "parquet": PARQUET_SUFFIXES,
    }[fmt]
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise DataError(f"{folder}: {e.strerror}") from None
    files = [
        os.path.join(folder, n)
        for n in names
        if n.endswith(suffixes)
        and not n.startswith(".")
        and os.path.isfile(os.path.join(folder, n))
    ]
    if not files:
        raise DataError(
            f"{folder}: a folder with no data files ({', '.join('*' + s for s in suffixes)})"
        )
    return files


def load_rows(path: str, fmt: str = "auto") -> Rows:
    """All rows of a local jsonl or parquet file, or of every data file directly in a
    folder (in name order), in file order."""
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    if not os.path.isdir(path):
        return _load_file(path, fmt)
    rows = Rows()
    for f in data_files(path, fmt):
        part = _load_file(f, fmt)
        rows.extend(part)
        rows.where.extend(part.where)
    return rows


class EpochOrder:
    """An endless chain of the row numbers ``0 .. num_rows - 1``, one permutation per epoch (the
    identity without ``shuffle``): position g is row ``perm(g // num_rows)[g % num_rows]``, a pure
    function of (seed, g), so a resumed run reads the rows the uninterrupted one would."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if self.shuffle:
                import torch  # torch's seeded permutation: the row order of every run so far

                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perms[epoch] = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.num_rows))
        return self._perms[epoch]

    def row(self, position: int) -> int:
        return self._perm(position // self.num_rows)[position % self.num_rows]
