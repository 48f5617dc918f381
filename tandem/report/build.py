"""Build tandem-report's page: one figure per metric family with every run overlaid, then
the samples.

The panels follow the names the trainers log (metrics.jsonl); a panel appears
when some run logged one of its keys, and every other numeric key is one
entry of the "Other metrics" figure's menu. Each run keeps one colour across
the page; within a panel that plots several keys, the key sets the dash.

Size: the "Other metrics" figure holds each key's points once, and the page's script
builds its menu and draws the chosen key, so the page and this process's memory grow
with the number of points logged, not with the square of the number of keys.
Plotly renders the strings of a figure as HTML of its own (``<a href>``, ``<b>``):
every string here goes through `_plain`, so a metric name or run folder shows as text.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable
from typing import Any

from tandem.report import EXIT_METRIC, EXIT_USAGE, ReportError
from tandem.report.health import ranks_section
from tandem.report.page import SAMPLE_BROWSER, esc, menu_figure_div, page, table
from tandem.report.runs import Run, StudyInfo, load

# (title, which keys, y-axis title)
PANELS: list[tuple[str, Callable[[str], bool], str]] = [
    ("Reward", lambda k: k == "reward/total", "mean reward"),
    (
        "Reward per function",
        lambda k: re.fullmatch(r"reward/(?!total$)[^/]+/mean", k) is not None,
        "mean reward",
    ),
    ("Held-out eval", lambda k: k.startswith(("eval/", "eval_")), ""),
    (
        "Response length (tokens)",
        lambda k: k in ("response/length_mean", "response/length_max"),
        "tokens",
    ),
    ("Entropy", lambda k: k == "entropy", "nats/token"),
    ("KL to the reference", lambda k: k == "kl", ""),
    ("Clip fraction", lambda k: k == "clip_frac", "fraction of tokens"),
    ("Train/generation log-prob gap", lambda k: k.startswith("gap/"), "|logp train - logp gen|"),
    ("Grad norm", lambda k: k == "grad_norm", ""),
    ("Learning rate", lambda k: k == "lr", ""),
    ("Loss", lambda k: k == "loss", ""),
    ("Phase times", lambda k: k.startswith("time/"), "seconds"),
    ("Throughput", lambda k: k.endswith("tokens_per_s"), "tokens/s"),
    ("Peak memory per phase", lambda k: k.startswith("memory/"), "GB"),
]
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
# points per trace drawn as markers too (one SVG element each); more: lines only
MARKERS_UP_TO = 300


def _colors() -> list[str]:
    from plotly.colors import qualitative

    return list(qualitative.Plotly) + list(qualitative.D3)


def line_figure(
    runs: list[Run], keys: list[str], title: str, ytitle: str, colors: list[str]
) -> dict[str, Any] | None:
    """Every run's series of every key in one figure (a plain dict: {"data", "layout"})."""
    traces = []
    for i, run in enumerate(runs):
        for j, key in enumerate(keys):
            steps, values = run.series(key)
            if not steps:
                continue
            traces.append(
                {
                    "type": "scatter",
                    "x": steps,
                    "y": values,
                    "name": run.label if len(keys) == 1 else f"{run.label} · {key}",
                    "legendgroup": str(i),
                    "mode": "lines+markers" if len(steps) <= MARKERS_UP_TO else "lines",
                    "marker": {"size": 4},
                    "line": {
                        "color": colors[i % len(colors)],
                        "dash": DASHES[j % len(DASHES)],
                        "width": 1.5,
                    },
                }
            )
    if not traces:
        return None
    return {"data": traces, "layout": _layout(title, "step", ytitle)}


def _layout(title: str, xtitle: str, ytitle: str) -> dict[str, Any]:
    return {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "margin": {"l": 55, "r": 10, "t": 36, "b": 40},
        "xaxis": {"title": {"text": xtitle}},
        "yaxis": {"title": {"text": ytitle}},
        "template": "plotly_white",
        "legend": {"font": {"size": 10}},
        "hovermode": "closest",
    }


def other_figure(runs: list[Run], keys: list[str], colors: list[str]) -> dict[str, Any] | None:
    """The keys no panel shows, in one figure whose menu (built by the page's script) picks the
    key: ``menu`` holds each key's points once, {"keys", "runs", "series": [[key index, run
    index, steps, values], ...]}, and the script draws the chosen key's traces."""
    series = []
    for j, key in enumerate(keys):
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if steps:
                series.append([j, i, steps, values])
    if not series:
        return None
    names = [{"name": r.label, "color": colors[i % len(colors)]} for i, r in enumerate(runs)]
    menu = {"keys": keys, "runs": names, "series": series}
    return {"layout": _layout("Other metrics", "step", ""), "menu": menu}


