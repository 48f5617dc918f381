"""``tandem-sweep``: search config keys with Optuna; see tandem/sweep/__init__.py for the design.

    tandem-sweep --config configs/quickstart.toml --space space.toml --trials 12 \\
        [--parallel K] [--study DIR] [--nproc-per-trial R]

At the end: the trial table (printed and ``<study>/trials.csv``), the best
config as ``<study>/best.toml`` (``train.py --config`` runs it as-is) and
``<study>/report.html`` (tandem-report of the study: the trials side by side and
Optuna's plots). Exit statuses are listed in tandem/sweep/__init__.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from tandem.sweep import EXIT_NO_TRIAL, EXIT_OK, EXIT_USAGE, SweepError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise SweepError(EXIT_USAGE, f"{message} (see tandem-sweep --help)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="tandem-sweep", description="Hyperparameter search over train.py config keys.")
    p.add_argument("--config", required=True, help="the train.py config every trial starts from")
    p.add_argument(
        "--space", required=True, help="the search-space TOML ([space], [fixed], [objective], ...)"
    )
    p.add_argument(
        "--trials", type=int, required=True, help="finished trials the study should end with"
    )
    p.add_argument(
        "--parallel", type=int, default=1, help="trials at once, on disjoint CPU cores / GPUs"
    )
    p.add_argument(
        "--study", default=None, help="study folder (default: outputs/sweeps/<config name>)"
    )
    p.add_argument(
        "--nproc-per-trial",
        type=int,
        default=0,
        help="ranks per trial, launched with torchrun when > 1 (default: what the "
        "config's mesh asks)",
    )
    args = p.parse_args(argv)
    for name in ("trials", "parallel"):
        if getattr(args, name) < 1:
            raise SweepError(EXIT_USAGE, f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.nproc_per_trial < 0:
        raise SweepError(EXIT_USAGE, f"--nproc-per-trial: must be >= 1, got {args.nproc_per_trial}")
    if args.study is None:
        args.study = os.path.join(
            "outputs", "sweeps", os.path.splitext(os.path.basename(args.config))[0]
        )
    if os.path.exists(args.study) and not os.path.isdir(args.study):
        raise SweepError(EXIT_USAGE, f"--study {args.study}: a file; give a study folder")
    return args


def run(argv: list[str] | None = None) -> int:
    from tandem.sweep.space import check_configs, load_space, resolve_objective
    from tandem.sweep.study import Sweep, lock_study
    from tandem.sweep.trial import plan_slots, ranks_wanted, visible_gpus

    args = parse(argv)
    space = load_space(args.space)
    base = check_configs(args.config, space, args.space)  # every check that needs no trial
    objective = resolve_objective(space, base.training.recipe, args.space)
    ranks = args.nproc_per_trial or ranks_wanted(base.parallel)
    slots = plan_slots(args.parallel, ranks, sorted(os.sched_getaffinity(0)), visible_gpus())
    lock = lock_study(args.study)
    try:
        sweep = Sweep(args.study, args.config, space, objective, base, args.trials, slots, ranks)
        print(
            f"study {args.study}: {len(sweep.finished())} of {args.trials} trials "
            f"finished so far; objective {objective.metric} ({objective.mode}, "
            f"{objective.direction})",
            flush=True,
        )
        status = sweep.run()
        if status in (EXIT_OK, EXIT_NO_TRIAL):  # the end of a sweep: table, best.toml, report
            sweep.write_outputs()
            write_report(args.study)
        return status
    finally:
        lock.close()


def write_report(study: str) -> None:
    from tandem.report import ReportError
    from tandem.report.build import build_report

    out = os.path.join(study, "report.html")
    try:
        build_report([study], out)
        print(f"report: {out}", flush=True)
    except ReportError as e:
        print(f"report not written: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except SweepError as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.status


if __name__ == "__main__":
    sys.exit(main())
