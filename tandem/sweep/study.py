"""The sweep loop: Optuna's ask/tell around train.py processes, with a study that survives
the sweep.

The study is ``<study>/study.db`` (Optuna's RDB storage on SQLite), one study
named "sweep". A trial's states map to ours so:

    COMPLETE  exited 0; its value is the objective read from its metrics.jsonl
    PRUNED    the pruner said stop: SIGTERM, train.py checkpointed and exited (75)
    FAIL      exited non-zero by itself (user attr "error": its error line), or
              was interrupted (user attr "interrupted"): the sweep was killed or
              stopped while it ran. An interrupted trial is retried: the same
              parameters are enqueued (user attr "retry_of") and run in the same
              dump folder, so train.py resumes from the trial's checkpoint.

``--trials N`` counts finished trials (COMPLETE, PRUNED, and FAIL not
interrupted), so a resumed sweep never re-runs a finished trial and ends with
N of them. While a sweep runs it holds ``<study>/sweep.lock``; a new sweep on
the same folder first waits for the trial processes a killed sweep left
(they got SIGTERM when it died, and are checkpointing) and marks them
interrupted.

Pruning reads the objective metric from the running trial's metrics.jsonl as
it grows (each logged value is `Trial.report`-ed at its training step) and asks
the pruner after each value; a value at the last training step is not a
reason to stop.
"""

from __future__ import annotations

import csv
import fcntl
import math
import os
import signal
import time
from dataclasses import asdict
from typing import Any

from tandem.rl.config.schema import Config, ConfigError, format_config
from tandem.rl.core.configlib import format_toml
from tandem.sweep import (
    EXIT_BUSY,
    EXIT_INTERRUPTED,
    EXIT_METRIC,
    EXIT_NO_TRIAL,
    EXIT_OK,
    EXIT_USAGE,
    SweepError,
)
from tandem.sweep.space import Objective, Space, trial_config
from tandem.sweep.trial import (
    Slot,
    TrialProcess,
    command,
    keep_rows,
    last_error,
    latest_checkpoint,
    metric_points,
    objective_value,
    read_rows,
    shown,
    wait_gone,
)

STUDY_NAME = "sweep"
POLL_S = 0.5
STOP_WAIT_S = 300.0  # how long a SIGTERM-ed trial may take to checkpoint before it is killed


