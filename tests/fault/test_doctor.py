"""The rank doctor: per-rank health and the straggler line, the hang verdict, the drills.

The drills run train.py on the quickstart under torchrun on 3 CPU ranks (gloo): the fewest
where "the median rank" is a rank that was not slowed, so naming rank 1 and no other means
something. TANDEM_INJECT_SLOW / TANDEM_INJECT_STOP are tandem/rl/fault/inject.py's drills.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem import diagnose
from tandem.diagnose_doctor import hang_verdict
from tandem.rl.core import health

ROOT = Path(__file__).resolve().parents[2]


# ---- health rows, the summary and the straggler watch ------------------------------------


def test_phase_clock_splits_phases_and_waits(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    clock = health.PhaseClock()
    health.install(clock)
    try:
        clock.switch("rollout")
        now[0] += 2.0  # 2 s of rollout
        clock.switch("update")
        now[0] += 1.0
        with health.waiting("all_reduce:a"):
            assert clock.collective == "all_reduce:a"
            with health.waiting("inner"):  # counted once, in the outer wait
                now[0] += 3.0
            assert clock.collective == "all_reduce:a"
        assert clock.collective is None
        now[0] += 0.5
        row = clock.take()
    finally:
        health.install(None)
    assert row["phases"] == {"rollout": 2.0, "startup": 0.0, "update": 4.5}
    assert row["waits"] == {"update": 3.0}
    assert row["own_s"] == 3.5 and row["wait_s"] == 3.0
    assert clock.take()["own_s"] == 0.0  # take() resets


def _row(rank: int, update: float, wait: float) -> dict:
    return {
        "rank": rank,
        "host": f"h{rank}",
        "phases": {"rollout": 1.0, "update": update},
        "waits": {"update": wait},
        "own_s": 1.0 + update - wait,
        "wait_s": wait,
    }


def test_summary_names_the_rank_with_most_own_time() -> None:
    # rank 2 computes 3 s more in its update; ranks 0, 1, 3 wait for it
    rows = [_row(0, 5.0, 3.0), _row(1, 5.0, 3.1), _row(2, 5.0, 0.1), _row(3, 5.0, 2.9)]
    s = health.summarize(rows)
    own = [3.0, 2.9, 5.9, 3.1]
    median = (3.0 + 3.1) / 2
    assert s["slowest_rank"] == 2 and s["slowest_phase"] == "update"
    assert s["median_own_s"] == pytest.approx(median)
    assert s["straggler_ratio"] == pytest.approx(max(own) / median)
    assert s["wait_max_s"] == 3.1


def test_summary_compares_split_groups_among_themselves() -> None:
    # split mode: generators (ranks 0, 1) decode for 5 s while trainers (2-4) update; only
    # trainer 4 is slow among its peers
    own = [5.0, 5.2, 1.0, 1.1, 3.0]
    rows = [
        {"group": "generators" if r < 2 else "trainers", "phases": {"step": o}, "waits": {}}
        | {"own_s": o, "wait_s": 0.0}
        for r, o in enumerate(own)
    ]
    s = health.summarize(rows)
    assert s["slowest_rank"] == 4 and s["straggler_ratio"] == pytest.approx(3.0 / 1.1)
    assert s["groups"]["generators"]["slowest_rank"] == 1
    assert s["groups"]["generators"]["straggler_ratio"] == pytest.approx(5.2 / 5.1)


def test_straggler_watch_needs_the_same_rank_for_n_steps() -> None:
    w = health.StragglerWatch(1.5, 3)
    hosts = ["a", "b", "c"]
    fast = {"straggler_ratio": 1.1, "slowest_rank": 0, "slowest_phase": "update"}
    slow = {"straggler_ratio": 2.0, "slowest_rank": 2, "slowest_phase": "update"}
    other = dict(slow, slowest_rank=1)
    seen = [w.observe(s, x, hosts) for s, x in enumerate([slow, slow, other, slow, fast], 1)]
    assert seen == [None] * 5  # never 3 in a row for one rank
    seen = [w.observe(s, x, hosts) for s, x in enumerate([slow] * 5, 6)]
    assert seen[:2] == [None, None] and seen[3:] == [None, None]  # said once per streak
    assert seen[2].startswith("straggler: rank 2 on c has been 2.00x") and "steps 6-8" in seen[2]
    assert health.StragglerWatch(0, 1).observe(1, slow, hosts) is None  # 0 = off


# ---- the hang verdict from dumps ---------------------------------------------------------


def _dump(rank: int, phase: str, last: int, frames: list[tuple[str, str]], **extra) -> dict:
    fr = [
        {"file": f, "line": 10 + i, "function": fn, "code": ""} for i, (f, fn) in enumerate(frames)
    ]
    rec = {"rank": rank, "host": f"n{rank}", "phase": phase, "last_step": last, "time": 1.0}
    rec["threads"] = [{"name": "MainThread", "trainer": True, "frames": fr}]
    return {**rec, **extra}


def test_hang_verdict_names_the_rank_that_did_not_arrive(tmp_path: Path) -> None:
    dist_frames = [("train.py", "main"), ("torch/distributed/distributed_c10d.py", "all_gather")]
    live = [("train.py", "main"), ("tandem/rl/rewards/code.py", "score")]
    recs = {
        0: _dump(0, "update", 6, dist_frames, world_size=4),
        1: _dump(1, "update", 6, dist_frames, collective="all_reduce:nonfinite_flag"),
        2: _dump(2, "update", 6, dist_frames, collective="all_reduce:nonfinite_flag"),
        3: _dump(3, "rollout", 6, live),
    }
    line = hang_verdict(str(tmp_path), recs)
    assert line.startswith(
        "rank 3 (host n3) did not reach all_reduce:nonfinite_flag of step 7 (phase 'update', "
        "called at train.py:10 in main) that ranks 0, 1, 2 wait in; rank 3 is at "
        "tandem/rl/rewards/code.py:11 in score"
    ), line
    # rank 2 left no dump; its host comes from health.jsonl
    (tmp_path / "health.jsonl").write_text(
        json.dumps({"step": 6, "ranks": [{"rank": r, "host": f"m{r}"} for r in range(4)]}) + "\n"
    )
    del recs[2], recs[3]
    recs[0].pop("world_size")
    recs[0]["collective"] = "all_reduce:nonfinite_flag"
    line = hang_verdict(str(tmp_path), recs)
    assert line.startswith(
        "ranks 2, 3 (host m2, m3) did not reach all_reduce:nonfinite_flag of step 7"
    ), line
    assert "rank 2 left no dump" in line and "rank 3 left no dump" in line
    # nobody inside a collective: a deadlock in Python
    line = hang_verdict(str(tmp_path), {0: _dump(0, "eval", 6, live), 1: _dump(1, "eval", 6, live)})
    assert line.startswith("hang on ranks 0, 1, none inside a collective")


# ---- the drills --------------------------------------------------------------------------


def _cmd(dump: Path, nproc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs" / "quickstart.toml"),
        f"--job.dump_folder={dump}",
        "--rl.prompts_per_step=6",
        "--rl.num_samples=4",
        "--rl.eval_prompts=3",
        "--training.eval_interval=0",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf_at_end=false",
        *extra,
    ]


def _env(**drills: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **drills}


@pytest.fixture(scope="module")
def slow_and_flipped(tmp_path_factory) -> tuple[Path, str]:
    """One launch for two drills (3 CPU ranks, HSDP with 3 replicas of one shard each): rank 1
    sleeps 1 s in every update (a step here is ~0.3 s), and flips one bit of its copy of the
    weights at step 3's replica check. Its dump folder and output."""
    dump = tmp_path_factory.mktemp("slow_flip")
    cmd = _cmd(dump, 3, "--training.steps=4", "--fault.straggler_steps=2")
    cmd += ["--parallel.dp_replicate=3", "--fault.replica_check_steps=1"]
    drills = _env(TANDEM_INJECT_SLOW="1:1.0", TANDEM_INJECT_FLIP="3:1")
    r = subprocess.run(cmd, cwd=ROOT, env=drills, capture_output=True, text=True)
    assert r.returncode != 0 and "exitcode  : 11" in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    return dump, r.stdout + r.stderr


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_host_and_no_other(slow_and_flipped, capsys) -> None:
    """From the second step on the doctor names rank 1, once, and never rank 0 or 2."""
    dump, out = slow_and_flipped
    named = [ln for ln in out.splitlines() if ln.startswith("straggler:")]
    host = os.uname().nodename
    assert len(named) == 1 and named[0].startswith(f"straggler: rank 1 on {host} has been"), named
    assert "steps 1-2" in named[0] and "phase 'update'" in named[0]
    rows = [json.loads(line) for line in open(dump / "health.jsonl")]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        own = [rank["own_s"] for rank in row["ranks"]]
        assert row["slowest_rank"] == 1 and own[1] > 1.0 + max(own[0], own[2]) * 0.5, own
        # the others waited for it, in the update's first collective after the backward
        assert min(row["ranks"][0]["waits"]["update"], row["ranks"][2]["waits"]["update"]) > 0.8
    metrics = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    assert {m["health/slowest_rank"] for m in metrics} == {1.0}
    assert min(m["health/straggler_ratio"] for m in metrics) > 1.5
    diagnose.main([str(dump)])
    assert f"[note] straggler: {named[0].removeprefix('straggler: ')}" in capsys.readouterr().out


