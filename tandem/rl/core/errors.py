"""Exit statuses of train.py and the user-facing errors they map to.

Every error a user can cause by their input is one line on stderr naming the
key, file, row or value, and a distinct exit status, never a traceback.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error (a bug): traceback printed
EXIT_CONFIG = 2  # bad config key, value or file
EXIT_DATA = 3  # bad data file or rows
EXIT_MODEL = 4  # model / tokenizer folder that cannot be used as configured
EXIT_SHORT_RUN = 5  # the run ended with fewer steps than asked, or trained a prompt twice
EXIT_HANG = 6  # the watchdog saw no progress: stacks dumped under dump_folder/hang/
# NaN/Inf in the loss or gradients with fault.on_nonfinite = "stop", or in weights about to be
# checkpointed
EXIT_NONFINITE = 7
# checkpoints: none verifies, an earlier run's are in the way of a fresh start, the one to
# resume was written by another model, a file of it is not plain data, or DCP failed to write or
# read one; also a per-step log (metrics/ledger/samples.jsonl) with a bad line not the last
EXIT_CHECKPOINT = 8
# train.py --plan: the configured layout does not fit in device memory (one line says where; the
# plan is printed)
EXIT_PLAN = 9
# split mode: the generators' weights differ from the trainers' after a sync (checksum)
EXIT_WEIGHT_SYNC = 10
# fault.replica_check_steps: data-parallel replicas (HSDP) hold different bits of one parameter
# shard (tandem/rl/fault/replica.py)
EXIT_REPLICA = 11
# rl.max_mismatch_kl: the mean k3 mismatch between the generator's and the update's log-probs
# over the last rl.mismatch_window steps exceeded the limit (tandem/rl/fault/mismatch.py)
EXIT_MISMATCH = 12
EXIT_PREEMPTED = 75  # checkpointed on SIGTERM/SIGUSR1; requeue (EX_TEMPFAIL)
# SIGINT (Ctrl-C): one line, no traceback; committed checkpoints are kept (128 + SIGINT)
EXIT_INTERRUPTED = 130


class StepInterrupted(Exception):
    """A stop signal (SIGTERM/SIGUSR1) ended a wait that only the outside world could end (an
    http rollout waiting for its harness) before the step could finish. Raised on every rank
    at the same point; the shell exits 75 with the last committed checkpoint kept, and the
    step is redone after the resume."""


class NonFiniteError(RuntimeError):
    """NaN/Inf in the loss or a gradient under ``fault.on_nonfinite = "stop"``, or in weights about
    to be checkpointed (EXIT_NONFINITE). ``report`` is the JSON written under ``<dump>/nan/``."""

    def __init__(self, msg: str, report: dict[str, Any]) -> None:
        super().__init__(msg)
        self.report = report


class ReplicaMismatch(RuntimeError):
    """Replicas that must hold equal weights do not (EXIT_REPLICA); the message names the step,
    the tensor and the rank(s)."""


class MismatchError(RuntimeError):
    """The generator and the update disagree more than ``rl.max_mismatch_kl`` allows, on average
    over a window of steps (EXIT_MISMATCH); the message names the step, the mean and the limit."""
