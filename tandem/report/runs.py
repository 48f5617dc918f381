"""What tandem-report reads: runs (a dump folder each) and tandem-sweep studies (a folder of
trial runs).

A run folder is recognised by ``metrics.jsonl``; a study folder by
``study.db`` (see tandem/sweep/study.py). Every path that is neither is an error
(`ReportError`, exit 3) naming the path and what was missing, and so is a line of
metrics.jsonl or samples.jsonl that is not what the trainers write (naming file:line);
a last line without its newline (cut by a crash) is left out.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from tandem.report import EXIT_NOT_A_RUN, ReportError


@dataclass
class Run:
    label: str
    folder: str
    rows: list[dict[str, Any]]  # metrics.jsonl, one dict per logged step
    samples: list[dict[str, Any]]  # samples.jsonl: {"step", "samples": [record, ...]} per step
    status: str | None = None  # a study trial's status
    params: dict[str, Any] = field(default_factory=dict)
    objective: float | None = None
    trial: int | None = None  # a study trial's number

    _index: dict[str, dict[int, float]] | None = field(default=None, repr=False)

    def _by_key(self) -> dict[str, dict[int, float]]:
        """key -> {step: value} of the numeric values, in one pass over the rows (a step
        logged twice, by a crash after logging and before the checkpoint: the later row wins)."""
        if self._index is None:
            self._index = {}
            for r in self.rows:
                for k, v in r.items():
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._index.setdefault(k, {})[r["step"]] = float(v)
        return self._index

    def keys(self) -> set[str]:
        return set(self._by_key())

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of ``key`` over the rows that have it; NaN/Inf are None (a gap)."""
        by_step = self._by_key().get(key, {})
        steps = sorted(by_step)
        return steps, [by_step[s] if math.isfinite(by_step[s]) else None for s in steps]


@dataclass
class StudyInfo:
    label: str
    folder: str
    study: Any  # optuna.Study
    objective: dict[str, str]  # metric, mode, direction
    params: list[str]
    runs: list[Run]


def _jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, value) of each complete, non-blank line; ReportError (3) at the first
    that is not JSON (deep nesting included) or the file that cannot be read."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith("\n"):
                    break  # cut short by a crash
                if line.strip():
                    out.append((n, json.loads(line)))
    except (ValueError, RecursionError) as e:
        what = "JSON nested too deeply" if isinstance(e, RecursionError) else f"not JSON ({e})"
        raise ReportError(EXIT_NOT_A_RUN, f"{path}:{n}: {what}") from None
    except OSError as e:
        raise ReportError(EXIT_NOT_A_RUN, f"{path}: cannot be read ({e.strerror or e})") from None
    return out


def _is_step(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """metrics.jsonl's rows: JSON objects with an integer ``step``."""
    rows = []
    for n, row in _jsonl(path):
        if not isinstance(row, dict) or not _is_step(row.get("step")):
            raise ReportError(
                EXIT_NOT_A_RUN,
                f'{path}:{n}: not a metrics row (a JSON object with an integer "step")',
            )
        rows.append(row)
    return rows


def read_sample_steps(folder: str) -> list[dict[str, Any]]:
    """samples.jsonl's steps ([] when there is none): {"step", "samples": [record, ...]} with each
    record an object whose texts are strings (tandem/rl/core/samples.py writes them)."""
    path = os.path.join(folder, "samples.jsonl")
    if not os.path.exists(path):
        return []
    steps = []
    for n, entry in _jsonl(path):
        recs = entry.get("samples") if isinstance(entry, dict) else None
        ok = (
            isinstance(entry, dict)
            and _is_step(entry.get("step"))
            and isinstance(recs, list)
            and all(isinstance(r, dict) and isinstance(r.get("completion", ""), str) for r in recs)
        )
        if not ok:
            raise ReportError(
                EXIT_NOT_A_RUN,
                f"{path}:{n}: not a samples step (a JSON object "
                'with an integer "step" and a list "samples" '
                "of objects)",
            )
        steps.append(entry)
    return steps


def load_run(folder: str, label: str | None = None) -> Run:
    """The run in a dump folder; ReportError (3) when the folder holds no metrics."""
    if not os.path.exists(folder):
        raise ReportError(EXIT_NOT_A_RUN, f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise ReportError(
            EXIT_NOT_A_RUN,
            f"{folder}: not a folder (give a run's job.dump_folder or a study folder)",
        )
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        what = "an empty folder" if not os.listdir(folder) else "no metrics.jsonl and no study.db"
        raise ReportError(
            EXIT_NOT_A_RUN, f"{folder}: {what}: not a run's dump folder nor a tandem-sweep study"
        )
    rows = read_metrics(path)
    if not rows:
        raise ReportError(EXIT_NOT_A_RUN, f"{path}: no complete rows (did the run log a step?)")
    return Run(
        label or os.path.basename(os.path.normpath(folder)) or folder,
        folder,
        rows,
        read_sample_steps(folder),
    )


def load_study(folder: str) -> StudyInfo:
    """A study folder: its trials as runs (those that logged a row), in trial order."""
    import optuna

    # "no complete trials" and such: the page says it
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = f"sqlite:///{os.path.abspath(os.path.join(folder, 'study.db'))}"
    try:
        study = optuna.load_study(study_name="sweep", storage=storage)
    except KeyError:
        raise ReportError(
            EXIT_NOT_A_RUN, f"{folder}: study.db holds no tandem-sweep study"
        ) from None
    except Exception as e:  # not SQLite, or not Optuna's tables (SQLAlchemy's and Optuna's errors)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ReportError(
            EXIT_NOT_A_RUN, f"{folder}/study.db: not a readable Optuna study ({first})"
        ) from None
    objective = study.user_attrs.get("objective") or {
        "metric": "objective",
        "mode": "",
        "direction": "",
    }
    params = list(json.loads(study.user_attrs.get("space", "{}")).get("params", {}))
    runs: dict[str, Run] = {}  # by folder: a retry shares the interrupted trial's folder and
    # replaces it
    for t in study.get_trials(deepcopy=False):
        sub = t.user_attrs.get("folder")
        trial_dir = os.path.join(folder, sub) if sub else ""
        if not sub or not os.path.isfile(os.path.join(trial_dir, "metrics.jsonl")):
            continue
        rows = read_metrics(os.path.join(trial_dir, "metrics.jsonl"))
        if not rows:
            continue
        status = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        runs[sub] = Run(
            f"trial {t.number} ({status})",
            trial_dir,
            rows,
            read_sample_steps(trial_dir),
            status,
            dict(t.params),
            t.value,
            t.number,
        )
    name = os.path.basename(os.path.normpath(folder)) or folder
    return StudyInfo(
        name,
        folder,
        study,
        objective,
        params or sorted({k for r in runs.values() for k in r.params}),
        sorted(runs.values(), key=lambda r: r.trial),
    )


def load(paths: list[str]) -> tuple[list[Run], list[StudyInfo]]:
    """Runs and studies from the command line's paths, in order; runs with the same name get
    their path."""
    runs: list[Run] = []
    studies: list[StudyInfo] = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "study.db")):
            s = load_study(p)
            studies.append(s)
            for r in s.runs:
                r.label = f"{s.label}/{r.label}" if len(paths) > 1 else r.label
            runs += s.runs
        else:
            runs.append(load_run(p))
    labels = [r.label for r in runs]
    for r in runs:
        if labels.count(r.label) > 1:
            r.label = os.path.normpath(r.folder)
    return runs, studies
