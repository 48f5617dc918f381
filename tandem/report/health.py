"""The report's "Ranks" section: what the rank doctor left in each run's dump folder.

Per run with a health.jsonl (tandem/rl/core/health.py, written by the training shell): a heat
map of every rank's own time per step (phase time minus collective wait; a straggler is a
bright row), with dotted lines at the steps a straggler was named and dashed lines at the
steps a rollback skipped; and one table of the doctor's notes: tandem-diagnose's verdict (its
first line), the straggler lines and the rollbacks. Reads the files as text; no torch.
"""

from __future__ import annotations

import os
from typing import Any

from tandem.diagnose_doctor import jsonl_rows
from tandem.report.page import table
from tandem.report.runs import Run


def heat_map(label: str, rows: list[dict[str, Any]], rollbacks: list[int]) -> dict[str, Any]:
    """One run's ranks x steps of own seconds (a plain Plotly figure dict)."""
    world = max(len(r.get("ranks", [])) for r in rows)
    steps = [r["step"] for r in rows]
    z = [
        [r["ranks"][k]["own_s"] if k < len(r.get("ranks", [])) else None for r in rows]
        for k in range(world)
    ]
    shapes = [
        {"type": "line", "x0": s, "x1": s, "y0": -0.5, "y1": world - 0.5, "line": {"dash": d}}
        for s, d in [(r["step"], "dot") for r in rows if r.get("straggler")]
        + [(s, "dash") for s in rollbacks]
    ]
    return {
        "data": [
            {
                "type": "heatmap",
                "x": steps,
                "y": list(range(world)),
                "z": z,
                "colorscale": "Viridis",
                "colorbar": {"title": {"text": "own s"}},
                "hovertemplate": "step %{x}, rank %{y}: %{z:.3f} s<extra></extra>",
            }
        ],
        "layout": {
            "title": {"text": f"{label}: own time per rank and step", "font": {"size": 14}},
            "xaxis": {"title": {"text": "step"}},
            "yaxis": {"title": {"text": "rank"}, "dtick": 1},
            "margin": {"l": 55, "r": 10, "t": 36, "b": 40},
            "template": "plotly_white",
            "shapes": shapes,
        },
    }


def ranks_section(runs: list[Run], figures: dict[str, Any]) -> list[str]:
    """The section's HTML (empty when no run has a health.jsonl); adds its figures."""
    from tandem.diagnose import diagnose

    divs, notes = [], []
    for i, run in enumerate(runs):
        rows = jsonl_rows(os.path.join(run.folder, "health.jsonl"))
        backs = jsonl_rows(os.path.join(run.folder, "rollback.jsonl"))
        if not rows and not backs:
            continue
        if rows:
            fid = f"fig-ranks-{i}"
            figures[fid] = heat_map(run.label, rows, [b["step"] for b in backs])
            divs.append(f'<div class="fig" id="{fid}"></div>')
        notes.append([run.label, "", diagnose(run.folder)[0][0]])
        notes += [[run.label, r["step"], r["straggler"]] for r in rows if r.get("straggler")]
        notes += [
            [run.label, b["step"], f"rollback to step-{b.get('to')}: {b.get('reason', '')}"]
            for b in backs
        ]
    if not notes:
        return []
    return [
        "<h2>Ranks</h2>",
        '<p class="note">Each rank\'s own time per step (phase time minus the time it waited in '
        "Tandem's collectives; health.jsonl). Dotted lines: a straggler named; dashed: a "
        "rollback's skipped step.</p>",
        '<div class="grid">' + "".join(divs) + "</div>",
        table(["run", "step", "the doctor"], notes, numeric={1}),
    ]
