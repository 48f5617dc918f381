"""The doctor's verdicts for ``tandem-diagnose``: from evidence on every rank to one line.

    hang_verdict(dump)    joins the watchdog's hang/rank-<r>.json dumps (and health.jsonl's
                          rank -> host map) into one line: which rank did not reach which
                          collective of which step and phase, on which host, and where it is
    stragglers(dump)      the straggler lines the shell wrote to health.jsonl

A rank *waits* when its trainer thread is inside a collective: one Tandem issues itself (the
dump's ``collective``, tandem/rl/core/health.py `waiting`) or any torch.distributed call (its
innermost frames). The ranks that do not wait, and the ranks that left no dump at all (a
process stopped with SIGSTOP, killed, or frozen outside Python cannot write one), are the ones
the others wait for. No torch here (tandem-diagnose runs on a login node).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

_IN_STEP = {"step", "rollout", "update", "sync"}  # phases inside a step: working on last_step + 1
TOP_FRAMES = 4


def _short(path: str) -> str:
    for marker in (os.getcwd() + "/", "site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _trainer_frames(rec: dict[str, Any]) -> list[dict[str, Any]]:
    trainer = next((t for t in rec.get("threads", []) if t.get("trainer")), None)
    return trainer["frames"] if trainer else []


def waits_in(rec: dict[str, Any]) -> str | None:
    """The collective a rank's dump shows it waiting in, or None."""
    if rec.get("collective"):
        return str(rec["collective"])
    frames = _trainer_frames(rec)
    inner = [f for f in frames[-TOP_FRAMES:] if "torch/distributed" in f["file"]]
    if not inner:
        return None
    # the outermost torch.distributed frame among the innermost few: the call the code made
    return f"{inner[0]['function']} (torch.distributed)"


def _where(rec: dict[str, Any], *, outside_torch: bool = False) -> str:
    """The innermost frame of a rank's trainer thread (``outside_torch``: the innermost one not
    in torch, the caller of the collective it waits in)."""
    frames = [f for f in _trainer_frames(rec) if "tandem/rl/fault/watchdog" not in f["file"]]
    if outside_torch:
        frames = [f for f in frames if not _in_torch(f["file"])]
    if not frames:
        return "no Python frames in its dump"
    f = frames[-1]
    return f"{_short(f['file'])}:{f['line']} in {f['function']}" + (
        f" ({f['code'].strip()})" if f.get("code") and not outside_torch else ""
    )


def _in_torch(path: str) -> bool:
    return "/torch/" in path or path.startswith("torch/")


def _step(rec: dict[str, Any]) -> int | None:
    last = rec.get("last_step")
    if last is None:
        return 1 if rec.get("phase") in _IN_STEP else None
    return int(last) + 1 if rec.get("phase") in _IN_STEP else int(last)


def jsonl_rows(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file that hold an integer ``step`` ([] without the file;
    other lines, a crash's half-written last one among them, skipped)."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def _health_rows(dump: str) -> list[dict[str, Any]]:
    return jsonl_rows(os.path.join(dump, "health.jsonl"))


def _hosts(dump: str) -> dict[int, str]:
    """rank -> host from health.jsonl's last row (every rank's, each step)."""
    rows = _health_rows(dump)
    last = rows[-1] if rows else {}
    return {int(r["rank"]): str(r.get("host", "?")) for r in last.get("ranks", []) if "rank" in r}


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def hang_verdict(dump: str, recs: dict[int, dict[str, Any]]) -> str | None:
    """One line naming the rank(s) the others wait for, from every rank's hang dump ``recs``."""
    good = {r: v for r, v in recs.items() if "_unreadable" not in v}
    if not good:
        return None
    hosts = _hosts(dump)
    hosts.update({r: str(v.get("host", "?")) for r, v in good.items()})
    world = max([int(v.get("world_size", 0)) for v in good.values()] + [max(good) + 1])
    world = max(world, max(hosts, default=-1) + 1)
    waiting = {r: c for r, v in good.items() if (c := waits_in(v)) is not None}
    silent = [r for r in range(world) if r not in good]
    working = [r for r in sorted(good) if r not in waiting]
    culprits = sorted(silent + working)
    if not waiting:
        where = "; ".join(f"rank {r} at {_where(good[r])}" for r in sorted(good))
        return (
            f"hang on {_ranks_text(sorted(good))}, none inside a collective (a deadlock or a "
            f"stuck data or reward worker): {where}"
        )
    if not culprits:
        coll = Counter(waiting.values()).most_common(1)[0][0]
        return (
            f"hang: every rank waits in a collective ({coll} on rank {min(waiting)}); the ranks "
            f"disagree on which, or the network or a device is stuck: compare the stacks"
        )
    collective, _ = Counter(waiting.values()).most_common(1)[0]
    ref = good[min(r for r, c in waiting.items() if c == collective)]
    step, phase = _step(ref), ref.get("phase")
    on = ", ".join(f"{hosts.get(r, '?')}" for r in culprits)
    parts = []
    for r in culprits:
        if r in good:
            parts.append(f"rank {r} is at {_where(good[r])} (phase '{good[r].get('phase')}')")
        else:
            parts.append(
                f"rank {r} left no dump (stopped, killed, or stuck outside Python: SIGSTOP, a "
                f"kernel or driver hang)"
            )
    return (
        f"{_ranks_text(culprits)} (host {on}) did not reach {collective} of step {step} "
        f"(phase '{phase}', called at {_where(ref, outside_torch=True)}) that "
        f"{_ranks_text(sorted(waiting))} wait in; " + "; ".join(parts)
    )


def stragglers(dump: str) -> list[tuple[int, str, float | None]]:
    """(step, line, time) for each straggler line the shell recorded in health.jsonl."""
    return [
        (row["step"], str(row["straggler"]), row.get("time"))
        for row in _health_rows(dump)
        if row.get("straggler")
    ]
