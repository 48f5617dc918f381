"""tandem-sweep: the space file's checks, and real sweeps of the CPU quickstart (train.py trials).

The sweep test runs 6 one-process trials of 9 steps, two at a time, kills the
sweep with SIGKILL while trials run, and runs the same command again.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tandem.sweep import SweepError
from tandem.sweep.__main__ import main as sweep_main
from tandem.sweep.trial import Slot, objective_value, plan_slots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXED = """
[fixed]
"training.steps" = 9
"rl.prompts_per_step" = 8
"rl.eval_prompts" = 16
"training.eval_interval" = 3
"lr_schedule.warmup_steps" = 0
"checkpoint.interval" = 3
"checkpoint.export_hf_at_end" = false
"metrics.loggers" = []
"reward.num_workers" = 0
"""
SPACE = (
    """
[space]
"optimizer.lr" = { log_uniform = [1e-6, 1e-3] }
"rl.advantage" = { choice = ["grpo", "rloo"] }
"""
    + FIXED
    + """
[objective]
metric = "eval/accuracy"
mode = "last"
direction = "maximize"

[pruner]
name = "median"
startup_trials = 2

[sampler]
seed = 0
"""
)


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _sweep_cmd(space, study, trials=6, parallel=2):
    return [
        sys.executable,
        "-m",
        "tandem.sweep",
        "--config",
        "configs/quickstart.toml",
        "--space",
        str(space),
        "--trials",
        str(trials),
        "--parallel",
        str(parallel),
        "--study",
        str(study),
    ]


# ---- bad input: one line, exit 2, nothing started ------------------------------------------------


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            '"optimizer.lr" = { log_uniform = [1e-3, 1e-6] }',
            '[space] "optimizer.lr": log_uniform range [0.001, 1e-06] is inverted or empty; '
            "write [low, high] with low < high",
        ),
        (
            '"optimizer.lrr" = { log_uniform = [1e-6, 1e-3] }',
            "unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?",
        ),
        ('"rl.num_samples" = { uniform = [4.0, 16.0] }', "rl.num_samples: expected int, got '4.0'"),
        ('"optimizer.lr" = { uniform = [0.0, 1e-3] }', "optimizer.lr: must be > 0, got 0.0"),
        ('"rl.advantage" = { choice = ["grpo", "grpoo"] }', "rl.advantage"),
        (
            '"optimizer.lr" = { normal = [0, 1] }',
            "give exactly one of uniform, log_uniform, int, choice",
        ),
        (
            '"rl.num_samples" = { int = [4, 16] }\n[objective]\nmetric = "loss"',
            "[objective] direction: required",
        ),
        # each trial has its own dump folder, and its checkpoints in it: a space file may not
        # share them
        (
            '"checkpoint.folder" = { choice = ["/tmp/shared-ckpt", "ck"] }',
            '[space] "checkpoint.folder": each trial keeps its checkpoints in its own dump folder',
        ),
        (
            '"optimizer.lr" = { log_uniform = [1e-6, 1e-3] }\n'
            '[fixed]\n"checkpoint.folder" = "/tmp/shared-ckpt"',
            '[fixed] "checkpoint.folder": each trial keeps its checkpoints in its own dump folder',
        ),
        (
            '"optimizer.lr" = { log_uniform = [1e-6, 1e-3] }\n'
            '[fixed]\njob.dump_folder = "/tmp/run"',
            '[fixed] "job.dump_folder": each trial keeps its checkpoints in its own dump folder',
        ),
    ],
)
def test_bad_space_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, entry, message):
    monkeypatch.chdir(ROOT)
    space = tmp_path / "space.toml"
    space.write_text("[space]\n" + entry + "\n")
    study = tmp_path / "study"
    assert (
        sweep_main(
            [
                "--config",
                "configs/quickstart.toml",
                "--space",
                str(space),
                "--trials",
                "2",
                "--study",
                str(study),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {space}: ") and message in err, err
    assert not study.exists()  # nothing was started


def test_shipped_space_and_unquoted_dotted_keys(tmp_path, monkeypatch):
    from tandem.sweep.space import check_configs, load_space

    monkeypatch.chdir(ROOT)
    shipped = load_space("configs/sweeps/quickstart.toml")  # the README's example
    assert check_configs("configs/quickstart.toml", shipped, "space").training.steps == 20
    space = tmp_path / "space.toml"
    space.write_text(
        "[space]\noptimizer.lr = { log_uniform = [1e-6, 1e-3] }\n[fixed]\ntraining.steps = 9\n"
    )
    got = load_space(str(space))
    assert list(got.params) == ["optimizer.lr"] and got.fixed == {"training.steps": 9}
    assert got.overrides({"optimizer.lr": 1e-4}) == ["training.steps=9", "optimizer.lr=0.0001"]


def test_a_study_keeps_its_files_and_its_folder(tmp_path, monkeypatch):
    from tandem.sweep.space import check_configs, load_space, resolve_objective
    from tandem.sweep.study import Sweep, lock_study

    monkeypatch.chdir(ROOT)
    space_path = tmp_path / "space.toml"
    space_path.write_text(SPACE)
    space = load_space(str(space_path))
    base = check_configs("configs/quickstart.toml", space, str(space_path))
    objective = resolve_objective(space, "rl", str(space_path))
    study = str(tmp_path / "study")
    lock = lock_study(study)
    with pytest.raises(SweepError, match="is in use by another tandem-sweep") as e:
        lock_study(study)
    assert e.value.status == 5
    lock.close()
    Sweep(study, "configs/quickstart.toml", space, objective, base, 2, [Slot(0, (0,))], 1)
    space.params.pop("rl.advantage")
    with pytest.raises(SweepError, match="was started with another space file") as e:
        Sweep(study, "configs/quickstart.toml", space, objective, base, 2, [Slot(0, (0,))], 1)
    assert e.value.status == 2


def test_bad_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    assert (
        sweep_main(["--config", "configs/quickstart.toml", "--space", str(space), "--trials", "0"])
        == 2
    )
    assert capsys.readouterr().err == "error: --trials: must be >= 1, got 0\n"
    assert (
        sweep_main(["--config", "configs/nope.toml", "--space", str(space), "--trials", "2"]) == 2
    )
    assert capsys.readouterr().err == "error: --config: no such file: configs/nope.toml\n"


def test_shared_checkpoints_or_a_bad_study_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    args = ["--config", "configs/quickstart.toml", "--space", str(space), "--trials", "2"]
    config = tmp_path / "shared.toml"  # the quickstart with its checkpoints outside the dump folder
    text = open("configs/quickstart.toml").read()
    config.write_text(text.replace("[checkpoint]", '[checkpoint]\nfolder = "../ck"'))
    assert sweep_main([*args[:1], str(config), *args[2:], "--study", str(tmp_path / "s1")]) == 2
    assert capsys.readouterr().err == (
        f"error: --config {config}: checkpoint.folder = '../ck' is outside the trial's dump "
        "folder, so trials would share checkpoints; give a folder inside it (the default is "
        '"checkpoints")\n'
    )
    (tmp_path / "afile").write_text("x")
    assert sweep_main([*args, "--study", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --study {tmp_path / 'afile'}: a file; give a study folder\n"
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "study.db").write_bytes(b"not a database " * 100)
    assert sweep_main([*args, "--study", str(tmp_path / "garbage")]) == 2
    err = capsys.readouterr().err
    db = tmp_path / "garbage" / "study.db"
    assert err.startswith(f"error: {db}: not a readable Optuna study ("), err
    assert err.count("\n") == 1 and err.endswith("; give a new --study folder\n"), err


def test_slots_split_cores_and_gpus():
    assert plan_slots(2, 1, [0, 1, 2, 3, 4], []) == [Slot(0, (0, 1)), Slot(1, (2, 3))]
    assert plan_slots(2, 2, list(range(8)), ["0", "1", "2", "3"]) == [
        Slot(0, (0, 1, 2, 3), ("0", "1")),
        Slot(1, (4, 5, 6, 7), ("2", "3")),
    ]
    assert Slot(1, (4, 5, 6, 7), ("2", "3")).env(2) == {
        "OMP_NUM_THREADS": "2",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    with pytest.raises(SweepError, match="needs 6 GPUs; 4 visible"):
        plan_slots(3, 2, list(range(8)), ["0", "1", "2", "3"])
    with pytest.raises(SweepError, match="--parallel 3 needs 3 CPU cores; this process may use 2"):
        plan_slots(3, 1, [0, 1], [])


def test_objective_modes():
    rows = [
        {"step": 1, "loss": 3.0},
        {"step": 3, "eval/accuracy": 0.6, "loss": 2.0},
        {"step": 6, "eval/accuracy": 0.4, "loss": float("nan")},
    ]
    assert objective_value(rows, "eval/accuracy", "last", "maximize") == 0.4
    assert objective_value(rows, "eval/accuracy", "best", "maximize") == 0.6
    assert objective_value(rows, "loss", "best", "minimize") == 2.0  # NaN is skipped
    assert objective_value(rows, "eval/acc", "last", "maximize") is None


# ---- real trials ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_objective_metric_stops_after_the_first_trial(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text(
        SPACE.replace('metric = "eval/accuracy"', 'metric = "eval/acc"').replace(
            '"training.steps" = 9', '"training.steps" = 2'
        )
    )
    r = subprocess.run(
        _sweep_cmd(space, tmp_path / "study", trials=2, parallel=1),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (
        "error: unknown metric 'eval/acc': not in any row of "
        f"{tmp_path / 'study' / 'trial-0000'}/metrics.jsonl; "
        "did you mean 'eval/accuracy'?"
    )


def _study(folder):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="sweep", storage=f"sqlite:///{folder / 'study.db'}")


def _wait_for_a_training_trial(log, study, timeout_s=400):
    """Wait until two trials finished and a later one has logged a step (it is training now)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        done = text.count(" complete: ") + text.count(" pruned: ")
        started = [
            int(line.split()[1])
            for line in text.splitlines()
            if line.startswith("trial ") and " started " in line
        ]
        running = [
            n
            for n in started
            if f"trial {n} complete" not in text and f"trial {n} pruned:" not in text
        ]
        if done >= 2 and any(
            (study / f"trial-{n:04d}" / "metrics.jsonl").exists() for n in running if n >= 2
        ):
            return
        time.sleep(0.05)
    raise AssertionError("no trial got to training in time:\n" + log.read_text()[-3000:])