def _stopped_children(parent: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if pid.isdigit() and fields[0] == "T" and int(fields[1]) == parent:
            out.append(int(pid))
    return out


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_the_hang_verdict(tmp_path: Path, capsys) -> None:
    """Rank 1 stops itself (SIGSTOP) in step 3's update; ranks 0 and 2 wait in the NaN check's
    all-reduce until their watchdogs fire (exit 6). The verdict, tandem-diagnose's first line,
    names rank 1, its host, step 3, the phase and the collective."""
    cmd = _cmd(tmp_path, 3, "--training.steps=5", "--fault.hang_timeout_s=8")
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(TANDEM_INJECT_STOP="3:1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    hang = tmp_path / "hang"
    while not all((hang / f"rank-{r}.json").exists() for r in (0, 2)):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-3000:]
        time.sleep(0.5)
    time.sleep(3)  # the dumps' grace: the ranks exit 6, torchrun waits for the stopped one
    for pid in _stopped_children(p.pid):  # instead of torchrun's 30 s before it SIGKILLs it
        os.kill(pid, signal.SIGKILL)
    out = p.communicate(timeout=120)[0]
    assert p.returncode != 0
    assert "exitcode  : 6" in out, out[-3000:]
    assert not (hang / "rank-1.json").exists()
    assert diagnose.main([str(tmp_path)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    host = os.uname().nodename
    src = (ROOT / "tandem" / "rl" / "fault" / "nan.py").read_text().splitlines()
    line = next(i for i, text in enumerate(src, 1) if "dist.all_reduce(any_bad" in text)
    assert first == (
        f"verdict: FAILED: hang: rank 1 (host {host}) did not reach all_reduce:nonfinite_flag of "
        f"step 3 (phase 'update', called at tandem/rl/fault/nan.py:{line} in _any_bad) that "
        "ranks 0, 2 wait in; rank 1 left no dump (stopped, killed, or stuck outside Python: "
        "SIGSTOP, a kernel or driver hang)"
    ), first


# ---- the replica check -------------------------------------------------------------------


def test_compare_names_the_odd_replica_or_both_of_two() -> None:
    from tandem.rl.fault.replica import compare

    names = ["a", "b", "c"]
    same = {0: [1, 2, 3], 2: [1, 2, 3], 4: [1, 2, 3]}
    assert compare(names, same) is None
    odd = {**same, 2: [1, 5, 7]}  # rank 2 differs in b (and c): the first tensor is named
    assert compare(names, odd) == {
        "tensor": "b",
        "ranks": [2],
        "replicas": [0, 2, 4],
        "checksums": {0: 2, 2: 5, 4: 2},
    }
    two = compare(names, {0: [1, 2, 3], 1: [1, 2, 4]})
    assert two["tensor"] == "c" and two["ranks"] == [0, 1]


def test_the_flip_drill_changes_exactly_one_bit_and_the_checksum(monkeypatch) -> None:
    import torch

    from tandem.rl.fault.inject import flip_bit
    from tandem.rl.fault.replica import local_sums

    t = torch.randn(4, 3)
    before = t.clone()
    params = [("empty", torch.zeros(0)), ("w", t)]
    monkeypatch.setenv("TANDEM_INJECT_FLIP", "3:1")
    assert flip_bit(2, 1, params) is None and flip_bit(3, 0, params) is None
    assert local_sums(params) == local_sums([("empty", torch.zeros(0)), ("w", before)])
    assert flip_bit(3, 1, params) == "w"
    diff = (t.view(torch.int32) ^ before.view(torch.int32)).flatten().tolist()
    assert diff == [1] + [0] * 11
    assert local_sums(params) != local_sums([("empty", torch.zeros(0)), ("w", before)])


@pytest.mark.slow
def test_a_flipped_bit_in_one_replica_is_named(slow_and_flipped, capsys) -> None:
    """Every rank stops with exit 11 naming rank 1, the tensor the drill flipped and step 3;
    tandem-diagnose says the same first."""
    dump, out = slow_and_flipped
    flipped = [ln for ln in out.splitlines() if ln.startswith("fault drill: flipped")]
    assert len(flipped) == 1, out[-3000:]
    tensor = flipped[0].split(" of ")[1].split("[0]")[0]
    host = os.uname().nodename
    line = f"step 3: rank 1 (host {host}) differs from its replicas [0, 2] in {tensor} (checksums"
    for rank in range(3):
        assert f"[rank {rank}] error: {line}" in out, out[-3000:]
    rows = [json.loads(x) for x in open(dump / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2, 3]  # the checks of steps 1 and 2 passed
    assert diagnose.main([str(dump)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"verdict: FAILED: replica: replicas diverged at {line}"), first


# ---- rollback ----------------------------------------------------------------------------


@pytest.mark.slow
def test_rollback_skips_the_bad_steps_prompts_and_ends_like_a_run_that_skipped_them(
    tmp_path: Path, capsys
) -> None:
    """A NaN in step 5's loss (TANDEM_INJECT_NAN) under "rollback": the run reloads step-3,
    trains step 4 again and takes step 5's prompts without training on them; a 1000x loss at
    step 7 (TANDEM_INJECT_SPIKE) trips fault.spike_zscore and rolls back to step-6 the same
    way. The run ends with exit 0; its weights equal, bit for bit, those of an uninterrupted
    run that skipped the updates of steps 5 and 7 ("skip" with NaNs there); its ledger lists
    those steps' prompts as skipped and rollback.jsonl says why."""
    from tests.fixtures import hf_weights

    def run(dump: Path, policy: str, drills: dict[str, str], *extra: str) -> str:
        cmd = _cmd(dump, 2, "--training.steps=8", f"--fault.on_nonfinite={policy}", *extra)
        cmd = [c for c in cmd if not c.startswith("--checkpoint.")]
        cmd += ["--checkpoint.interval=3", "--checkpoint.export_hf_at_end=true"]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(**drills), capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r.stdout

    drills = {"TANDEM_INJECT_NAN": "5", "TANDEM_INJECT_SPIKE": "7"}
    out = run(tmp_path / "rollback", "rollback", drills, "--fault.spike_zscore=6")
    run(tmp_path / "skip", "skip", {"TANDEM_INJECT_NAN": "5,7"}, "--fault.preflight=true")
    assert "[rank 0] step 5: nan in the loss on rank 0: rolling back" in out, out[-2000:]
    assert "rollback 1/3: step 5: non-finite loss or gradient; reloaded" in out
    assert "step-3, step 5's prompts will be skipped" in out
    assert "rollback 2/3: step 7: gradient-norm spike (" in out
    assert "step-6, step 7's prompts will be skipped" in out
    a, b = hf_weights(tmp_path / "rollback"), hf_weights(tmp_path / "skip")
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    ledger = {r["step"]: r for r in map(json.loads, open(tmp_path / "rollback" / "ledger.jsonl"))}
    ref = {r["step"]: r for r in map(json.loads, open(tmp_path / "skip" / "ledger.jsonl"))}
    assert sorted(ledger) == list(range(1, 9))
    assert [s for s in ledger if ledger[s].get("skipped") == "rollback"] == [5, 7]
    assert all(ledger[s]["ids"] == ref[s]["ids"] for s in ledger)
    backs = [json.loads(x) for x in open(tmp_path / "rollback" / "rollback.jsonl")]
    assert [(b["step"], b["to"]) for b in backs] == [(5, 3), (7, 6)]
    assert diagnose.main([str(tmp_path / "rollback")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "verdict: no failure found; rolled back 2 time(s), skipping the prompts of step(s) 5, 7"
    )
    # fault.preflight (the reference run): the table at start-up, nothing flagged, the rows kept
    skip_out = (tmp_path / "skip" / "preflight.json").read_text()
    assert json.loads(skip_out)["flagged"] == []


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


# ---- pre-flight --------------------------------------------------------------------------


@pytest.mark.slow
def test_preflight_flags_the_rank_whose_matmul_is_slowed(tmp_path: Path) -> None:
    """3 CPU ranks; rank 1's matmuls take 0.5 s longer (TANDEM_INJECT_SLOW): it alone is flagged
    (at 3x the median: a loaded machine's noise stays under it), with its host; exit 1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    cmd += ["-m", "tandem.diagnose", "--preflight", "--ratio=3", str(tmp_path)]
    r = subprocess.run(
        cmd, cwd=ROOT, env=_env(TANDEM_INJECT_SLOW="1:0.5"), capture_output=True, text=True
    )
    host = os.uname().nodename
    assert r.returncode != 0 and "exitcode  : 1" in r.stderr, r.stdout + r.stderr[-2000:]
    flagged = [ln for ln in r.stdout.splitlines() if ln.startswith("preflight: rank")]
    assert len(flagged) == 1 and flagged[0].startswith(f"preflight: rank 1 on {host}: matmul")
    assert f"exclude: {host}" in r.stdout
    report = json.load(open(tmp_path / "preflight.json"))
    assert report["flagged"] == [1]
    mm = [row["matmul_s"] for row in report["ranks"]]
    assert mm[1] > 0.5 and max(mm[0], mm[2]) < 0.5, mm


# ---- the report's Ranks section ----------------------------------------------------------


def test_report_shows_per_rank_times_and_marks_stragglers_and_rollbacks(tmp_path: Path) -> None:
    import re

    from tandem.report.build import build_report

    dump = tmp_path / "run"
    dump.mkdir()
    own = {1: [0.1, 0.1, 0.3], 2: [0.1, 0.11, 0.3], 3: [0.1, 0.1, 0.32]}
    line = "straggler: rank 2 on h2 has been 3.20x the median"
    with open(dump / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in own)
    with open(dump / "health.jsonl", "w") as f:
        for s, times in own.items():
            ranks = [{"rank": k, "host": f"h{k}", "own_s": t} for k, t in enumerate(times)]
            row = {"step": s, "ranks": ranks, **({"straggler": line} if s == 3 else {})}
            f.write(json.dumps(row) + "\n")
    (dump / "rollback.jsonl").write_text(json.dumps({"step": 2, "to": 1, "reason": "nan"}) + "\n")
    out = build_report([str(dump)], str(tmp_path / "r.html"))
    html = open(out).read()
    figs = json.loads(re.search(r'id="figures-data">(.*?)</script>', html, re.S).group(1))
    fig = figs["fig-ranks-0"]
    assert fig["data"][0]["z"] == [[own[s][k] for s in (1, 2, 3)] for k in range(3)]
    assert [(sh["x0"], sh["line"]["dash"]) for sh in fig["layout"]["shapes"]] == [
        (3, "dot"),
        (2, "dash"),
    ]
    assert "<h2>Ranks</h2>" in html and f"<td>{line}</td>" in html
    assert "<td>rollback to step-1: nan</td>" in html
    assert "<td>verdict: no failure found; straggler: rank 2 on h2" in html
