"""What happened to a run: ``tandem-diagnose DUMP_FOLDER``.

Reads what the trainer and tandem.rl.fault leave in the dump folder and prints what
failed, where (rank, phase, step, innermost frames) and when:

    hang/rank-<r>.json       watchdog dumps (tandem/rl/fault/watchdog.py)
    nan/rank-<r>.json        NaN/Inf reports (tandem/rl/fault/nan.py)
    replica/rank-<r>.json    replica-check mismatches (tandem/rl/fault/replica.py)
    preempt/rank-<r>.json    agreed preemption stops (tandem/rl/fault/signals.py)
    checkpoints/step-N/      committed (COMMITTED marker) and *.partial saves
    **/error.json            torchrun error files (TORCHELASTIC_ERROR_FILE)
    metrics.jsonl            the last steps logged
    health.jsonl             every rank's phase times per step, and straggler lines
    rollback.jsonl           rollbacks of fault.on_nonfinite = "rollback"
    flight_recorder/         NCCL flight-recorder dumps, if any

Its first line is one verdict: for a hang, which rank did not reach which collective of which
step and phase, on which host, and where it is (tandem/diagnose_doctor.py).

Exit status 0 when nothing failed (a preemption that left a checkpoint is not
a failure), 1 when something did, 2 when the folder does not exist. A failure is reported as
*earlier* and does not set the status when the run later logged steps past it (a torchrun
restart or a requeue recovered). It imports no torch, so it runs in well under
a second on a login node; the checkpoint layout it reads is tandem/rl/core/checkpoint.py's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from tandem.diagnose_doctor import hang_verdict, jsonl_rows, stragglers

_RANK_FILE = re.compile(r"^rank-(\d+)\.json$")
_STEP_DIR = re.compile(r"^step-(\d+)(\.partial)?$")
MARKER = "COMMITTED"  # tandem/rl/core/checkpoint.py
TOP_FRAMES = 4


@dataclass
class Finding:
    kind: str  # hang | nan | preempt | error | checkpoint
    failed: bool
    summary: str
    when: float | None = None
    step: int | None = None
    details: list[str] = field(default_factory=list)
    earlier: bool = False  # the run progressed past it
    verdict: str | None = None  # the doctor's one line (tandem/diagnose_doctor.py)


def _when(t: float | None) -> str:
    if t is None:
        return "unknown time"
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(sep=" ", timespec="seconds")


def _rank_records(folder: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        m = _RANK_FILE.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out[int(m.group(1))] = json.load(f)
        except (OSError, ValueError) as e:
            out[int(m.group(1))] = {"_unreadable": str(e)}
    return out


def _short(path: str) -> str:
    for marker in (os.getcwd() + "/", "site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _frames_line(frames: list[dict[str, Any]]) -> str:
    inner = list(reversed(frames))[:TOP_FRAMES]  # innermost first
    return (
        " <- ".join(f"{f['function']} ({_short(f['file'])}:{f['line']})" for f in inner)
        or "(no frames)"
    )


def _in_collective(frames: list[dict[str, Any]]) -> bool:
    return any("torch/distributed" in f["file"] for f in frames[-TOP_FRAMES:])


def read_hangs(dump: str) -> list[Finding]:
    recs = _rank_records(os.path.join(dump, "hang"))
    if not recs:
        return []
    good = {r: v for r, v in recs.items() if "_unreadable" not in v}
    details, culprits = [], []
    for rank, rec in sorted(good.items()):
        trainer = next((t for t in rec.get("threads", []) if t.get("trainer")), None)
        frames = trainer["frames"] if trainer else []
        if frames and not _in_collective(frames):
            culprits.append(rank)
        details.append(
            f"rank {rank} ({rec.get('host', '?')}, phase '{rec.get('phase')}', step "
            f"{rec.get('last_step')}, {_when(rec.get('time'))}): {_frames_line(frames)}"
        )
    details += [
        f"rank {r}: unreadable dump ({v['_unreadable']})" for r, v in recs.items() if r not in good
    ]
    waiting = [r for r in good if r not in culprits]
    if culprits and waiting:
        details.append(
            f"likely cause: rank(s) {culprits} (not inside a torch.distributed call; "
            f"rank(s) {waiting} wait in one)"
        )
    details.append(f"full stacks: {os.path.join(dump, 'hang', 'rank-<r>.txt')}")
    first = min(good.values(), key=lambda v: v.get("time", 0), default={})
    phases = sorted({str(v.get("phase")) for v in good.values()})
    steps = [v["last_step"] for v in good.values() if v.get("last_step") is not None]
    summary = (
        f"hang on {len(recs)} rank(s) in phase {'/'.join(phases)} at step "
        f"{max(steps) if steps else '?'}: {first.get('reason', 'no progress')}"
    )
    verdict = hang_verdict(dump, recs)
    step = max(steps) if steps else None
    return [Finding("hang", True, summary, first.get("time"), step, details, verdict=verdict)]


def read_replicas(dump: str) -> list[Finding]:
    """A replica check's mismatch (replica/rank-<r>.json, tandem/rl/fault/replica.py)."""
    recs = [v for v in _rank_records(os.path.join(dump, "replica")).values() if v.get("message")]
    if not recs:
        return []
    rec = recs[0]
    msg = f"replicas diverged at {rec['message']}"
    return [Finding("replica", True, msg, rec.get("time"), rec.get("step"), verdict=msg)]