def _snapshot(folder):
    return {
        p: (folder / p / "metrics.jsonl").read_bytes()
        for p in os.listdir(folder)
        if p.startswith("trial-")
    }


@pytest.mark.slow
def test_sweep_prunes_survives_a_kill_and_its_best_config_runs(tmp_path):
    space, study = tmp_path / "space.toml", tmp_path / "study"
    space.write_text(SPACE)
    cmd = _sweep_cmd(space, study)
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for_a_training_trial(log, study)
        finally:
            # no chance to clean up; its trials get SIGTERM (PDEATHSIG)
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    s = _study(study)
    finished_before = {
        t.number: t for t in s.get_trials() if t.state.name in ("COMPLETE", "PRUNED")
    }
    running_before = {t.number: t for t in s.get_trials() if t.state.name == "RUNNING"}
    assert len(finished_before) >= 2 and running_before, log.read_text()[-3000:]
    files_before = {
        t.user_attrs["folder"]: (study / t.user_attrs["folder"] / "metrics.jsonl").read_bytes()
        for t in finished_before.values()
    }

    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    trials = _study(study).get_trials()
    by_state = {
        st: [t for t in trials if t.state.name == st]
        for st in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
    }
    assert len(by_state["COMPLETE"]) + len(by_state["PRUNED"]) == 6  # the study ends with N trials
    assert by_state["RUNNING"] == []
    # finished trials were not re-run: not started again, their files untouched
    for n in finished_before:
        assert f"trial {n} started" not in r.stdout
    for folder, data in files_before.items():
        assert (study / folder / "metrics.jsonl").read_bytes() == data, folder
    # each interrupted trial failed and was retried with its parameters, in its folder, from its
    # checkpoint
    assert sorted(t.number for t in by_state["FAIL"]) == sorted(running_before)
    for n, before in running_before.items():
        assert trials[n].user_attrs["interrupted"] is True
        retry = [t for t in trials if t.user_attrs.get("retry_of") == n]
        assert (
            len(retry) == 1
            and retry[0].params == before.params
            and retry[0].state.name in ("COMPLETE", "PRUNED")
        )
        m, folder = retry[0].number, before.user_attrs["folder"]
        assert retry[0].user_attrs["folder"] == folder
        attempts = (study / folder / "train.log").read_text().split("# tandem-sweep: ")[1:]
        # the killed attempt's SIGTERM checkpoint
        left_checkpoint = "checkpoint step-" in attempts[0]
        if (
            f"trial {m} pruned at step {retry[0].user_attrs.get('pruned_at')} on what its "
            "interrupted" in r.stdout
        ):
            # its logged values sufficed: not relaunched
            assert left_checkpoint and len(attempts) == 1
        else:
            assert f"trial {m} started (cpu" in r.stdout and f"retry of trial {n})" in r.stdout
            assert len(attempts) == 2 and ("resumed from" in attempts[1]) == left_checkpoint, (
                attempts
            )
    # pruning: stopped by SIGTERM, exit 75, checkpoint kept; a trial the SIGTERM reached only in its
    # last step has nothing left to stop and ends normally (exit 0, all 9 steps, its final
    # checkpoint)
    assert by_state["PRUNED"], r.stdout[-3000:]
    for t in by_state["PRUNED"]:
        if "exit_status" not in t.user_attrs:
            # a retry pruned on what its killed attempt logged (checked above)
            assert t.user_attrs.get("retry_of") is not None, t.user_attrs
            continue
        folder = study / t.user_attrs["folder"]
        last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        assert t.user_attrs["pruned_at"] < 9
        assert t.user_attrs["exit_status"] == 75 or (
            t.user_attrs["exit_status"] == 0 and last == 9
        ), (t.user_attrs, last)
        assert (folder / "checkpoints" / t.user_attrs["checkpoint"]).is_dir()
    # the table, the best config, the report
    csv_rows = (study / "trials.csv").read_text().splitlines()
    assert (
        csv_rows[0] == "trial,status,objective,optimizer.lr,rl.advantage,steps,seconds,folder,note"
    )
    assert len(csv_rows) == 1 + len(trials)
    best = max(by_state["COMPLETE"], key=lambda t: t.value)
    worst = min((t for t in trials if t.value is not None), key=lambda t: t.value)
    assert best.value > worst.value
    # the report: trials side by side and Optuna's plots
    page = (study / "report.html").read_text()
    blob = page.split('<script type="application/json" id="figures-data">', 1)[1].split(
        "</script>", 1
    )[0]
    figs = json.loads(blob)
    assert {"fig-study0-history", "fig-study0-importance", "fig-study0-slice"} <= set(figs)
    shown = {tr["name"] for tr in figs["fig-held-out-eval"]["data"]}
    assert {
        f"trial {t.number} ({t.state.name.lower()})"
        for t in by_state["COMPLETE"] + by_state["PRUNED"]
    } <= shown
    run = subprocess.run(
        [sys.executable, "train.py", "--config", str(study / "best.toml")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in open(study / "best" / "metrics.jsonl")]
    # the best trial, again
    assert rows[-1]["step"] == 9 and rows[-1]["eval/accuracy"] == best.value
