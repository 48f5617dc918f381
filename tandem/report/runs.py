"""What tandem-report reads: runs (a dump folder each) and tandem-sweep studies (a folder of trial runs).

A run folder is recognised by ``metrics.jsonl``; a study folder by
``study.db`` (see tandem/sweep/study.py). Every path that is neither is an error
(`ReportError`, exit 3) naming the path and what was missing.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from tandem.report import EXIT_NOT_A_RUN, ReportError
from tandem.rl.core.metrics import read_rows
from tandem.rl.core.samples import read_samples


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

    def keys(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of ``key`` over the rows that have it; NaN/Inf are None (a gap in a plot).
        A step logged twice (a crash after logging, before the checkpoint): the later row wins."""
        by_step = {r["step"]: float(r[key]) for r in self.rows
                   if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)}
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



def load_run(folder: str, label: str | None = None) -> Run:
    """The run in a dump folder; ReportError (3) when the folder holds no metrics."""
    if not os.path.exists(folder):
        raise ReportError(EXIT_NOT_A_RUN, f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise ReportError(EXIT_NOT_A_RUN, f"{folder}: not a folder (give a run's job.dump_folder or a study folder)")
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        what = "an empty folder" if not os.listdir(folder) else "no metrics.jsonl and no study.db"
        raise ReportError(EXIT_NOT_A_RUN, f"{folder}: {what}: not a run's dump folder nor a tandem-sweep study")
    rows = read_rows(path)
    if not rows:
        raise ReportError(EXIT_NOT_A_RUN, f"{path}: no complete rows (did the run log a step?)")
    return Run(label or os.path.basename(os.path.normpath(folder)) or folder, folder, rows, read_samples(folder))


def load_study(folder: str) -> StudyInfo:
    """A study folder: its trials as runs (those that logged a row), in trial order."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # "no complete trials" and such: the page says it
    storage = f"sqlite:///{os.path.abspath(os.path.join(folder, 'study.db'))}"
    try:
        study = optuna.load_study(study_name="sweep", storage=storage)
    except KeyError:
        raise ReportError(EXIT_NOT_A_RUN, f"{folder}: study.db holds no tandem-sweep study") from None
    objective = study.user_attrs.get("objective") or {"metric": "objective", "mode": "", "direction": ""}
    params = list(json.loads(study.user_attrs.get("space", "{}")).get("params", {}))
    runs: dict[str, Run] = {}  # by folder: a retry shares the interrupted trial's folder and replaces it
    for t in study.get_trials(deepcopy=False):
        sub = t.user_attrs.get("folder")
        trial_dir = os.path.join(folder, sub) if sub else ""
        if not sub or not os.path.isfile(os.path.join(trial_dir, "metrics.jsonl")):
            continue
        rows = read_rows(os.path.join(trial_dir, "metrics.jsonl"))
        if not rows:
            continue
        status = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        runs[sub] = Run(f"trial {t.number} ({status})", trial_dir, rows, read_samples(trial_dir), status,
                        dict(t.params), t.value, t.number)
    name = os.path.basename(os.path.normpath(folder)) or folder
    return StudyInfo(name, folder, study, objective, params or sorted({k for r in runs.values() for k in r.params}),
                     sorted(runs.values(), key=lambda r: r.trial))


def load(paths: list[str]) -> tuple[list[Run], list[StudyInfo]]:
    """Runs and studies from the command line's paths, in order; runs with the same name get their path."""
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