def read_rollbacks(dump: str) -> list[Finding]:
    """Rollbacks (rollback.jsonl, fault.on_nonfinite = "rollback"): recovered, so notes."""
    out = []
    for row in jsonl_rows(os.path.join(dump, "rollback.jsonl")):
        msg = (
            f"{row.get('reason', 'non-finite')}: rolled back to step-{row.get('to')}; step "
            f"{row['step']}'s prompts skipped (ledger.jsonl marks the step)"
        )
        out.append(Finding("rollback", False, msg, row.get("time"), row["step"]))
    return out


def read_stragglers(dump: str) -> list[Finding]:
    """The straggler lines of health.jsonl (notes: a slow rank is not a failure)."""
    return [
        Finding("straggler", False, line.removeprefix("straggler: "), when, step, verdict=line)
        for step, line, when in stragglers(dump)
    ]


def read_nans(dump: str) -> list[Finding]:
    recs = _rank_records(os.path.join(dump, "nan"))
    if not recs:
        return []
    rec = next((v for v in recs.values() if v.get("first")), next(iter(recs.values())))
    first = rec.get("first") or {}
    what = (
        ("loss" if first.get("where") == "loss" else f"gradient of {first.get('tensor')}")
        if first
        else "unknown tensor"
    )
    summary = (
        f"non-finite ({first.get('kind', '?')}) {what} at step {rec.get('step')} on rank "
        f"{first.get('rank', '?')}"
    )
    details = [
        f"ranks with non-finite values: {rec.get('offending_ranks')}; reports from ranks "
        f"{sorted(recs)}"
    ]
    if first.get("nonfinite_grads"):
        details.append(
            f"{first['nonfinite_grads']} non-finite gradient tensor(s) on rank {first.get('rank')}"
        )
    return [Finding("nan", True, summary, rec.get("time"), rec.get("step"), details)]


def read_checkpoints(dump: str, sub: str) -> tuple[int | None, Finding | None]:
    folder = os.path.join(dump, sub)
    if not os.path.isdir(folder):
        return None, None
    committed, partial = [], []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        if m.group(2) or not os.path.exists(os.path.join(folder, name, MARKER)):
            partial.append(name)
        else:
            committed.append(int(m.group(1)))
    latest = max(committed) if committed else None
    lines = [
        f"latest committed: {os.path.join(folder, f'step-{latest}')}"
        if latest is not None
        else "no committed checkpoint"
    ]
    if partial:
        lines.append(f"incomplete (ignored on resume): {', '.join(sorted(partial))}")
    summary = f"checkpoints: {len(committed)} committed" + (
        f", latest step-{latest}" if latest is not None else ""
    )
    return latest, Finding("checkpoint", False, summary, details=lines)


