"""metrics.loggers: every step's metrics and the resolved config reach an offline W&B run and
a local MLflow store, with no network and no account; a run that names neither needs neither
package; a named logger whose package is missing is one config line."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.core.metrics import read_rows

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
STEPS = 2
SECRET = "sk-tandem-0123456789abcdef"  # env.api_key: must appear in no file of the run


def _train(
    dump: Path, loggers: str, extra: list[str] = (), **env: str
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        QUICKSTART,
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        "--rl.prompts_per_step=8",
        "--rl.num_samples=4",
        "--rl.eval_prompts=4",
        "--reward.num_workers=0",
        "--checkpoint.enable=false",
        f"--metrics.loggers={loggers}",
        *extra,
    ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **env,
    }
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def wandb_records(path: str) -> list:
    """The records of a W&B run file (``run-*.wandb``): a 7-byte ":W&B" header, then LevelDB
    log records (7-byte header: crc, length, type; 32 KiB blocks) holding protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = Path(path).read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7]) if left >= 7 else (0, 0)
        if left < 7 or (length, kind) == (0, 0):  # the rest of the block is padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("loggers") / "dump"
    r = _train(dump, "tensorboard,wandb,mlflow", extra=[f"--env.api_key={SECRET}"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert SECRET not in r.stdout + r.stderr
    return dump


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


@pytest.mark.slow
def test_an_offline_wandb_run_holds_every_step_and_the_config(logged):
    (path,) = glob.glob(str(logged / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            history[r.history.step.num] = row
    rows = read_rows(str(logged / "metrics.jsonl"))
    assert sorted(history) == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key, value in _numbers(row).items():
            assert history[row["step"]][key] == pytest.approx(value, rel=1e-12, abs=0), key
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for item in run.config.update
    }
    assert config["rl"]["num_samples"] == 4 and config["training"]["steps"] == STEPS
    assert config["job"]["dump_folder"] == str(logged) and run.display_name == "quickstart"
    assert json.loads((logged / "loggers.json").read_text())["wandb"] == run.run_id


@pytest.mark.slow
def test_a_local_mlflow_run_holds_every_step_and_the_config(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{logged}/mlflow.db")
    run_id = json.loads((logged / "loggers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "quickstart" and run.info.status == "FINISHED"
    rows = read_rows(str(logged / "metrics.jsonl"))
    for key in _numbers(rows[0]):
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == pytest.approx(
            {r["step"]: r[key] for r in rows if key in r}, rel=1e-12, abs=0
        ), key
    params = run.data.params
    assert params["rl.num_samples"] == "4" and params["training.steps"] == str(STEPS)
    assert params["metrics.loggers"] == str(["tensorboard", "wandb", "mlflow"])


def test_tensorboard_alone_needs_neither_package(tmp_path):
    """Importing wandb or mlflow fails in this run: it must not try."""
    blocked = tmp_path / "blocked"
    for name in ("wandb", "mlflow"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed here')\n"
        )
    r = _train(tmp_path / "dump", "tensorboard", PYTHONPATH=str(blocked))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "dump" / "tb").is_dir() and not (tmp_path / "dump" / "loggers.json").exists()


def test_a_logger_whose_package_is_missing_is_one_config_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["metrics.loggers=tensorboard,mlflow"])
    assert (
        str(e.value)
        == "metrics.loggers: 'mlflow' needs the mlflow package: pip install tandem-rl[mlflow]"
    )
    with pytest.raises(
        ConfigError, match=r"metrics.tensorboard: moved: list the loggers in metrics.loggers"
    ):
        load_config(QUICKSTART, ["metrics.tensorboard=false"])


@pytest.mark.slow
def test_the_secret_api_key_is_in_no_file_of_the_run(logged):
    """config.toml, metrics, the offline W&B run, MLflow's SQLite store: grep finds nothing."""
    files = [p for p in logged.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and (logged / "mlflow.db") in files
    assert [str(p) for p in files if SECRET.encode() in p.read_bytes()] == []
    toml = (logged / "config.toml").read_text()
    assert "# api_key: a secret, not written" in toml
    assert load_config(str(logged / "config.toml")).env.api_key is None  # reads back unset
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{logged}/mlflow.db")
    run_id = json.loads((logged / "loggers.json").read_text())["mlflow"]
    assert client.get_run(run_id).data.params["env.api_key"] == "<redacted>"


class _FakeWandb:
    """What WandbSink calls of the wandb package, recording init's arguments."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.kwargs = fail, None

    def init(self, **kwargs):
        if self.fail is not None:
            raise self.fail
        self.kwargs = kwargs
        return type("Run", (), {"id": "r1", "finish": lambda self: None})()


def test_wandb_honours_the_users_wandb_dir(tmp_path, monkeypatch):
    from tandem.rl.core.loggers import open_sinks

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    open_sinks(["wandb"], str(tmp_path), "run", {})
    assert fake.kwargs["dir"] == str(tmp_path)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    open_sinks(["wandb"], str(tmp_path), "run", {})
    assert fake.kwargs["dir"] == str(tmp_path / "mine")


def test_wandb_without_a_login_is_one_config_line(tmp_path, monkeypatch):
    from tandem.rl.core.loggers import open_sinks

    error = RuntimeError(
        "api_key not configured (no-tty). call wandb.login(key=[your_api_key])\n..."
    )
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb(fail=error))
    with pytest.raises(ConfigError) as e:
        open_sinks(["tensorboard", "wandb"], str(tmp_path), "run", {})
    assert str(e.value).startswith(
        "metrics.loggers: 'wandb' could not start: RuntimeError: api_key not configured (no-tty)"
    ) and "\n" not in str(e.value)


def test_secret_values_are_redacted_from_the_command_line_loggers_record():
    from tandem.rl.core.loggers import redact_argv

    cfg = load_config(QUICKSTART, [f"env.api_key={SECRET}"])
    argv = ["train.py", f"--env.api_key={SECRET}", "--env.api_key", SECRET, "--env.port=1"]
    assert redact_argv(argv, cfg) == [
        "train.py",
        "--env.api_key=<redacted>",
        "--env.api_key",
        "<redacted>",
        "--env.port=1",
    ]
