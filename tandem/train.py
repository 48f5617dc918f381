"""Tandem entry point: config -> distributed init -> the recipe's trainer loop.

The repository's ``train.py`` runs ``cli()``; so does ``python -m tandem.train`` where only
the installed package is at hand (``tandem-sweep`` launches its trials that way).

    python train.py --config configs/quickstart.toml [--section.key=value ...]
    python train.py --config configs/grpo.toml --plan [--plan.nodes=N --plan.devices_per_node=G]
    torchrun --nproc-per-node 8 train.py --config configs/grpo.toml

Exit statuses are listed in tandem/rl/core/errors.py and the README.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tandem.rl.core import errors


class _KeepUsr1:
    """SIGUSR1 ("stop soon": Slurm's time-limit warning, forwarded by torchrun) outside
    the training loop is kept, not fatal. Installed first thing, it covers the seconds of
    start-up (imports, model, resume): the loop's PreemptionHandler adopts a kept signal
    (``received_at``) and stops after the first step. After the loop it is back in place,
    so the final export finishes."""

    def __init__(self) -> None:
        self.received_at: float | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.received_at = self.received_at or time.time()
        os.write(
            2, f"[pid {os.getpid()}] SIGUSR1 outside the training loop: kept, not fatal\n".encode()
        )


def _fail(status: int, msg: str) -> int:
    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    from tandem.rl.config.schema import ConfigError, parse_args

    try:
        cfg, cli = parse_args(argv)  # --print-config / --help print and exit here
        if cli.plan:
            from tandem.rl.plan.cli import run_plan

            return run_plan(cfg)  # one process, nothing allocated: no launcher, GPU or weights
    except ConfigError as e:
        return _fail(errors.EXIT_CONFIG, str(e))

    from tandem.rl.core.system import tune_host_allocator

    tune_host_allocator()  # before torch allocates: MB-sized CPU temporaries stay on the heap
    import torch

    from tandem import device as seam
    from tandem.parallel.distributed import destroy_distributed, init_distributed
    from tandem.parallel.split import BridgeMismatch
    from tandem.rl.core.checkpoint import CheckpointError
    from tandem.rl.core.metrics import StepLogError
    from tandem.rl.core.modeling import ModelSetupError
    from tandem.rl.data.loading import DataError
    from tandem.rl.fault import NonFiniteError, enable_flight_recorder
    from tandem.rl.recipes import run, unused_settings

    if cfg.fault.flight_recorder and seam.capabilities(seam.accelerator_type()).flight_recorder:
        # NCCL only: on gloo the recorder's entries can outlive the interpreter
        # and abort the process at exit (seen once in CI on a 2-rank CPU run).
        enable_flight_recorder(cfg.job.dump_folder)
    info = init_distributed()
    if info.is_main:
        for key in unused_settings(cfg):
            print(
                f"warning: {key} is set but the {cfg.training.recipe!r} recipe does not read it",
                flush=True,
            )
    status = None
    try:
        status = run(cfg, info)
        return status
    except ConfigError as e:  # checks that need the world size or the model
        return _fail(errors.EXIT_CONFIG, str(e))
    except DataError as e:
        return _fail(errors.EXIT_DATA, str(e))
    except ModelSetupError as e:
        return _fail(errors.EXIT_MODEL, str(e))
    except NonFiniteError as e:
        return _fail(errors.EXIT_NONFINITE, str(e))
    except (CheckpointError, StepLogError) as e:
        return _fail(e.exit_status, str(e))
    except BridgeMismatch as e:
        return _fail(errors.EXIT_WEIGHT_SYNC, str(e))
    except errors.ReplicaMismatch as e:
        return _fail(errors.EXIT_REPLICA, str(e))
    except errors.MismatchError as e:
        return _fail(errors.EXIT_MISMATCH, str(e))
    except KeyboardInterrupt:
        return _fail(
            errors.EXIT_INTERRUPTED,
            "interrupted (SIGINT); the checkpoints committed so far are kept",
        )
    finally:
        destroy_distributed(barrier=status == 0)


def cli() -> None:
    signal.signal(signal.SIGUSR1, _KeepUsr1())  # before the slow imports
    from torch.distributed.elastic.multiprocessing.errors import (
        record,  # torchrun error files for tandem-diagnose
    )

    sys.exit(record(main)())


if __name__ == "__main__":
    cli()
