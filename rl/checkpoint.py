"""DCP checkpoints that cannot be half-written, and exact resume.

Layout under ``<dump_folder>/<checkpoint.folder>/``::

    step-120/            committed checkpoint (DCP shards + .metadata)
      COMMITTED          marker, written last, before the rename
      trainer.json       step, data position, and other trainer state (rank 0)
      rng/rank-0.pt      per-rank RNG states (torch.save; not sharded)
    step-180.partial/    a save in progress or interrupted: ignored

A save writes into ``step-N.partial``, every rank finishes, then rank 0 writes
the marker and renames the folder: a crash at any moment leaves either the
old set of committed checkpoints or the new one. The loader only considers
folders with the marker. DCP reshards model and optimizer state on load, so a
checkpoint written by N ranks loads on M ranks and another layout.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rl.fault.inject import maybe_kill

MARKER = "COMMITTED"
# Optimizer state keyed by parameter name ("state.layers.0.x.exp_avg", "param_groups.layers.0.x.lr"):
# every rank's own entries, so pipeline stages (different parameters per rank) save and
# load their hyperparameters too, and a checkpoint moves between layouts.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_RE = re.compile(r"^step-(\d+)$")


Extras = dict[str, tuple[nn.Module, "torch.optim.Optimizer | None"]]  # name -> (model, optimizer)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def committed_steps(folder: str) -> list[int]:
    """Steps of committed checkpoints under ``folder``, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_RE.match(name)
        if m and os.path.exists(os.path.join(folder, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


class Checkpointer:
    """Save and load policy + optimizer + trainer state with DCP."""

    def __init__(self, folder: str, *, keep_last: int = 2) -> None:
        self.folder = folder
        self.keep_last = keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def latest_step(self) -> int | None:
        steps = committed_steps(self.folder)
        return steps[-1] if steps else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any], extras: Extras | None = None) -> float:
        """Write and commit ``step-N``; returns seconds taken. ``extras`` are more
        (model, optimizer) pairs saved under their names (e.g. a PPO critic)."""
        t0 = time.monotonic()
        final, staging = self.path(step), self.path(step) + ".partial"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging, exist_ok=True)
        _barrier()
        state = _state(model, optimizer, extras)
        dcp.save(state, checkpoint_id=staging)
        maybe_kill(step, self.rank, os.path.dirname(os.path.abspath(self.folder)), in_save=True)  # drills only
        os.makedirs(os.path.join(staging, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(staging, "rng", f"rank-{self.rank}.pt"))
        _barrier()
        if self.rank == 0:
            with open(os.path.join(staging, "trainer.json"), "w") as f:
                json.dump(trainer_state, f)
            with open(os.path.join(staging, MARKER), "w") as f:
                f.write(f"step={step} world={self.world}\n")
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(staging, final)
            self._prune()
        _barrier()
        return time.monotonic() - t0

    def _prune(self) -> None:
        steps = committed_steps(self.folder)
        for s in steps[: max(len(steps) - self.keep_last, 0)]:
            shutil.rmtree(self.path(s), ignore_errors=True)
        for name in os.listdir(self.folder):
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             extras: Extras | None = None) -> dict[str, Any]:
        """Load ``step-N`` into model/optimizer (and ``extras``), resharding as needed;
        return trainer state."""
        path = self.path(step)
        state = _state(model, optimizer, extras)
        dcp.load(state, checkpoint_id=path)
        for key, (m, o) in {"": (model, optimizer), **(extras or {})}.items():
            part = state[key] if key else state
            set_model_state_dict(m, part["model"])
            if o is not None:
                set_optimizer_state_dict(m, o, part["optim"], options=_OPTIM)
        rng_file = os.path.join(path, "rng", f"rank-{self.rank}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        with open(os.path.join(path, MARKER)) as f:
            trainer["_saved_world"] = int(f.read().split("world=")[1].split()[0])
        return trainer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, extras: Extras | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM)
    for name, (m, o) in (extras or {}).items():
        state[name] = _state(m, o, None)
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