def _optuna():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def lock_study(folder: str) -> Any:
    """Hold ``<study>/sweep.lock`` for this process's life; another holder is SweepError(5)."""
    os.makedirs(folder, exist_ok=True)
    f = open(os.path.join(folder, "sweep.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SweepError(
            EXIT_BUSY,
            f"study folder {folder} is in use by another tandem-sweep "
            f"(pid {f.read().strip() or '?'}); wait for "
            "it or stop it",
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


class Sweep:
    """One session of a study: resume what a killed session left, run until N trials finished."""

    def __init__(
        self,
        folder: str,
        config_path: str,
        space: Space,
        objective: Objective,
        base: Config,
        trials: int,
        slots: list[Slot],
        ranks: int,
    ) -> None:
        self.folder, self.config_path, self.space, self.objective = (
            folder,
            config_path,
            space,
            objective,
        )
        self.target, self.slots, self.ranks = trials, slots, ranks
        self.ckpt_folder = base.checkpoint.folder
        self.optuna = _optuna()
        db = os.path.join(folder, "study.db")
        try:
            self.storage = self.optuna.storages.RDBStorage(f"sqlite:///{os.path.abspath(db)}")
            self.study = self._open(format_config(base))
            self.study_id = self.storage.get_study_id_from_name(STUDY_NAME)
        except SweepError:
            raise
        except Exception as e:  # not SQLite or not Optuna's tables (SQLAlchemy's, Optuna's errors)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise SweepError(
                EXIT_USAGE,
                f"{db}: not a readable Optuna study ({first}); give a new --study folder",
            ) from None
        # slot index -> (optuna Trial, process)
        self.running: dict[int, tuple[Any, TrialProcess]] = {}
        self.reported: dict[int, set[int]] = {}  # trial number -> steps already reported
        self.stop_signal: int | None = None

    # ---- study -----------------------------------------------------------------------------------

    def _open(self, base_text: str):
        o = self.optuna
        existing = o.study.get_all_study_names(self.storage)
        n_before = (
            len(o.load_study(study_name=STUDY_NAME, storage=self.storage).trials) if existing else 0
        )
        study = o.create_study(
            storage=self.storage,
            study_name=STUDY_NAME,
            load_if_exists=True,
            direction=self.objective.direction,
            pruner=self.space.pruner.build(),
            sampler=self.space.sampler.build(n_before),
        )
        attrs = {
            "space": self.space.canonical(),
            "config": base_text,
            "config_path": self.config_path,
        }
        if not existing:
            for k, v in attrs.items():
                study.set_user_attr(k, v)
            study.set_user_attr("objective", asdict(self.objective))  # for tandem-report
            return study
        for key, what in (("space", "space file"), ("config", "config (with the [fixed] keys)")):
            if study.user_attrs.get(key) != attrs[key]:
                raise SweepError(
                    EXIT_USAGE,
                    f"study folder {self.folder} was started with another {what}; "
                    "rerun with the same files or give a new "
                    "--study folder",
                )
        return study

    def _attr(self, number: int, key: str, value: Any) -> None:
        tid = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        self.storage.set_trial_user_attr(tid, key, value)

    def _logged_steps(self, trial) -> int:
        return max(
            (
                r["step"]
                for r in read_rows(os.path.join(self.folder, trial.user_attrs.get("folder", "")))
            ),
            default=0,
        )

    def _interrupted(self, trial) -> None:
        """Mark a trial (live or frozen) that was cut short as FAIL (interrupted) and enqueue
        its retry."""
        self._attr(trial.number, "interrupted", True)
        self._attr(trial.number, "steps", self._logged_steps(trial))
        self.study.tell(trial.number, state=self.optuna.trial.TrialState.FAIL)
        self.study.enqueue_trial(
            dict(trial.params),
            user_attrs={"retry_of": trial.number, "folder": trial.user_attrs.get("folder")},
        )
        print(
            f"trial {trial.number} interrupted; it will be retried in "
            f"{trial.user_attrs.get('folder')}",
            flush=True,
        )

    def recover(self) -> None:
        """Trials a killed session left RUNNING: wait for their processes, mark them
        interrupted, retry."""
        states = (self.optuna.trial.TrialState.RUNNING,)
        for t in self.study.get_trials(deepcopy=False, states=states):
            pid = t.user_attrs.get("pid")
            if pid and not wait_gone(pid, t.user_attrs.get("pid_ticks"), STOP_WAIT_S):
                raise SweepError(EXIT_BUSY, f"trial {t.number}'s process {pid} would not exit")
            self._interrupted(t)

    def finished(self) -> list:
        s = self.optuna.trial.TrialState
        return [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.state in (s.COMPLETE, s.PRUNED)
            or (t.state == s.FAIL and not t.user_attrs.get("interrupted"))
        ]

    # ---- trials ----------------------------------------------------------------------------------

    def _launch(self, slot: Slot) -> None:
        trial = self.study.ask(self.space.distributions())
        folder_name = trial.user_attrs.get("folder") or f"trial-{trial.number:04d}"
        folder = os.path.join(self.folder, folder_name)
        os.makedirs(folder, exist_ok=True)
        trial.set_user_attr("folder", folder_name)
        try:
            cfg = trial_config(
                self.config_path, self.space, trial.params, [f"job.dump_folder={folder}"]
            )
        except ConfigError as e:
            trial.set_user_attr("error", str(e))
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            raise SweepError(
                EXIT_USAGE,
                f"trial {trial.number}: sampled config is invalid: {e} "
                f"(at {_params(trial.params)}); narrow "
                "the [space]",
            ) from None
        if "retry_of" in trial.user_attrs and self._settle_retry(trial, folder, cfg.training.steps):
            return
        config_path = os.path.join(folder, "config.toml")
        header = f"tandem-sweep trial {trial.number} of {self.folder}: {_params(trial.params)}"
        with open(config_path, "w", encoding="utf-8") as f:
            f.write(format_toml(cfg, header=header))
        cmd = command(config_path, self.ranks)
        proc = TrialProcess(cmd, folder, slot, self.ranks, cfg.training.steps)
        for key, value in (("command", shown(cmd)), ("pid", proc.pid), ("pid_ticks", proc.ticks)):
            trial.set_user_attr(key, value)
        self.running[slot.index] = (trial, proc)
        retry = (
            f", retry of trial {trial.user_attrs['retry_of']}"
            if "retry_of" in trial.user_attrs
            else ""
        )
        print(
            f"trial {trial.number} started ({slot.describe()}{retry}): {_params(trial.params)}\n"
            f"  {shown(cmd)}",
            flush=True,
        )

    def _settle_retry(self, trial, folder: str, steps: int) -> bool:
        """Before a retry starts in its interrupted trial's folder: report the objective values that
        attempt logged up to its checkpoint (the resumed run keeps those rows), and return True if
        the pruner stops it on them (PRUNED, not relaunched). Without a checkpoint the retry starts
        over, so the attempt's per-step logs go (train.py would append to them)."""
        ckpt = latest_checkpoint(folder, self.ckpt_folder)
        if ckpt is None:
            stale = [
                n
                for n in ("metrics.jsonl", "ledger.jsonl", "samples.jsonl")
                if os.path.exists(os.path.join(folder, n))
            ]
            for name in stale:
                os.remove(os.path.join(folder, name))
            if stale:
                print(
                    f"trial {trial.number}: no checkpoint in {folder}; starting over "
                    f"(removed the interrupted attempt's {', '.join(stale)})",
                    flush=True,
                )
            return False
        upto = int(ckpt.split("-")[1])
        # what train.py's resume keeps; the pruner must not see the rest
        rows = keep_rows(folder, upto)
        if self._report(trial, metric_points(rows, self.objective.metric), steps) is None:
            return False
        for key, value in (("checkpoint", ckpt), ("steps", upto)):
            trial.set_user_attr(key, value)
        self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        print(
            f"trial {trial.number} pruned at step {trial.user_attrs['pruned_at']} on what its "
            f"interrupted attempt logged; not relaunched ({ckpt} kept)",
            flush=True,
        )
        return True

    def _report(
        self, trial, points: list[tuple[int, float]], steps: int, may_prune: bool = True
    ) -> int | None:
        """Report new (step, value) points; the step at which the pruner says stop, or None."""
        reported = self.reported.setdefault(trial.number, set())
        for step, value in points:
            if step in reported:  # a resumed trial logs its steps after the checkpoint again
                continue
            reported.add(step)
            trial.report(value, step)
            if may_prune and step < steps and trial.should_prune():
                # the last step's value is final
                trial.set_user_attr("pruned_at", step)
                print(
                    f"trial {trial.number} pruned at step {step} ({self.objective.metric}"
                    f"={value:.4g})",
                    flush=True,
                )
                return step
        return None

    def _watch(self, trial, proc: TrialProcess, may_prune: bool = True) -> None:
        """Report the newly logged objective values; SIGTERM the trial if the pruner says so."""
        if proc.stop_reason is not None:
            return
        points = metric_points(proc.metrics.new_rows(), self.objective.metric)
        if self._report(trial, points, proc.steps, may_prune) is not None:
            print(f"  stopping trial {trial.number} with SIGTERM", flush=True)
            proc.stop("prune")

    def _finish(self, trial, proc: TrialProcess, code: int) -> None:
        """Tell Optuna how a trial that exited ended."""
        state = self.optuna.trial.TrialState
        trial.set_user_attr("exit_status", code)
        trial.set_user_attr("seconds", round(proc.seconds, 1))
        trial.set_user_attr("steps", self._logged_steps(trial))
        ckpt = latest_checkpoint(proc.folder, self.ckpt_folder)
        if ckpt:
            trial.set_user_attr("checkpoint", ckpt)
        o = self.objective
        if proc.stop_reason == "prune":
            self.study.tell(trial, state=state.PRUNED)
            print(
                f"trial {trial.number} pruned: exit {code}, checkpoint {ckpt or 'none'} kept",
                flush=True,
            )
        elif proc.stop_reason == "interrupt" or code == EXIT_INTERRUPTED:
            self._interrupted(trial)
        elif code == 0:
            rows = read_rows(proc.folder)
            value = objective_value(rows, o.metric, o.mode, o.direction)
            if value is None:
                trial.set_user_attr("error", f"objective metric {o.metric!r} not logged")
                self.study.tell(trial, state=state.FAIL)
                raise SweepError(EXIT_METRIC, unknown_metric(o.metric, rows, proc.folder))
            self.study.tell(trial, value)
            print(
                f"trial {trial.number} complete: {o.metric} ({o.mode}) = {value:.4g} in "
                f"{proc.seconds:.0f}s",
                flush=True,
            )
        else:
            trial.set_user_attr("error", last_error(proc.log_path))
            self.study.tell(trial, state=state.FAIL)
            print(
                f"trial {trial.number} failed (exit {code}): {trial.user_attrs['error']}; "
                f"log: {proc.log_path}",
                flush=True,
            )

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> int:
        """Launch into free slots until N trials finished; returns the exit status."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self.recover()
            while True:
                if self.stop_signal is not None:
                    self._stop_all("interrupt")
                    print(
                        f"sweep stopped by signal {self.stop_signal}; rerun the same "
                        "command to resume",
                        flush=True,
                    )
                    return EXIT_INTERRUPTED
                for index, (trial, proc) in list(self.running.items()):
                    self._watch(trial, proc)
                    code = proc.poll()
                    if code is not None:
                        del self.running[index]
                        # rows written just before the exit
                        self._watch(trial, proc, may_prune=False)
                        self._finish(trial, proc, code)
                busy = set(self.running)
                for slot in self.slots:
                    if (
                        slot.index not in busy
                        and len(self.finished()) + len(self.running) < self.target
                    ):
                        self._launch(slot)
                if not self.running and len(self.finished()) >= self.target:
                    break
                time.sleep(POLL_S)
        except SweepError:
            self._stop_all("interrupt")
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        done = self.finished()
        complete = [t for t in done if t.state == self.optuna.trial.TrialState.COMPLETE]
        return EXIT_OK if complete else EXIT_NO_TRIAL

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _stop_all(self, reason: str) -> None:
        """SIGTERM every running trial, wait for its checkpoint, and record how it ended."""
        for _, proc in self.running.values():
            proc.stop(reason)
        for index, (trial, proc) in list(self.running.items()):
            code = proc.wait(STOP_WAIT_S)
            del self.running[index]
            self._finish(trial, proc, code)

    # ---- outputs ---------------------------------------------------------------------------------

    def table(self) -> list[dict[str, Any]]:
        """One row per trial: number, status, objective, parameters, steps, seconds,
        folder, note."""
        rows = []
        for t in self.study.get_trials(deepcopy=False):
            status = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
            a = t.user_attrs
            note = "; ".join(
                x
                for x in (
                    f"retry of {a['retry_of']}" if "retry_of" in a else "",
                    f"pruned at step {a['pruned_at']}" if "pruned_at" in a else "",
                    a.get("error", ""),
                )
                if x
            )
            rows.append(
                {
                    "trial": t.number,
                    "status": status,
                    "objective": t.value,
                    **{k: t.params.get(k) for k in self.space.params},
                    "steps": a.get("steps"),
                    "seconds": a.get("seconds"),
                    "folder": a.get("folder", ""),
                    "note": note,
                }
            )
        return rows

    def write_outputs(self) -> None:
        """trials.csv, the printed table, best.toml; the report is written by the caller."""
        rows = self.table()
        if rows:
            with open(
                os.path.join(self.folder, "trials.csv"), "w", newline="", encoding="utf-8"
            ) as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        print(format_table(rows, self.objective.metric), flush=True)
        done = self.finished()
        counts = {
            s: sum(1 for t in done if t.state.name.lower() == s)
            for s in ("complete", "pruned", "fail")
        }
        retried = sum(1 for r in rows if r["status"] == "interrupted")
        print(
            f"{len(done)} trials finished ({counts['complete']} complete, "
            f"{counts['pruned']} pruned, {counts['fail']} failed); {retried} interrupted and "
            f"retried. Table: {os.path.join(self.folder, 'trials.csv')}",
            flush=True,
        )
        self.write_best()

    def write_best(self) -> str | None:
        complete = [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.state == self.optuna.trial.TrialState.COMPLETE
        ]
        if not complete:
            return None
        best = self.study.best_trial
        path = os.path.join(self.folder, "best.toml")
        cfg = trial_config(
            self.config_path,
            self.space,
            best.params,
            [f"job.dump_folder={os.path.join(self.folder, 'best')}"],
        )
        launch = (
            "python train.py"
            if self.ranks == 1
            else f"torchrun --nproc-per-node {self.ranks} train.py"
        )
        header = (
            f"The best trial of the tandem-sweep study {self.folder}: trial {best.number}, "
            f"{self.objective.metric} ({self.objective.mode}) = {best.value:.6g}"
            f"\n{_params(best.params)}\nRun it again: {launch} --config {path}"
        )
        with open(path, "w", encoding="utf-8") as f:
            f.write(format_toml(cfg, header=header))
        print(
            f"best: trial {best.number}, {self.objective.metric} = {best.value:.4g} "
            f"({_params(best.params)}); config: {path}",
            flush=True,
        )
        return path


def _params(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def unknown_metric(metric: str, rows: list[dict[str, Any]], folder: str) -> str:
    import difflib

    if not rows:
        return (
            f"objective {metric!r}: {folder}/metrics.jsonl has no rows; the trial exited 0 "
            "without logging a step"
        )
    keys = sorted(
        {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    )
    near = difflib.get_close_matches(metric, keys, n=3)
    hint = (
        f"did you mean {', '.join(map(repr, near))}?"
        if near
        else f"logged keys include {', '.join(keys[:12])}"
    )
    return f"unknown metric {metric!r}: not in any row of {folder}/metrics.jsonl; {hint}"


def format_table(rows: list[dict[str, Any]], metric: str) -> str:
    if not rows:
        return "no trials"
    cols = list(rows[0])

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    head = {c: (f"objective ({metric})" if c == "objective" else c) for c in cols}
    widths = {c: max(len(head[c]), *(len(cell(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(head[c].ljust(widths[c]) for c in cols)]
    lines += ["  ".join(cell(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
