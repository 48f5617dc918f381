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

Asynchronous saves (``async_save=True``): the state is copied to CPU memory
while the step loop waits (the blocking part), then written by a background
thread over a gloo group of its own while training continues. The loop calls
``poll()`` once per step: when every rank's write has finished, the save is
committed as above (so a checkpoint is committed at most one step after its
write ends). ``wait()`` finishes and commits a pending save (the last step,
preemption); a new save first finishes the previous one.

Model-only checkpoints (``model_only=True``) hold the weights, trainer state
and RNG but no optimizer state (about 40 % of the bytes with AdamW); a resume
from one starts the optimizer afresh (the marker says so; ``load`` reports it).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
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

    def __init__(self, folder: str, *, keep_last: int = 2, async_save: bool = False,
                 model_only: bool = False) -> None:
        self.folder = folder
        self.keep_last = keep_last
        self.async_save = async_save
        self.model_only = model_only
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._pending: _Pending | None = None
        # Background writes need collectives of their own, off the training groups, and a
        # second group for the main thread's "has every rank finished?" all-reduce.
        distributed = async_save and dist.is_initialized()
        self._write_pg = dist.new_group(backend="gloo") if distributed else None
        self._sync_pg = dist.new_group(backend="gloo") if distributed else None

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def latest_step(self) -> int | None:
        steps = committed_steps(self.folder)
        return steps[-1] if steps else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any], extras: Extras | None = None) -> float:
        """Write ``step-N`` (committed now, or by ``poll``/``wait`` when asynchronous);
        returns the seconds the caller was blocked. ``extras`` are more (model,
        optimizer) pairs saved under their names (e.g. a PPO critic)."""
        t0 = time.monotonic()
        self.wait()
        staging = self.path(step) + ".partial"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging, exist_ok=True)
        _barrier()
        state = _state(model, None if self.model_only else optimizer, extras, self.model_only)
        os.makedirs(os.path.join(staging, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(staging, "rng", f"rank-{self.rank}.pt"))
        pending = _Pending(step, json.dumps(trainer_state), t0)
        if self.async_save:
            pending.future = dcp.async_save(state, checkpoint_id=staging, process_group=self._write_pg)
            self._pending = pending
        else:
            dcp.save(state, checkpoint_id=staging)
            self._commit(pending)
        return time.monotonic() - t0

    @property
    def pending_step(self) -> int | None:
        return self._pending.step if self._pending is not None else None

    def poll(self) -> float | None:
        """Commit the pending asynchronous save if every rank has written it; returns the
        save's total seconds (start to commit) when it committed now, else None.
        Collective (every rank calls it at the same point)."""
        if self._pending is None:
            return None
        unfinished = torch.tensor([0 if self._pending.future.done() else 1])
        if self._sync_pg is not None:
            dist.all_reduce(unfinished, group=self._sync_pg)  # ranks still writing
        if unfinished.item():
            return None
        return self.wait()

    def wait(self) -> float | None:
        """Finish and commit the pending asynchronous save (blocks until written);
        returns its total seconds, or None when nothing was pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.future.exception()
        failed = torch.tensor([1 if error is not None else 0])
        if self._sync_pg is not None:
            dist.all_reduce(failed, group=self._sync_pg)
        if failed.item():
            where = f"on this rank ({self.rank}): {error!r}" if error is not None else "on another rank"
            raise RuntimeError(f"checkpoint step-{pending.step}: the asynchronous write failed {where}; "
                               f"{self.path(pending.step)}.partial is left uncommitted")
        self._commit(pending)
        return time.monotonic() - pending.t0

    def _commit(self, pending: _Pending) -> None:
        step = pending.step
        final, staging = self.path(step), self.path(step) + ".partial"
        maybe_kill(step, self.rank, os.path.dirname(os.path.abspath(self.folder)), in_save=True)  # drills only
        _barrier()
        if self.rank == 0:
            with open(os.path.join(staging, "trainer.json"), "w") as f:
                f.write(pending.trainer_json)
            with open(os.path.join(staging, MARKER), "w") as f:
                f.write(f"step={step} world={self.world} model_only={int(self.model_only)}\n")
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(staging, final)
            self._prune()
        _barrier()

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
        return trainer state (with ``_saved_world`` and ``_model_only`` added). A
        model-only checkpoint leaves the optimizers as they are."""
        path = self.path(step)
        with open(os.path.join(path, MARKER)) as f:
            marker = dict(kv.split("=", 1) for kv in f.read().split())
        model_only = marker.get("model_only", "0") == "1"
        state = _state(model, None if model_only else optimizer, extras, model_only)
        dcp.load(state, checkpoint_id=path)
        for key, (m, o) in {"": (model, optimizer), **(extras or {})}.items():
            part = state[key] if key else state
            set_model_state_dict(m, part["model"])
            if o is not None and not model_only:
                set_optimizer_state_dict(m, o, part["optim"], options=_OPTIM)
        rng_file = os.path.join(path, "rng", f"rank-{self.rank}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        trainer["_saved_world"] = int(marker["world"])
        trainer["_model_only"] = model_only
        return trainer


def resume_note(trainer_state: dict[str, Any], world: int) -> str:
    """What a resume log line should add: resharding, a model-only checkpoint."""
    note = ""
    if trainer_state["_saved_world"] != world:
        note += f" (saved on {trainer_state['_saved_world']} ranks, now {world}: resharded)"
    if trainer_state["_model_only"]:
        note += " (model-only checkpoint: the optimizer state starts afresh)"
    return note


@dataclass
class _Pending:
    """A save whose shards are written (``future``: by DCP's background thread) but not
    yet committed by ``Checkpointer._commit``."""

    step: int
    trainer_json: str  # trainer state as it was at save time
    t0: float
    future: Future | None = None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, extras: Extras | None,
           model_only: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM)
    for name, (m, o) in (extras or {}).items():
        state[name] = _state(m, None if model_only else o, None)
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
