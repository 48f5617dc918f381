"""Step metrics to the console, metrics.jsonl and the loggers of ``metrics.loggers`` (rank 0
writes), and `Tally`: metrics that declare how they combine over rounds and ranks."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tandem.rl.core.errors import EXIT_CHECKPOINT
from tandem.rl.core.health import waiting
from tandem.rl.core.loggers import Sink, finite_scalars, open_sinks


def parse_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl rows: the lines holding a JSON object with an integer ``step``
    (others skipped)."""
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


class Tally:
    """Step metrics, each declared with how it combines over rounds and ranks:

    - ``sum``: counts and seconds (a reward's errors, generated tokens), added;
    - ``mean``: averages, weighted by what they average over (a reward's mean over samples);
    - ``max``: the largest (a response length);
    - ``local``: this rank's own value, never combined over ranks (a KV pool's size);
      over rounds the latest, or with ``add=True`` the total (this rank's rollout seconds).

    `merge` adds another tally (a refill round); `reduce(group)` combines every rank's
    in two all-reduces (sums and weighted means together, then maxima) and returns the
    values. Declaring the reduction with the value replaces key-suffix conventions."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._mean: dict[str, tuple[float, float]] = {}  # key -> (weighted sum, weight)
        self._max: dict[str, float] = {}
        self._local: dict[str, float] = {}
        self._adds: set[str] = set()  # local keys that add up over rounds

    def sum(self, key: str, value: float) -> Tally:
        self._sum[key] = self._sum.get(key, 0.0) + float(value)
        return self

    def mean(self, key: str, value: float, weight: float = 1.0) -> Tally:
        s, w = self._mean.get(key, (0.0, 0.0))
        self._mean[key] = (s + float(value) * weight, w + weight)
        return self

    def max(self, key: str, value: float) -> Tally:
        self._max[key] = max(self._max.get(key, -math.inf), float(value))
        return self

    def local(self, key: str, value: float, *, add: bool = False) -> Tally:
        self._local[key] = float(value) + (self._local.get(key, 0.0) if add else 0.0)
        if add:
            self._adds.add(key)
        return self

    def merge(self, other: Tally) -> Tally:
        for k, v in other._sum.items():
            self.sum(k, v)
        for k, (s, w) in other._mean.items():
            old = self._mean.get(k, (0.0, 0.0))
            self._mean[k] = (old[0] + s, old[1] + w)
        for k, v in other._max.items():
            self.max(k, v)
        for k, v in other._local.items():
            self.local(k, v, add=k in other._adds or k in self._adds)
        return self

    def keys(self) -> list[str]:
        return sorted({*self._sum, *self._mean, *self._max, *self._local})

    def values(self) -> dict[str, float]:
        """This rank's values (nothing combined over ranks)."""
        out = dict(self._local)
        out.update(self._sum)
        out.update({k: s / w if w else 0.0 for k, (s, w) in self._mean.items()})
        out.update(self._max)
        return out

    def reduce(self, group: Any = None, device: Any = None) -> dict[str, float]:
        """Collective over ``group`` (every rank, with the same keys): the combined values.
        The keys are agreed first, so a rank that saw none of a metric still takes part."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.values()
        kinds: list[Any] = [None] * dist.get_world_size(group)
        mine = (sorted(self._sum), sorted(self._mean), sorted(self._max))
        with waiting("all_gather:metric_keys"):  # the first of the reduction's collectives
            dist.all_gather_object(kinds, mine, group=group)
        sums = sorted({k for part in kinds for k in part[0]})
        means = sorted({k for part in kinds for k in part[1]})
        maxes = sorted({k for part in kinds for k in part[2]})
        flat = [self._sum.get(k, 0.0) for k in sums]
        for k in means:
            flat += list(self._mean.get(k, (0.0, 0.0)))
        t = torch.tensor(flat, dtype=torch.float64, device=device)
        if len(flat):
            dist.all_reduce(t, group=group)
        m = torch.tensor(
            [self._max.get(k, -math.inf) for k in maxes], dtype=torch.float64, device=device
        )
        if len(maxes):
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        vals = t.tolist()
        out = dict(self._local)
        out.update(zip(sums, vals[: len(sums)]))
        rest = vals[len(sums) :]
        out.update(
            {
                k: rest[2 * i] / rest[2 * i + 1] if rest[2 * i + 1] else 0.0
                for i, k in enumerate(means)
            }
        )
        out.update(zip(maxes, m.tolist()))
        return out


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

    def __init__(
        self,
        dump_folder: str,
        *,
        enabled: bool,
        jsonl: bool = True,
        loggers: Sequence[str] = ("tensorboard",),
        run_name: str = "tandem",
        config: dict[str, Any] | None = None,
        console_keys: tuple[str, ...] = (),
    ) -> None:
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
        parts = [
            f"{k}={_fmt(clean[k])}" for k in keys if k in clean and not isinstance(clean[k], str)
        ]
        eta = ""
        if total_steps:
            elapsed = time.monotonic() - self._t0
            done = max(step, 1)
            eta = f" eta={max(total_steps - step, 0) * elapsed / done:.0f}s"
        print(
            f"step {step}"
            + (f"/{total_steps}" if total_steps else "")
            + " "
            + " ".join(parts)
            + eta,
            flush=True,
        )

    def reopen(self) -> None:
        """Open metrics.jsonl afresh at the next row (it was cut back: a rollback)."""
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None

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
    seen = [row["step"] for row in read_step_log(path)]
    counts = {s: 0 for s in range(first, steps + 1)}
    for s in seen:
        if s in counts:  # steps past ``steps`` (a rerun asking for fewer) are not a gap
            counts[s] += 1
    missing = [s for s, c in counts.items() if c == 0]
    repeated = sorted(s for s, c in counts.items() if c > 1)
    if not missing and not repeated:
        return None
    parts = ([f"steps {_spans(missing)} missing"] if missing else []) + (
        [f"steps {_spans(repeated)} repeated"] if repeated else []
    )
    return f"{path}: {'; '.join(parts)} (of {first}..{steps})"


def position_repeats(path: str) -> str | None:
    """Data-stream positions that more than one step of a ledger.jsonl trained (an
    asynchronous run trains a prompt at a later step than it took it, once), or None."""
    first: dict[int, int] = {}
    twice: list[tuple[int, int, int]] = []
    for row in read_step_log(path):
        for p in row.get("positions", []):
            if p in first:
                twice.append((p, first[p], row["step"]))
            else:
                first[p] = row["step"]
    if not twice:
        return None
    shown = ", ".join(f"{p} (steps {a} and {b})" for p, a, b in twice[:5])
    more = f" and {len(twice) - 5} more" if len(twice) > 5 else ""
    return f"{path}: positions {shown}{more}"


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
    """Keep the rows of a per-step jsonl file with ``step <= last_step`` (resume after a crash);
    a torn last line is dropped with one warning (`read_step_log`)."""
    if not os.path.exists(path):
        return
    kept = [line for row, line in _read_lines(path, warn=True) if row["step"] <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(line + b"\n" for line in kept)
    os.replace(tmp, path)


class StepLogError(Exception):
    """A per-step log of the dump folder (metrics.jsonl, ledger.jsonl, samples.jsonl) that a
    crash cannot have left: a bad line that is not the last, a row of the wrong type, a
    folder or other non-file in its place. One line; exit 8 (the run's saved state)."""

    exit_status = EXIT_CHECKPOINT


# optional fields of a per-step row and the type of their items (ledger.jsonl's)
_LIST_FIELDS = {"ids": str, "positions": int}


def read_step_log(path: str, *, warn: bool = False) -> list[dict[str, Any]]:
    """The rows of a per-step jsonl file the run wrote ([] when there is none): JSON objects
    with an integer ``step`` >= 0 (``ids``/``positions``, when present, lists of str/int).

    A last line that is not JSON is what a crash or a full disk during an append leaves: it
    is left out (``warn``: with one line on stderr; `truncate_jsonl` rewrites the file
    without it). Anything else raises `StepLogError` naming the file and line."""
    return [row for row, _ in _read_lines(path, warn=warn)] if os.path.exists(path) else []


def _read_lines(path: str, warn: bool) -> list[tuple[dict[str, Any], bytes]]:
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, a folder cannot be read
        what = "a folder" if os.path.isdir(path) else "not a regular file"
        raise StepLogError(
            f"{path} is {what}; the run writes this per-step log itself: move it away, or "
            "choose another job.dump_folder"
        )
    with open(path, "rb") as f:
        numbered = [(i + 1, ln) for i, ln in enumerate(f.read().split(b"\n")) if ln.strip()]
    out = []
    for n, line in numbered:
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if n != numbered[-1][0]:
                raise StepLogError(
                    f"{path}:{n}: not a JSON line ({e}); only the last line of a per-step log "
                    "can be cut short by a crash"
                ) from None
            if warn:
                print(
                    f"warning: {path}:{n}: the last line is cut short (a crash or a full disk "
                    "during an append); dropped it",
                    file=sys.stderr,
                    flush=True,
                )
            break
        why = _row_problem(row)
        if why:
            raise StepLogError(f"{path}:{n}: {why}")
        out.append((row, line))
    return out


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a JSON object"
    step = row.get("step")
    if type(step) is not int or step < 0:
        return f"step is {step!r}, not an integer >= 0"
    for key, kind in _LIST_FIELDS.items():
        v = row.get(key, [])
        if not isinstance(v, list) or not all(type(x) is kind for x in v):
            return f"{key} is not a list of {kind.__name__}"
    return None
