"""``tandem-report DUMP [DUMP ...] --out report.html``: one self-contained page of several runs.

    runs.py    what a path holds: a run's dump folder (metrics.jsonl, samples.jsonl)
               or a tandem-sweep study folder (study.db and its trials' dump folders)
    build.py   the page: overlaid plots (Plotly) of the runs' metrics, the sample
               browser, and for a study its trial table and Optuna's plots
    health.py  the "Ranks" section: per-rank own time per step (health.jsonl) as a heat
               map, stragglers and rollbacks marked, and tandem-diagnose's verdict
    page.py    the HTML, CSS and the small script around them
    __main__.py the command line

The page embeds plotly.js and every number it shows, so it opens with no
network. Exit statuses (each error is one line on stderr; the same numbers as
tandem-sweep):

    0   the page was written
    2   bad command line (no path, --out missing, its folder absent, a folder, or
        not writable)
    3   a path is not a run: missing, an empty folder, a folder without
        metrics.jsonl (and no study.db), a metrics.jsonl without rows, a line of
        metrics.jsonl or samples.jsonl that is not JSON or not a row (file:line),
        or a study.db that Optuna cannot read
    4   unknown metric: a --metric key that no run logged
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOT_A_RUN = 3
EXIT_METRIC = 4


class ReportError(Exception):
    """A user-facing error: one line, and the exit status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