def length_histogram(runs: list[Run], colors: list[str]) -> dict[str, Any] | None:
    """Completion lengths over every logged sample of each run (tokens when the records carry
    ``completion_tokens``, else characters)."""
    traces, unit = [], "characters"
    for i, run in enumerate(runs):
        recs = [s for e in run.samples for s in e["samples"]]
        if not recs:
            continue
        if all("completion_tokens" in s for s in recs):
            lengths, unit = [s["completion_tokens"] for s in recs], "tokens"
        else:
            lengths = [len(s.get("completion", "")) for s in recs]
        traces.append(
            {
                "type": "histogram",
                "x": lengths,
                "name": run.label,
                "opacity": 0.6,
                "marker": {"color": colors[i % len(colors)]},
            }
        )
    if not traces:
        return None
    layout = _layout("Response length distribution (logged samples)", unit, "samples")
    layout["barmode"] = "overlay"
    return {"data": traces, "layout": layout}


def staleness_histogram(runs: list[Run], colors: list[str]) -> dict[str, Any] | None:
    """Trained samples by staleness (policy versions between a sample's first token and the
    update that trained it; docs/async.md), summed over each run's logged steps'
    ``async/staleness_<k>`` counts."""
    traces = []
    for i, run in enumerate(runs):
        ks = sorted(
            int(k.rsplit("_", 1)[1]) for k in run.keys() if re.fullmatch(r"async/staleness_\d+", k)
        )
        if not ks:
            continue
        counts = [
            sum(v for v in run.series(f"async/staleness_{k}")[1] if v is not None) for k in ks
        ]
        traces.append(
            {
                "type": "bar",
                "x": ks,
                "y": counts,
                "name": run.label,
                "marker": {"color": colors[i % len(colors)]},
            }
        )
    if not traces:
        return None
    layout = _layout(
        "Staleness of the trained samples (logged steps)", "policy versions behind", "samples"
    )
    layout["barmode"] = "group"
    return {"data": traces, "layout": layout}


def _summary(runs: list[Run]) -> str:
    extra = sorted({k for r in runs for k in r.params})
    rows = []
    for r in runs:
        last = r.rows[-1]
        evals = sorted(k for k in r.keys() if k.startswith(("eval/", "eval_")))
        first_eval = evals[0] if evals else None
        rows.append(
            [
                r.label,
                r.folder,
                last["step"],
                _num(_last(r, "reward/total")),
                f"{first_eval} {_num(_last(r, first_eval))}" if first_eval else "-",
                sum(len(e["samples"]) for e in r.samples),
                *[_num(r.params.get(k)) for k in extra],
            ]
        )
    return table(
        ["run", "folder", "last step", "last reward/total", "last eval", "logged samples", *extra],
        rows,
        numeric={2, 3, 5},
    )


def _last(run: Run, key: str) -> float | None:
    values = run.series(key)[1]
    return values[-1] if values else None


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _study_section(s: StudyInfo, figures: dict[str, Any], n: int) -> str:
    """The trial table and Optuna's plots (history, importance, slice, intermediate values)."""
    import optuna.visualization as vis

    obj = s.objective
    rows = []
    for t in s.study.get_trials(deepcopy=False):
        status = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        note = t.user_attrs.get("error") or (
            f"retry of {t.user_attrs['retry_of']}" if "retry_of" in t.user_attrs else ""
        )
        rows.append(
            [
                t.number,
                status,
                _num(t.value),
                *[_num(t.params.get(k)) for k in s.params],
                t.user_attrs.get("folder", ""),
                t.user_attrs.get("command", ""),
                note,
            ]
        )
    parts = [
        f"<h2>Study {esc(s.label)}</h2>",
        f'<p class="note">{esc(s.folder)}: objective {esc(obj["metric"])} '
        f"({esc(obj['mode'])}, {esc(obj['direction'])}); each trial re-runs with its "
        "command.</p>",
        table(
            ["trial", "status", "objective", *s.params, "folder", "command", "note"],
            rows,
            numeric={0, 2},
        ),
    ]
    plots = [
        ("history", vis.plot_optimization_history),
        ("importance", vis.plot_param_importances),
        ("slice", vis.plot_slice),
        ("intermediate", vis.plot_intermediate_values),
    ]
    divs, missing = [], []
    for name, fn in plots:
        try:
            fig = fn(s.study)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            # e.g. importance needs 2+ completed trials
            missing.append(f"{name}: {e}")
            continue
        fid = f"fig-study{n}-{name}"
        # json: numpy arrays as lists
        figures[fid] = _plain(json.loads(fig.to_json()), keep=_OPTUNA_MARKUP)
        divs.append(f'<div class="fig wide" id="{fid}"></div>')
    parts.append('<div class="grid">' + "".join(divs) + "</div>")
    if missing:
        parts.append(f'<p class="note">Not drawn: {esc("; ".join(missing))}</p>')
    return "\n".join(parts)