def read_preempts(dump: str, latest_ckpt: int | None) -> list[Finding]:
    recs = _rank_records(os.path.join(dump, "preempt"))
    if not recs:
        return []
    steps = [v["step"] for v in recs.values() if isinstance(v.get("step"), int)]
    step = max(steps) if steps else None
    got = {r: v.get("signal") for r, v in recs.items() if v.get("signal")}
    when = min((v["received_at"] for v in recs.values() if v.get("received_at")), default=None)
    saved = step is not None and latest_ckpt is not None and latest_ckpt >= step
    summary = (
        f"preempted at step {step} "
        f"({', '.join(f'{s} on rank {r}' for r, s in sorted(got.items())) or 'signal'})"
    )
    summary += (
        f"; checkpoint step-{latest_ckpt} covers it: resumable"
        if saved
        else (
            "; but the latest committed checkpoint is "
            f"{latest_ckpt if latest_ckpt is not None else 'none'}: the save did not finish"
        )
    )
    return [
        Finding(
            "preempt",
            not saved,
            summary,
            when,
            step,
            [f"ranks that agreed to stop: {sorted(recs)}"],
        )
    ]


def _error_files(dump: str, extra: list[str], skip: str) -> list[str]:
    """torchrun error files: the ones named, and any error.json up to 5 levels under the
    dump folder."""
    found = [p for p in extra if p and os.path.isfile(p)]
    base = dump.rstrip(os.sep).count(os.sep)
    for root, dirs, files in os.walk(dump):
        depth = root.rstrip(os.sep).count(os.sep) - base
        dirs[:] = [] if depth >= 5 else [d for d in dirs if not (depth == 0 and d == skip)]
        found += [os.path.join(root, f) for f in files if f == "error.json"]
    return sorted(set(found))


def read_errors(dump: str, extra: list[str], skip: str = "checkpoints") -> list[Finding]:
    out = []
    for path in _error_files(dump, extra, skip):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        msg = data.get("message", data)
        info: dict[str, Any] = {}
        if isinstance(msg, dict):
            info = msg.get("extraInfo", {}) or {}
            msg = msg.get("message", "")
        text = str(msg).strip().splitlines()
        stack = str(info.get("py_callstack", "")).strip().splitlines()
        ts = info.get("timestamp")
        when = (
            float(ts)
            if isinstance(ts, (int, float, str)) and str(ts).isdigit()
            else os.path.getmtime(path)
        )
        details = [f"file: {path}"] + [f"  {line}" for line in stack[-6:]]
        out.append(
            Finding(
                "error",
                True,
                f"worker error: {text[-1] if text else '(empty message)'}",
                when,
                details=details,
            )
        )
    return out


def read_metrics(dump: str, tail: int) -> tuple[int | None, float | None, list[str]]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return None, None, []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()[-tail:]
    last, shown = None, []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            shown.append(f"(unparseable line: {line.strip()[:80]})")
            continue
        last = rec.get("step", last)
        keys = [k for k in ("loss", "reward_mean", "grad_norm", "lr", "step_time_s") if k in rec]
        shown.append(
            f"step {rec.get('step')}: "
            + " ".join(
                f"{k}={rec[k]:.4g}" if isinstance(rec[k], float) else f"{k}={rec[k]}" for k in keys
            )
        )
    return last, os.path.getmtime(path), shown


