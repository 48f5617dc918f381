"""Step metrics to the console, metrics.jsonl and the loggers of ``metrics.loggers`` (rank 0 writes)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tandem.rl.core.loggers import Sink, finite_scalars, open_sinks


def parse_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl rows: the lines holding a JSON object with an integer ``step`` (others skipped)."""
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def read_rows(path: str) -> list[dict[str, Any]]:
    """The complete rows of a metrics.jsonl file ([] when there is none): a last line cut
    short by a crash (no newline) is left out."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_rows(line for line in f if line.endswith("\n"))


def _fmt(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    if abs(v) >= 100:
        return f"{v:.1f}"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


class MetricsLogger:
    """One JSON object per step in ``metrics.jsonl``; the same numbers to each of ``loggers``
    (tensorboard scalars in ``tb/``, a W&B run, an MLflow run: tandem/rl/core/loggers.py)."""

    def __init__(self, dump_folder: str, *, enabled: bool, jsonl: bool = True,
                 loggers: Sequence[str] = ("tensorboard",), run_name: str = "tandem",
                 config: dict[str, Any] | None = None, console_keys: tuple[str, ...] = ()) -> None:
        self.enabled = enabled
        self.console_keys = console_keys
        self._jsonl = None
        self._jsonl_path: str | None = None
        self._sinks: list[Sink] = []
        self._t0 = time.monotonic()
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        # Opened on the first row, so a resume may first truncate rows past its checkpoint.
        self._jsonl_path = os.path.join(dump_folder, "metrics.jsonl") if jsonl else None
        self._sinks = open_sinks(list(loggers), dump_folder, run_name, config or {})

    def log(self, step: int, metrics: dict[str, Any], *, total_steps: int | None = None) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if not isinstance(v, (int, str)) else v) for k, v in metrics.items()}
        if self._jsonl is None and self._jsonl_path:
            self._jsonl = open(self._jsonl_path, "a", encoding="utf-8")
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._sinks:
            scalars = finite_scalars(clean)
            for sink in self._sinks:
                sink.log(step, scalars)
        keys = self.console_keys or tuple(clean)
        parts = [f"{k}={_fmt(clean[k])}" for k in keys if k in clean and not isinstance(clean[k], str)]
        eta = ""
        if total_steps:
            elapsed = time.monotonic() - self._t0
            done = max(step, 1)
            eta = f" eta={max(total_steps - step, 0) * elapsed / done:.0f}s"
        print(f"step {step}" + (f"/{total_steps}" if total_steps else "") + " " + " ".join(parts) + eta, flush=True)

    def text(self, tag: str, text: str, step: int) -> None:
        for sink in self._sinks:
            sink.text(tag, text, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def step_gaps(path: str, steps: int, first: int = 1) -> str | None:
    """What is wrong with a per-step jsonl file that should hold steps ``first``..``steps``
    once each (missing or repeated steps), or None when it does."""
    seen: list[int] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            seen = [int(json.loads(line)["step"]) for line in f if line.strip()]
    counts = {s: 0 for s in range(first, steps + 1)}
    for s in seen:
        if s in counts:  # steps past ``steps`` (a rerun asking for fewer) are not a gap
            counts[s] += 1
    missing = [s for s, c in counts.items() if c == 0]
    repeated = sorted(s for s, c in counts.items() if c > 1)
    if not missing and not repeated:
        return None
    parts = ([f"steps {_spans(missing)} missing"] if missing else []) + \
            ([f"steps {_spans(repeated)} repeated"] if repeated else [])
    return f"{path}: {'; '.join(parts)} (of {first}..{steps})"


def _spans(values: list[int]) -> str:
    """Sorted ints as runs: [1, 2, 3, 5] -> "1-3,5"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def truncate_jsonl(path: str, last_step: int) -> None:
    """Keep the rows of a per-step jsonl file with ``step <= last_step`` (resume after a crash)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(rows)
    os.replace(tmp, path)
