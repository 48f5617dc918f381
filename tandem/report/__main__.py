"""``tandem-report DUMP [DUMP ...] --out report.html``: see tandem/report/__init__.py.

    tandem-report outputs/quickstart outputs/quickstart-lr1e-4 --out report.html
    tandem-report outputs/sweeps/quickstart --out sweep.html     # a study: its trials side by side

``--metric KEY`` (repeatable) adds a plot of any metrics.jsonl key.
"""

from __future__ import annotations

import argparse
import sys

from tandem.report import EXIT_USAGE, ReportError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise ReportError(EXIT_USAGE, f"{message} (see tandem-report --help)")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="tandem-report", description="One self-contained HTML page of several runs.")
    p.add_argument(
        "paths", nargs="*", metavar="DUMP", help="run dump folders or tandem-sweep study folders"
    )
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        help="also plot this metrics.jsonl key (repeatable)",
    )
    p.add_argument("--title", default=None)
    p.add_argument(
        "--max-sample-steps",
        type=int,
        default=200,
        help="logged steps per run in the sample browser",
    )
    try:
        args = p.parse_args(argv)
        if args.max_sample_steps < 1:
            raise ReportError(
                EXIT_USAGE, f"--max-sample-steps: must be >= 1, got {args.max_sample_steps}"
            )
        from tandem.report.build import build_report

        out = build_report(args.paths, args.out, args.metric, args.title, args.max_sample_steps)
    except ReportError as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.status
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