def diagnose(
    dump: str,
    *,
    checkpoint_folder: str = "checkpoints",
    tail: int = 3,
    error_files: list[str] | None = None,
) -> tuple[list[str], bool]:
    """Report lines and whether something failed (and was not recovered from)."""
    extra = list(error_files or []) + [os.environ.get("TORCHELASTIC_ERROR_FILE", "")]
    last_step, metrics_mtime, metric_lines = read_metrics(dump, tail)
    latest, ckpt = read_checkpoints(dump, checkpoint_folder)
    findings = (
        read_hangs(dump)
        + read_nans(dump)
        + read_preempts(dump, latest)
        + read_errors(dump, extra, checkpoint_folder)
        + read_replicas(dump)
        + read_rollbacks(dump)
        + read_stragglers(dump)
    )
    progress = max([s for s in (last_step, latest) if s is not None], default=None)
    for f in findings:
        if (
            f.failed
            and f.step is not None
            and progress is not None
            and progress > f.step
            and metrics_mtime is not None
            and f.when is not None
            and metrics_mtime > f.when
        ):
            f.earlier = True
    failed = [f for f in findings if f.failed and not f.earlier]
    lines = [_verdict(findings, failed), f"dump folder: {dump}"]
    for f in sorted(findings, key=lambda f: f.when or 0):
        tag = "FAILED" if f.failed and not f.earlier else ("earlier" if f.earlier else "note")
        lines.append(f"[{tag}] {f.kind}: {f.summary} ({_when(f.when)})")
        lines += [f"    {d}" for d in f.details]
    if ckpt is not None:
        lines.append(ckpt.summary)
        lines += [f"    {d}" for d in ckpt.details]
    else:
        lines.append(f"checkpoints: none under {os.path.join(dump, checkpoint_folder)}")
    if metric_lines:
        lines.append(f"metrics.jsonl: last step {last_step} (written {_when(metrics_mtime)})")
        lines += [f"    {m}" for m in metric_lines]
    fr = os.path.join(dump, "flight_recorder")
    if os.path.isdir(fr) and os.listdir(fr):
        lines.append(
            f"flight recorder: {len(os.listdir(fr))} dump(s) in {fr}; read them with "
            f"python -m torch.distributed.flight_recorder.fr_trace {fr} --prefix rank-"
        )
    return lines, bool(failed)


def _verdict(findings: list[Finding], failed: list[Finding]) -> str:
    """The first line: what failed, in the doctor's words where it has them."""
    if failed:
        first = min(failed, key=lambda f: f.when or 0)
        kinds = ", ".join(sorted({f.kind for f in failed}))
        return f"verdict: FAILED: {kinds}: {first.verdict or first.summary}"
    notes = [f.verdict for f in findings if f.kind == "straggler"][-1:]
    back = [str(f.step) for f in findings if f.kind == "rollback"]
    if back:
        notes.append(
            f"rolled back {len(back)} time(s), skipping the prompts of step(s) {', '.join(back)}"
        )
    return "verdict: no failure found" + "".join(f"; {n}" for n in notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem-diagnose", description=__doc__.split("\n")[0])
    p.add_argument("dump_folder", nargs="?")
    p.add_argument("--checkpoint-folder", default="checkpoints", help="relative to the dump folder")
    p.add_argument("--tail", type=int, default=3, help="metrics.jsonl lines to show")
    p.add_argument(
        "--error-file", action="append", default=[], help="extra torchrun error.json files"
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="under torchrun: time a matmul and an all-reduce on every rank and flag slow ranks "
        "(exit 1 when one is); DUMP_FOLDER, if given, gets preflight.json",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=1.5,
        help="--preflight: flag a matmul this many times the median rank's",
    )
    a = p.parse_args(argv)
    if a.preflight:
        from tandem.rl.fault.preflight import run  # torch: only here

        return run(a.dump_folder, a.ratio)
    if a.dump_folder is None:
        p.error("the dump folder is required (unless --preflight)")
    if not os.path.isdir(a.dump_folder):
        print(f"error: {a.dump_folder}: not a folder", file=sys.stderr)
        return 2
    lines, failed = diagnose(
        a.dump_folder, checkpoint_folder=a.checkpoint_folder, tail=a.tail, error_files=a.error_file
    )
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