_OPTUNA_MARKUP = ("<br>", "<extra></extra>")  # what Optuna's plots put around the study's strings


def _plain(value: Any, keep: tuple[str, ...] = ()) -> Any:
    """``value`` (a figure) with every string's ``&``, ``<`` and ``>`` as entities, which Plotly
    shows as text; ``keep`` are markup tokens put back (Optuna's line breaks)."""
    if isinstance(value, str):
        text = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for token in keep:
            text = text.replace(_plain(token), token)
        return text
    if isinstance(value, list):
        return [_plain(v, keep) for v in value]
    if isinstance(value, dict):
        return {k: (v if k == "menu" else _plain(v, keep)) for k, v in value.items()}
    return value


def _check_metrics(runs: list[Run], metrics: list[str]) -> None:
    known = set().union(*(r.keys() for r in runs)) if runs else set()
    for m in metrics:
        if m not in known:
            near = difflib.get_close_matches(m, sorted(known), n=3)
            hint = (
                f"did you mean {', '.join(map(repr, near))}?"
                if near
                else f"{len(known)} keys were logged"
            )
            raise ReportError(EXIT_METRIC, f"--metric {m!r}: no run logged it; {hint}")


def build_report(
    paths: list[str],
    out: str,
    metrics: list[str] = (),
    title: str | None = None,
    max_sample_steps: int = 200,
) -> str:
    """Write the page for ``paths`` (run or study folders) to ``out``; returns ``out``."""
    if not paths:
        raise ReportError(EXIT_USAGE, "give at least one run or study folder")
    out_dir = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ReportError(EXIT_USAGE, f"--out {out}: a folder; give the HTML file's path")
    if not os.path.isdir(out_dir):
        raise ReportError(EXIT_USAGE, f"--out {out}: folder {out_dir} does not exist")
    runs, studies = load(paths)
    _check_metrics(runs, list(metrics))
    from plotly.offline import get_plotlyjs

    colors, figures, sections = _colors(), {}, []
    title = title or "Tandem report: " + ", ".join(
        os.path.basename(os.path.normpath(p)) or p for p in paths
    )
    if runs:
        sections += ["<h2>Runs</h2>", _summary(runs)]
    for n, s in enumerate(studies):
        sections.append(_study_section(s, figures, n))
    keys = sorted(set().union(*(r.keys() for r in runs))) if runs else []
    panels = [(t, [k for k in keys if pick(k)], y) for t, pick, y in PANELS]
    panels += [(m, [m], "") for m in metrics]
    divs, used = [], set()
    for name, pk, ytitle in panels:
        used.update(pk)
        fig = line_figure(runs, pk, name, ytitle, colors) if pk else None
        fid = "fig-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")  # e.g. fig-held-out-eval
        if fig and fid not in figures:
            figures[fid] = _plain(fig)
            divs.append(f'<div class="fig" id="{fid}"></div>')
    for fid, fig in (
        ("fig-length-distribution", length_histogram(runs, colors)),
        ("fig-staleness", staleness_histogram(runs, colors)),
        ("fig-other", other_figure(runs, [k for k in keys if k not in used], colors)),
    ):
        if fig:
            figures[fid] = _plain(fig)
            plain_div = f'<div class="fig" id="{fid}"></div>'
            divs.append(menu_figure_div(fid) if "menu" in fig else plain_div)
    if divs:
        sections += ["<h2>Metrics</h2>", '<div class="grid">' + "".join(divs) + "</div>"]
    sections += ranks_section(runs, figures)  # health.jsonl / rollback.jsonl, when there are
    sample_runs = [
        {"label": r.label, "steps": r.samples[-max_sample_steps:]} for r in runs if r.samples
    ]
    sections.append("<h2>Samples</h2>")
    if sample_runs:
        cut = [r.label for r in runs if len(r.samples) > max_sample_steps]
        note = f" (the last {max_sample_steps} logged steps of {', '.join(cut)})" if cut else ""
        sections += [
            '<p class="note">Per step, the logged prompts and completions with their '
            "rewards and "
            f"advantages (metrics.samples_per_step per step){esc(note)}.</p>",
            SAMPLE_BROWSER,
        ]
    else:
        sections.append(
            '<p class="note">No run has a samples.jsonl (metrics.samples_per_step).</p>'
        )
    text = page(title, sections, figures, {"runs": sample_runs}, get_plotlyjs())
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:  # a folder that refuses files (/proc), no space, no permission
        why = e.strerror or str(e)
        raise ReportError(EXIT_USAGE, f"--out {out}: cannot be written ({why})") from None
    return out
