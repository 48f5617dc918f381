"""The HTML around tandem-report's figures: layout, styles, and the script that draws them.

Everything the page needs is inline: plotly.js (from the installed plotly
package), the figures as JSON, the sample log as JSON. Texts from the runs
reach the page only as JSON read by the script and set with ``textContent``,
or through `esc`, so a completion containing markup shows as text.
"""

from __future__ import annotations

import html
import json
from typing import Any

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 auto; max-width: 1400px;
  padding: 0 16px 40px; color: #222; }
h1 { font-size: 22px; margin: 18px 0 4px; }
h2 { font-size: 18px; margin: 26px 0 8px; border-bottom: 1px solid #ddd; }
.note { color: #666; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 8px; }
.fig { height: 340px; border: 1px solid #eee; } .fig.wide { height: 420px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
#sb-body pre { margin: 0; white-space: pre-wrap; word-break: break-word; max-width: 520px; }
.controls { display: flex; gap: 10px; align-items: center; margin: 6px 0; flex-wrap: wrap; }
.fig-box .fig { height: 310px; } .fig-menu { max-width: 100%; height: 28px; }
"""

# Draws every figure in #figures-data into the div of the same id (a figure with a "menu": its
# keys into the <select> "<id>-menu", and the chosen key's traces), then runs the sample browser.
# The step shown first comes from the address (#run=<index>&step=<step>) or is each run's last step.
SCRIPT = """
(function () {
  const figs = JSON.parse(document.getElementById('figures-data').textContent);
  const config = {displaylogo: false, responsive: true};
  function plain(s) {  // Plotly shows entities as text; markup it would render
    return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
  }
  function menuFigure(id, fig) {
    const menu = fig.menu, byKey = new Map();
    menu.series.forEach(s => {
      if (!byKey.has(s[0])) byKey.set(s[0], []);
      byKey.get(s[0]).push(s);
    });
    const sel = document.getElementById(id + '-menu');
    menu.keys.forEach((k, j) => {
      if (!byKey.has(j)) return;
      const o = document.createElement('option');
      o.value = j; o.textContent = k; sel.appendChild(o);
    });
    function draw() {
      const j = Number(sel.value), traces = byKey.get(j).map(([_, i, x, y]) => ({
        type: 'scatter', mode: 'lines', x: x, y: y, name: plain(menu.runs[i].name),
        line: {color: menu.runs[i].color}}));
      const layout = Object.assign({}, fig.layout, {title: Object.assign({}, fig.layout.title,
                                   {text: 'Other metrics: ' + plain(menu.keys[j])})});
      Plotly.react(id, traces, layout, config);
    }
    sel.onchange = draw;
    draw();
  }
  for (const [id, fig] of Object.entries(figs)) {
    if (fig.menu) menuFigure(id, fig); else Plotly.newPlot(id, fig.data, fig.layout, config);
  }
  const data = JSON.parse(document.getElementById('samples-data').textContent);
  const runSel = document.getElementById('sb-run');
  if (!runSel) return;
  const stepIn = document.getElementById('sb-step'), label = document.getElementById('sb-label');
  const body = document.getElementById('sb-body');
  data.runs.forEach((r, i) => {
    const o = document.createElement('option'); o.value = i; o.textContent = r.label;
    runSel.appendChild(o); });
  function fmt(v) {
    return v === null || v === undefined ? 'n/a'
      : (Number.isInteger(v) ? String(v) : v.toPrecision(4));
  }
  function cell(tr, text, cls, pre) {
    const td = document.createElement('td'); if (cls) td.className = cls;
    if (pre) { const p = document.createElement('pre'); p.textContent = text; td.appendChild(p); }
    else td.textContent = text;
    tr.appendChild(td);
  }
  function show() {
    const run = data.runs[Number(runSel.value)], idx = Number(stepIn.value), entry = run.steps[idx];
    label.textContent = 'step ' + entry.step + ' (' + (idx + 1) + ' of ' + run.steps.length
      + ' logged steps)';
    body.replaceChildren();
    entry.samples.forEach((s, i) => {
      const tr = document.createElement('tr');
      cell(tr, String(i), 'num'); cell(tr, s.prompt, '', true); cell(tr, s.completion, '', true);
      cell(tr, fmt(s.reward), 'num');
      cell(tr, Object.entries(s.rewards || {}).map(([k, v]) => k + ' ' + fmt(v)).join(', '));
      cell(tr, fmt(s.advantage), 'num'); cell(tr, s.finish_reason);
      body.appendChild(tr);
    });
  }
  function pick(step) {
    const run = data.runs[Number(runSel.value)];
    stepIn.max = run.steps.length - 1;
    const at = run.steps.findIndex(e => e.step === step);
    stepIn.value = at >= 0 ? at : run.steps.length - 1;
    show();
  }
  runSel.onchange = () => pick(null);
  stepIn.oninput = show;
  document.getElementById('sb-prev').onclick = () => {
    stepIn.value = Math.max(0, Number(stepIn.value) - 1); show(); };
  document.getElementById('sb-next').onclick = () => {
    stepIn.value = Math.min(Number(stepIn.max), Number(stepIn.value) + 1); show(); };
  const want = new URLSearchParams(location.hash.slice(1));
  if (want.has('run') && Number(want.get('run')) < data.runs.length) runSel.value = want.get('run');
  pick(want.has('step') ? Number(want.get('step')) : null);
})();
"""

SAMPLE_BROWSER = """
<div class="controls">
  <label>run <select id="sb-run"></select></label>
  <button id="sb-prev">&larr;</button><input type="range" id="sb-step" min="0" value="0">
  <button id="sb-next">&rarr;</button><span id="sb-label"></span>
</div>
<table id="sb-table"><thead><tr><th>#</th><th>prompt</th><th>completion</th><th>reward</th>
<th>per function</th><th>advantage</th><th>finish</th></tr></thead>
<tbody id="sb-body"></tbody></table>
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def script_json(value: Any) -> str:
    """JSON that is safe inside <script>: every "<" escaped (a completion may contain
    "</script>")."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")


def menu_figure_div(fid: str) -> str:
    """The grid cell of a figure with a key menu (see SCRIPT)."""
    return (
        f'<div class="fig-box"><select class="fig-menu" id="{fid}-menu"></select>'
        f'<div class="fig" id="{fid}"></div></div>'
    )


def table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{esc(c)}</td>' if i in numeric else f"<td>{esc(c)}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(
    title: str,
    sections: list[str],
    figures: dict[str, Any],
    samples: dict[str, Any],
    plotly_js: str,
) -> str:
    """The whole document. ``figures``: div id -> {"data", "layout"}; ``samples``:
    {"runs": [...]}"""
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{esc(title)}</title><style>{CSS}</style>",
            f"<script>{plotly_js}</script></head><body>",
            f"<h1>{esc(title)}</h1>",
            *sections,
            f'<script type="application/json" id="figures-data">{script_json(figures)}</script>',
            f'<script type="application/json" id="samples-data">{script_json(samples)}</script>',
            f"<script>{SCRIPT}</script>",
            "</body></html>",
        ]
    )
