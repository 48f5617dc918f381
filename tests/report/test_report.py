"""tandem-report: the page's contents, its bad inputs, and the page itself in a real
headless browser."""

import html
import json
import os
import re
import sys

import pytest

from tandem.report.__main__ import main as report_main
from tandem.rl.core.samples import SampleLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import report_screenshot  # noqa: E402  (scripts/ is not a package)

from bench.report_size import measure  # noqa: E402

KNOWN = 'The answer is </script><!-- <42> & "done"'  # markup in a completion must show as text


def _run(folder, steps, evals, lr):
    """A dump folder as the RL recipe writes it: metrics rows, and a sample log with KNOWN
    at step 6."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            row = {
                "step": s,
                "reward/total": s / 10,
                "reward/exact_match/mean": s / 10,
                "entropy": 1 / s,
                "lr": lr,
                "kl": 0.01 * s,
                "clip_frac": 0.0,
                "grad_norm": 2.0,
                "gap/abs_mean": 1e-7,
                "loss": 0.1,
                "response/length_mean": 3.0,
                "response/length_max": 5.0,
                "time/rollout_s": 0.1,
                "update/tokens_per_s": 900.0,
                "memory/update_peak_gb": 0.5,
                "dynamic/rounds": 1.0,
            }
            if s in evals:
                row["eval/accuracy"] = 0.5 + s / 100
            f.write(json.dumps(row) + "\n")
    log = SampleLog(folder, per_step=3, enabled=True)
    for s in range(1, steps + 1):
        log.log(
            s,
            [
                {
                    "prompt": f"{s}+{i}=",
                    "completion": KNOWN if (s, i) == (6, 2) else f"{s + i}!",
                    "reward": float(i % 2),
                    "rewards": {"exact_match": float(i % 2)},
                    "advantage": i - 1.0,
                    "finish_reason": "stop",
                }
                for i in range(3)
            ],
        )


@pytest.fixture
def two_runs(tmp_path):
    _run(str(tmp_path / "alpha"), 9, (3, 6, 9), 3e-4)
    _run(str(tmp_path / "beta"), 6, (3, 6), 1e-3)
    return tmp_path


def _figures(page: str) -> dict:
    blob = re.search(
        r'<script type="application/json" id="figures-data">(.*?)</script>', page, re.S
    ).group(1)
    return json.loads(blob)


def test_page_holds_every_run_and_panel(two_runs, capsys):
    out = two_runs / "r.html"
    assert report_main([str(two_runs / "alpha"), str(two_runs / "beta"), "--out", str(out)]) == 0
    page = out.read_text()
    figs = _figures(page)
    ev = figs["fig-held-out-eval"]["data"]
    assert [(t["name"], t["x"], t["y"]) for t in ev] == [
        ("alpha", [3, 6, 9], [0.53, 0.56, 0.59]),
        ("beta", [3, 6], [0.53, 0.56]),
    ]
    for fid in (
        "fig-reward",
        "fig-reward-per-function",
        "fig-response-length-tokens",
        "fig-entropy",
        "fig-kl-to-the-reference",
        "fig-clip-fraction",
        "fig-train-generation-log-prob-gap",
        "fig-grad-norm",
        "fig-learning-rate",
        "fig-loss",
        "fig-phase-times",
        "fig-throughput",
        "fig-peak-memory-per-phase",
        "fig-length-distribution",
        "fig-other",
    ):
        assert fid in figs and f'id="{fid}"' in page, fid
    assert figs["fig-learning-rate"]["data"][1]["y"] == [1e-3] * 6
    menu = figs["fig-other"]["menu"]  # dynamic/rounds, in the menu the page's script builds
    assert menu["keys"] == ["dynamic/rounds"] and [r["name"] for r in menu["runs"]] == [
        "alpha",
        "beta",
    ]
    assert [(j, i, x, y) for j, i, x, y in menu["series"]] == [
        (0, 0, list(range(1, 10)), [1.0] * 9),
        (0, 1, list(range(1, 7)), [1.0] * 6),
    ]
    # self-contained: no script, style sheet or image is fetched
    assert not re.search(r"<(script|img|iframe)[^>]+src=", page) and not re.search(
        r"<link[^>]+href=", page
    )
    # the sample text is JSON inside a script, "<" escaped, never raw markup
    assert KNOWN not in page
    assert 'The answer is \\u003c/script>\\u003c!-- \\u003c42> & \\"done\\"' in page


def test_metric_option_adds_a_panel(two_runs):
    out = two_runs / "r.html"
    assert (
        report_main([str(two_runs / "alpha"), "--metric", "dynamic/rounds", "--out", str(out)]) == 0
    )
    assert _figures(out.read_text())["fig-dynamic-rounds"]["data"][0]["y"] == [1.0] * 9


ROW = json.dumps({"step": 1, "loss": 1.0}) + "\n"
BAD_FILES = {  # case -> (file, its text, the message after "error: <folder>/<file>")
    "metrics_not_json": (
        "metrics.jsonl",
        ROW + "not json\n" + ROW,
        ":2: not JSON (Expecting value",
    ),
    "metrics_deep": (
        "metrics.jsonl",
        "[" * 100_000 + "]" * 100_000 + "\n",
        ":1: JSON nested too deeply",
    ),
    "metrics_no_step": (
        "metrics.jsonl",
        ROW + '{"step": true}\n',
        ':2: not a metrics row (a JSON object with an integer "step")',
    ),
    "samples_not_json": ("samples.jsonl", "garbage\n", ":1: not JSON (Expecting value"),
    "samples_shape": (
        "samples.jsonl",
        '{"step": 1, "samples": [{"completion": 3}]}\n',
        ':1: not a samples step (a JSON object with an integer "step" and a '
        'list "samples" of objects)',
    ),
    "study_garbage": ("study.db", "not a database " * 100, ": not a readable Optuna study ("),
}


@pytest.mark.parametrize(
    "case, status, message",
    [
        ("empty", 3, "an empty folder: not a run's dump folder nor a tandem-sweep study"),
        ("missing", 3, "no such folder"),
        ("no_metrics", 3, "no metrics.jsonl and no study.db"),
        (
            "unknown_metric",
            4,
            "--metric 'eval/acc': no run logged it; did you mean 'eval/accuracy'?",
        ),
        ("no_paths", 2, "give at least one run or study folder"),
        ("out_folder", 2, "r.html: a folder; give the HTML file's path"),
        (
            "out_proc",
            2,
            "--out /proc/tandem-report.html: cannot be written (No such file or directory)",
        ),
        *[(case, 3, message) for case, (_, _, message) in BAD_FILES.items()],
    ],
)
def test_bad_inputs_one_line_and_status(two_runs, capsys, case, status, message):
    (two_runs / "empty").mkdir()
    (two_runs / "no_metrics").mkdir()
    (two_runs / "no_metrics" / "train.log").write_text("x")
    args = {
        "empty": [str(two_runs / "empty")],
        "missing": [str(two_runs / "nope")],
        "no_metrics": [str(two_runs / "no_metrics")],
        "no_paths": [],
        "unknown_metric": [str(two_runs / "alpha"), "--metric", "eval/acc"],
    }.get(case, [])
    out = two_runs / "r.html"
    if case == "out_folder":
        out.mkdir()
    if case == "out_proc":
        out = "/proc/tandem-report.html"
    if case in ("out_folder", "out_proc"):
        args = [str(two_runs / "alpha")]
    if case in BAD_FILES:
        name, text, _ = BAD_FILES[case]
        folder = two_runs / case
        folder.mkdir()
        (folder / ("metrics.jsonl" if name != "metrics.jsonl" else "x")).write_text(ROW)
        (folder / name).write_text(text)
        args, message = [str(folder)], f"{folder / name}{message}"
    assert report_main([*args, "--out", str(out)]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (two_runs / "r.html").is_file()


MARKUP_KEY = 'custom/<a href="https://evil.example/">click</a>'


def test_metric_names_and_run_names_are_text_in_plotly(tmp_path):
    """Plotly renders its strings as HTML of its own: a metric or folder name with markup must
    reach it escaped (in the figures, and in the menu's key when the page's script draws it)."""
    run = tmp_path / "<i>run"
    run.mkdir()
    rows = [{"step": s, "eval/<b>acc</b>": 0.5, MARKUP_KEY: 1.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.html"
    assert report_main([str(run), "--metric", "eval/<b>acc</b>", "--out", str(out)]) == 0
    figs = _figures(out.read_text())
    assert figs["fig-held-out-eval"]["data"][0]["name"] == "&lt;i&gt;run"
    assert figs["fig-eval-b-acc-b"]["layout"]["title"]["text"] == "eval/&lt;b&gt;acc&lt;/b&gt;"
    assert figs["fig-other"]["menu"]["keys"] == [MARKUP_KEY]  # raw: the script sets it as text
    if report_screenshot.find_chromium() is None:
        pytest.skip(
            "Chromium is not installed (Debian: apt-get install chromium); the page was not opened"
        )
    dom, console = report_screenshot.dump_dom(str(out))
    assert console == [], console
    assert not re.search(r"<a\b[^>]*evil\.example", dom)  # no live link anywhere
    assert re.search(
        r">Other metrics: custom/&lt;a "
        r'href="https://evil.example/"&gt;click&lt;/a&gt;</text>',
        dom,
    )  # the menu's figure title, drawn by the script
    assert re.search(r">eval/&lt;b&gt;acc&lt;/b&gt;</text>", dom)  # the --metric panel's title
    # no <b>, <i> drawn
    assert not re.search(r"<tspan[^>]*font-(weight:\s*bold|style:\s*italic)", dom)


def test_page_and_memory_grow_linearly_in_the_number_of_keys(tmp_path):
    """2,000 and 20,000 keys over 3 steps, tandem-report in a process of its own capped at 3 GB
    (bench/report_size.py; before: a 33 MB page at 2,000 keys, and over 3 GB at 20,000)."""
    from plotly.offline import get_plotlyjs

    base = len(get_plotlyjs())
    (page2, rss2), (page20, rss20) = measure(2_000, str(tmp_path)), measure(20_000, str(tmp_path))
    per_key = (page20 - page2) / 18_000  # 3 points a key
    assert 20 < per_key < 150, (page2, page20)
    assert page2 - base < 2_000 * 150, page2
    assert rss20 - rss2 < 150 << 20 and rss20 < 400 << 20, (rss2, rss20)


def _points_per_trace(dom: str, fig_id: str) -> list[int]:
    """Marker elements Plotly drew in each trace of the figure div ``fig_id``."""
    start = dom.index(f'id="{fig_id}"')
    nxt = re.compile(r'<div class="fig[^"]*" id=').search(dom, start + 1)
    chunk = dom[start : nxt.start() if nxt else len(dom)]
    traces = re.split(r'<g class="trace scatter', chunk)[1:]
    return [len(re.findall(r'<path class="point"', t)) for t in traces]


def test_page_renders_in_headless_chromium(two_runs, tmp_path):
    if report_screenshot.find_chromium() is None:
        pytest.skip(
            "Chromium is not installed (Debian: apt-get install chromium); the page was not opened"
        )
    out = two_runs / "r.html"
    assert report_main([str(two_runs / "alpha"), str(two_runs / "beta"), "--out", str(out)]) == 0
    dom, console = report_screenshot.dump_dom(str(out), fragment="run=0&step=6")
    assert console == [], console  # no errors, no uncaught exceptions, nothing logged
    assert 'class="main-svg"' in dom  # Plotly drew
    assert _points_per_trace(dom, "fig-held-out-eval") == [3, 2]
    assert _points_per_trace(dom, "fig-reward") == [9, 6]
    assert _points_per_trace(dom, "fig-response-length-tokens") == [9, 9, 6, 6]
    table = re.search(r'<tbody id="sb-body">(.*?)</tbody>', dom, re.S).group(1)
    cells = [
        html.unescape(re.sub(r"<[^>]+>", "", c))
        for c in re.findall(r"<td[^>]*>(.*?)</td>", table, re.S)
    ]
    assert cells[:7] == ["0", "6+0=", "6!", "0", "exact_match 0", "-1", "stop"]
    assert KNOWN in cells and cells[cells.index(KNOWN) - 1] == "6+2="
    shot = tmp_path / "report.png"
    assert report_screenshot.screenshot(str(out), str(shot), 1200, 1400) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_staleness_histogram_of_an_asynchronous_run(tmp_path):
    """An asynchronous run's ``async/staleness_<k>`` counts, summed over its logged steps, as bars
    (a synchronous run has none and adds no trace)."""
    _run(str(tmp_path / "sync"), 3, (), 3e-4)
    folder = tmp_path / "async"
    os.makedirs(folder)
    counts = [(128, 0, 0), (80, 48, 0), (60, 50, 18)]
    with open(folder / "metrics.jsonl", "w") as f:
        for s, (c0, c1, c2) in enumerate(counts, 1):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "reward/total": 0.5,
                        "async/staleness_0": c0,
                        "async/staleness_1": c1,
                        "async/staleness_2": c2,
                    }
                )
                + "\n"
            )
    out = tmp_path / "r.html"
    assert report_main([str(tmp_path / "sync"), str(folder), "--out", str(out)]) == 0
    fig = _figures(out.read_text())["fig-staleness"]
    assert [(t["name"], t["x"], t["y"]) for t in fig["data"]] == [
        ("async", [0, 1, 2], [268, 98, 18])
    ]
