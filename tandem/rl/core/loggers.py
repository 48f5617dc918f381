"""Where step metrics go besides metrics.jsonl: tensorboard, Weights & Biases, MLflow.

``metrics.loggers`` names them; rank 0 alone writes. Each sink gets the run's name
(``job.name``), the resolved config once, then every logged step's numbers. wandb and mlflow
are optional packages (``pip install tandem-rl[wandb]`` / ``[mlflow]``), imported only when
named. A run that resumes in its dump folder continues the same W&B / MLflow run: the run id is
kept in ``<dump>/loggers.json``. Their usual environment variables apply (``WANDB_PROJECT``,
``WANDB_MODE=offline``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``); without
``MLFLOW_TRACKING_URI`` MLflow writes to ``sqlite:///<dump>/mlflow.db``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.rl.core.configlib import REDACTED, ConfigError, to_dict

LOGGERS = ("tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "loggers.json"


def missing_package(name: str) -> str | None:
    """Why logger ``name`` cannot run here (its package is not installed), or None."""
    if importlib.util.find_spec(PACKAGES[name]) is None:
        return f"{name!r} needs the {PACKAGES[name]} package: pip install tandem-rl[{name}]"
    return None


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def text(self, tag: str, text: str, step: int) -> None: ...
    def close(self) -> None: ...


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"rl": {"lr": 1}} -> {"rl.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _RunIds:
    """The W&B / MLflow run ids of this dump folder, so a resumed job logs to the same runs."""

    def __init__(self, dump_folder: str) -> None:
        self.path = os.path.join(dump_folder, IDS_FILE)
        self.ids: dict[str, str] = {}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                self.ids = json.load(f)

    def set(self, name: str, run_id: str) -> None:
        self.ids[name] = run_id
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.ids, f)
        os.replace(tmp, self.path)


class TensorBoardSink:
    def __init__(self, dump_folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

        self.writer = SummaryWriter(os.path.join(dump_folder, "tb"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(
        self, dump_folder: str, run_name: str, config: dict[str, Any], ids: _RunIds
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "tandem"),
            name=run_name,
            dir=os.environ.get("WANDB_DIR") or dump_folder,  # the user's WANDB_DIR wins
            config=config,
            id=ids.ids.get("wandb"),
            resume="allow",
        )
        ids.set("wandb", self.run.id)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        pass  # the samples' text stays in samples.jsonl and tensorboard

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    PARAMS_PER_CALL = 100  # MLflow's batch limit
    MAX_PARAM_CHARS = 500

    def __init__(
        self, dump_folder: str, run_name: str, config: dict[str, Any], ids: _RunIds
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = (
            os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{os.path.abspath(dump_folder)}/mlflow.db"
        )
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = ids.ids.get("mlflow")
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "tandem")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            ids.set("mlflow", self.run_id)
            params = [
                Param(k, str(v)[: self.MAX_PARAM_CHARS]) for k, v in sorted(flatten(config).items())
            ]
            for i in range(0, len(params), self.PARAMS_PER_CALL):
                self.client.log_batch(self.run_id, params=params[i : i + self.PARAMS_PER_CALL])
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def redact_argv(argv: Sequence[str], cfg: Any) -> list[str]:
    """``argv`` with the values given to config ``cfg``'s secret keys (configlib.SECRET)
    replaced by REDACTED (``--env.api_key=V``, ``--env.api_key V``): W&B records the command
    line with the run."""
    flags = {f"--{k}" for k, v in flatten(to_dict(cfg, redact=True)).items() if v == REDACTED}
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, _ = arg.partition("=")
        if name in flags and eq:
            out[i] = f"{name}={REDACTED}"
        elif arg in flags and i + 1 < len(out):
            out[i + 1] = REDACTED
    return out


def open_sinks(
    names: list[str], dump_folder: str, run_name: str, config: dict[str, Any]
) -> list[Sink]:
    """The loggers of ``names``; one that cannot start (W&B without a login, an MLflow store
    that cannot be opened) is a ConfigError naming it, in one line (exit 2)."""
    ids = _RunIds(dump_folder)
    sinks: list[Sink] = []
    for name in names:
        try:
            if name == "tensorboard":
                sinks.append(TensorBoardSink(dump_folder))
            elif name == "wandb":
                sinks.append(WandbSink(dump_folder, run_name, config, ids))
            elif name == "mlflow":
                sinks.append(MLflowSink(dump_folder, run_name, config, ids))
        except Exception as e:  # noqa: BLE001  (each package raises its own kinds)
            for sink in sinks:
                sink.close()
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"metrics.loggers: {name!r} could not start: {type(e).__name__}: {first} "
                "(wandb: run `wandb login` or set WANDB_MODE=offline; or leave it out of "
                "metrics.loggers)"
            ) from None
    return sinks


def finite_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
