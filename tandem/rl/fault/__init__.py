"""Fault handling for the trainer loops: hangs, preemption, NaN/Inf, and what they leave behind.

    watchdog.py  `Watchdog` (phase + heartbeat, stack dumps on a hang, EXIT_HANG)
                 and `enable_flight_recorder` (NCCL flight-recorder variables)
    signals.py   `PreemptionHandler` (SIGTERM/SIGUSR1 -> a stop agreed by all ranks)
    nan.py       `check_finite` / `NonFiniteError` (EXIT_NONFINITE) / `Rollback`
    preflight.py `tandem-diagnose --preflight`: matmul and all-reduce timed per rank
    replica.py   `check_replicas`: HSDP replicas hold the same bits (EXIT_REPLICA)
    mismatch.py  `MismatchGuard`: rl.max_mismatch_kl over a window of steps (EXIT_MISMATCH)
    inject.py    the fault drills (TANDEM_INJECT_*)

Everything a failure leaves is under the job's dump folder (``hang/``,
``nan/``, ``preempt/``, ``flight_recorder/``) and ``tandem-diagnose
DUMP`` summarises it. docs/fault-tolerance.md has the whole story. Nothing
here acts at import time: signal handlers and threads start only when asked.
"""

from tandem.rl.core.errors import EXIT_HANG, EXIT_NONFINITE
from tandem.rl.fault.nan import NonFiniteError, Rollback, check_finite
from tandem.rl.fault.signals import PreemptionHandler
from tandem.rl.fault.watchdog import Watchdog, enable_flight_recorder

__all__ = [
    "EXIT_HANG",
    "EXIT_NONFINITE",
    "NonFiniteError",
    "PreemptionHandler",
    "Rollback",
    "Watchdog",
    "check_finite",
    "enable_flight_recorder",
]
