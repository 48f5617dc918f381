"""Hyperparameter search over config keys: ``tandem-sweep`` (Optuna, study in SQLite).

    tandem-sweep --config configs/quickstart.toml --space space.toml --trials 12 --parallel 2

Files, one job each:

    space.py   the search-space file: [space] distributions keyed by config key,
               [fixed] overrides, [objective], [pruner], [sampler]; every check
               that can run before a trial starts
    trial.py   one trial as a process: device/core slots, the train.py command,
               following its metrics.jsonl, stopping it with SIGTERM
    study.py   the loop: ask Optuna, launch, report intermediate values, prune,
               tell; resume of a killed sweep; the table, best.toml and report
    __main__.py the command line

Each trial is an ordinary ``train.py`` run (under torchrun when a trial has
several ranks) in its own dump folder under the study folder, started from its
own ``config.toml`` there, so any trial can be re-run or resumed by hand. The
study lives in ``<study>/study.db``; the same command resumes a killed sweep.

Exit statuses (each error is one line on stderr; tandem-report uses the same numbers):

    0   done: N trials finished (complete, pruned or failed on their own)
    2   bad command line, space file or config; nothing was started. Also a study
        folder made with another config or space, a --study that is a file or whose
        study.db Optuna cannot read, and a space file naming job.dump_folder or
        checkpoint.folder or a config whose checkpoint.folder leaves the trial's
        dump folder (trials would share, and resume, each other's checkpoints)
    4   unknown metric: the objective metric is in no row of a finished trial's
        metrics.jsonl
    5   the study folder is held by another tandem-sweep
    6   the sweep ended without one completed trial
    75  the sweep got SIGTERM/SIGINT: running trials checkpointed and were marked
        interrupted; the same command resumes and retries them
"""

from __future__ import annotations

EXIT_OK = 0
# bad command line, space file or config (nothing was started), or a study made with other files
EXIT_USAGE = 2
# the objective metric is in no row of a finished trial's metrics.jsonl (unknown metric name)
EXIT_METRIC = 4
EXIT_BUSY = 5  # another tandem-sweep holds the study folder
EXIT_NO_TRIAL = 6  # the sweep ended and no trial completed (every one failed or was pruned)
# the sweep got SIGTERM/SIGINT: running trials checkpointed; rerun the same command
EXIT_INTERRUPTED = 75


class SweepError(Exception):
    """A user-facing error: one line, and the exit status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
