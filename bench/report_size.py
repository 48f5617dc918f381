"""tandem-report's page size and peak memory against the number of metric keys.

    python -m bench.report_size                  # 2,000 and 20,000 keys
    python -m bench.report_size --keys 2000 20000 50000

Each size is a run logging ``keys`` metrics (``custom/kNNNNN``, none in a named panel, so
all in the "Other metrics" menu) over 3 steps; ``tandem-report`` runs in a process of its
own, capped at 3 GB of address space, and reports its peak RSS. "data MB" is the page
less the plotly.js it embeds. The ratio column is each size over the first, like for
like: linear growth gives the ratio of the keys for data, far less for memory.
tests/report/test_report.py uses `measure`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The peak is VmHWM, this process's own high-water mark: ru_maxrss would also count the
# parent's pages when the child was forked from a big process (pytest with torch loaded).
_CHILD = (
    "import re, resource, sys\nfrom tandem.report.__main__ import main\n"
    "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
    "status = main(sys.argv[1:])\n"
    "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    "sys.exit(status)\n"
)


def measure(keys: int, folder: str) -> tuple[int, int]:
    """(page bytes, peak RSS bytes of the tandem-report process) for ``keys`` keys over 3 steps,
    written under ``folder``; RuntimeError with its stderr when the report fails."""
    run = os.path.join(folder, f"k{keys}")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for s in (1, 2, 3):
            row = {
                "step": s,
                "loss": 1 / s,
                **{f"custom/k{i:05d}": i * s * 1e-3 for i in range(keys)},
            }
            f.write(json.dumps(row) + "\n")
    out = os.path.join(folder, f"k{keys}.html")
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, run, "--out", out],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=600,
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"tandem-report at {keys} keys exited {r.returncode}: {r.stderr[-1000:]}"
        )
    return os.path.getsize(out), int(r.stdout.split()[-1]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, nargs="+", default=[2_000, 20_000])
    p.add_argument("--smoke", action="store_true", help="200 and 2,000 keys")
    args = p.parse_args()
    if args.smoke:
        args.keys = [200, 2_000]
    from bench.header import print_header

    print_header("bench.report_size")
    from plotly.offline import get_plotlyjs

    base = len(get_plotlyjs())
    print(f"{'keys':>8} {'page MB':>8} {'data MB':>8} {'peak MB':>8} {'data x':>7} {'peak x':>7}")
    first = None
    with tempfile.TemporaryDirectory(prefix="report-size-") as tmp:
        for keys in args.keys:
            page, rss = measure(keys, tmp)
            first = first or (page - base, rss)
            print(
                f"{keys:>8} {page / 1e6:>8.2f} {(page - base) / 1e6:>8.2f} {rss / 2**20:>8.0f} "
                f"{(page - base) / first[0]:>7.1f} {rss / first[1]:>7.2f}"
            )


if __name__ == "__main__":
    main()
