"""DCP checkpoints that cannot be half-written, and exact resume.

A save writes ``step-N.partial``; when every rank is done, rank 0 writes the COMMITTED
marker (with the hash of SHA256SUMS, every file's sha256) and renames the folder, so a
crash leaves either the old set of committed checkpoints or the new one. Loads verify the
sums first and fall back to the newest checkpoint that verifies; DCP reshards on load, so a
checkpoint resumes on another world size or layout. Asynchronous and model-only saves, and
the folder layout: docs/fault-tolerance.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tandem import device as seam
from tandem.rl.core.checkpoint_sums import (
    MARKER,
    CheckpointError,
    HashingWriter,
    read_manifest,
    read_marker,
    sha256,
    write_sums,
)
from tandem.rl.core.configlib import ConfigError
from tandem.rl.core.errors import NonFiniteError
from tandem.rl.core.metrics import truncate_jsonl
from tandem.rl.core.safe_load import SafePlanner, SafeReader, UnsafeCheckpointFile, load_rng

if TYPE_CHECKING:
    from tandem.rl.config.schema import CheckpointConfig

# Optimizer state keyed by parameter name ("state.layers.0.x.exp_avg",
# "param_groups.layers.0.x.lr"): every rank's own entries, so pipeline stages (different parameters
# per rank) save and load their hyperparameters too, and a checkpoint moves between layouts.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_RE = re.compile(r"^step-(\d+)$")


Extras = dict[str, tuple[nn.Module, "torch.optim.Optimizer | None"]]  # name -> (model, optimizer)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    accelerator = seam.rng_state()  # keyed by device type ("cuda" as before)
    if accelerator is not None:
        state[accelerator[0]] = accelerator[1]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if seam.accelerator_type() in state:
        seam.set_rng_state(seam.accelerator_type(), state[seam.accelerator_type()])


def committed_steps(folder: str) -> list[int]:
    """Steps of committed checkpoints under ``folder`` (marker present; not verified), ascending."""
    return [
        s for s in step_folders(folder) if os.path.exists(os.path.join(folder, f"step-{s}", MARKER))
    ]


def step_folders(folder: str) -> list[int]:
    """Steps of every ``step-N`` folder under ``folder``, committed or not (``.partial`` excluded),
    ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_RE.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


class Checkpointer:
    """Save and load policy + optimizer + trainer state with DCP."""

    def __init__(
        self,
        folder: str,
        *,
        keep_last: int = 2,
        async_save: bool = False,
        model_only: bool = False,
        before_commit: Callable[[int], None] | None = None,
    ) -> None:
        """``before_commit(step)`` runs on every rank after a step's shards are written and
        before its commit (the shell's fault drill kills a rank there)."""
        self.folder = folder
        self.before_commit = before_commit
        self.keep_last = keep_last
        self.async_save = async_save
        self.model_only = model_only
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._pending: _Pending | None = None
        # Steps this process committed or verified (good) or found damaged (bad); pruning
        # counts only these and never runs while the newest committed step is not good.
        self._good: set[int] = set()
        self._bad: set[int] = set()
        # Background writes need collectives of their own, off the training groups, and a
        # second group for the main thread's "has every rank finished?" all-reduce.
        distributed = async_save and dist.is_initialized()
        self._write_pg = dist.new_group(backend="gloo") if distributed else None
        self._sync_pg = dist.new_group(backend="gloo") if distributed else None

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def latest_step(self) -> int | None:
        """The newest committed step (not verified: `resume_step` picks the newest that
        verifies)."""
        steps = committed_steps(self.folder)
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        trainer_state: dict[str, Any],
        extras: Extras | None = None,
    ) -> float:
        """Write ``step-N`` (committed now, or by ``poll``/``wait`` when asynchronous);
        returns the seconds the caller was blocked. ``extras`` are more (model,
        optimizer) pairs saved under their names (e.g. a PPO critic).

        Raises NonFiniteError (exit 7), whatever ``fault.on_nonfinite`` says, when a
        weight on any rank is NaN/Inf: nothing of the step is written, and the
        checkpoints already committed stay as they are."""
        t0 = time.monotonic()
        self.wait()
        _check_finite_weights(step, [model] + [m for m, _ in (extras or {}).values()], self.rank)
        staging = self.path(step) + ".partial"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging, exist_ok=True)
        _barrier()
        state = _state(model, None if self.model_only else optimizer, extras, self.model_only)
        os.makedirs(os.path.join(staging, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(staging, "rng", f"rank-{self.rank}.pt"))
        pending = _Pending(step, json.dumps(trainer_state), t0)
        writer = HashingWriter(staging)
        try:
            if self.async_save:
                pending.future = dcp.async_save(
                    state, storage_writer=writer, process_group=self._write_pg
                )
                self._pending = pending
            else:
                dcp.save(state, storage_writer=writer)
        except CheckpointException as e:  # a BaseException: what DCP wraps (SIGINT included)
            raise _dcp_error(
                e, f"checkpoint step-{step}: writing failed; {staging} is left uncommitted"
            ) from None
        if not self.async_save:
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
            where = "on another rank" if error is None else f"on this rank ({self.rank})"
            msg = (
                f"checkpoint step-{pending.step}: the asynchronous write failed {where}; "
                f"{self.path(pending.step)}.partial is left uncommitted"
            )
            raise _dcp_error(error, msg) if error is not None else CheckpointError(msg)
        self._commit(pending)
        return time.monotonic() - pending.t0

    def _commit(self, pending: _Pending) -> None:
        step = pending.step
        final, staging = self.path(step), self.path(step) + ".partial"
        if self.before_commit is not None:
            self.before_commit(step)
        _barrier()
        if self.rank == 0:
            with open(os.path.join(staging, "trainer.json"), "w") as f:
                f.write(pending.trainer_json)
            sums_hash = write_sums(staging)
            with open(os.path.join(staging, MARKER), "w") as f:
                f.write(
                    f"step={step} world={self.world} model_only={int(self.model_only)} "
                    f"sha256sums={sums_hash}\n"
                )
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):  # only a damaged one (resume_step passed it over) can be here
                shutil.rmtree(final)
            os.rename(staging, final)
        self._good.add(step)
        self._bad.discard(step)
        if self.rank == 0:
            self._prune()
        _barrier()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` checkpoints not known to be damaged; delete older
        ones. Nothing is deleted while the newest committed one is not known good."""
        steps = committed_steps(self.folder)
        if steps and steps[-1] in self._good:
            keep = [s for s in steps if s not in self._bad][-self.keep_last :]
            for s in steps:
                if s < keep[0]:
                    shutil.rmtree(self.path(s), ignore_errors=True)
        for name in os.listdir(self.folder):
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def verify(self, step: int) -> str | None:
        """Why ``step-N`` is not the checkpoint that was committed (one line), or None when
        every file matches SHA256SUMS. Collective: the ranks split the files to hash,
        and every rank returns the same answer. Remembers the result for pruning and `load`."""
        path = self.path(step)
        reason, files = read_manifest(path, step)
        first_bad = len(files)
        for i in range(self.rank, len(files), self.world):  # rank r hashes files r, r + world, ...
            full = os.path.join(path, files[i][0])
            if not os.path.isfile(full) or sha256(full) != files[i][1]:
                first_bad = i
                break
        first_bad = _all_min(first_bad if reason is None else -1)
        if reason is None and first_bad < len(files):
            name = files[first_bad][0]
            what = (
                "is missing"
                if not os.path.isfile(os.path.join(path, name))
                else "differs from its sha256 at commit"
            )
            reason = f"{name} {what}"
        elif reason is None and first_bad < 0:
            reason = "a rank could not read its manifest"  # file system not the same on every rank
        (self._bad if reason else self._good).add(step)
        (self._good if reason else self._bad).discard(step)
        return f"{path}: {reason}" if reason else None

    def load(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extras: Extras | None = None,
    ) -> dict[str, Any]:
        """Load ``step-N`` into model/optimizer (and ``extras``), resharding as needed;
        return trainer state (with ``_saved_world`` and ``_model_only`` added). A
        model-only checkpoint leaves the optimizers as they are. The checkpoint is
        verified first (unless this process just verified or wrote it); a damaged one
        raises CheckpointError and loads nothing."""
        path = self.path(step)
        if step not in self._good:
            reason = self.verify(step)
            if reason is not None:
                raise CheckpointError(f"checkpoint {reason}; not loaded")
        marker = read_marker(path, step)
        model_only = marker["model_only"] == "1"
        state = _state(model, None if model_only else optimizer, extras, model_only)
        other = _model_difference(path, state)
        if other is not None:
            raise CheckpointError(
                f"checkpoint {path} was written by another model: {other}; "
                "resume it with that model, or start over with "
                "checkpoint.resume=false checkpoint.overwrite=true (or another "
                "job.dump_folder)"
            )
        try:
            dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise _dcp_error(e, f"checkpoint {path}: cannot be loaded into this model") from None
        for key, (m, o) in {"": (model, optimizer), **(extras or {})}.items():
            part = state[key] if key else state
            if part["model"]:
                set_model_state_dict(m, part["model"])
            if o is not None and not model_only:
                set_optimizer_state_dict(m, o, part["optim"], options=_OPTIM)
        self._load_rng(path, step)
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        trainer["_saved_world"] = int(marker["world"])
        trainer["_model_only"] = model_only
        return trainer

    def _load_rng(self, path: str, step: int) -> None:
        """This rank's RNG state, when the manifest lists one for it (a resume on more ranks
        than saved finds none: the new ranks keep their seeded streams), read as plain data."""
        name = f"rng/rank-{self.rank}.pt"
        _, files = read_manifest(path, step)
        if name not in {n for n, _ in files}:
            return
        try:
            set_rng_state(load_rng(os.path.join(path, name)))
        except UnsafeCheckpointFile as e:
            raise CheckpointError(f"checkpoint {path}: {name} {e}; not loaded") from None


def resume_step(
    ckpt: Checkpointer,
    cfg: CheckpointConfig,
    total_steps: int,
    is_main: bool,
    *,
    logs: Sequence[str] = (),
) -> int | None:
    """The step to resume from (load it with ``ckpt.load``), or None to start at step 0.

    Collective (every rank calls it; every rank gets the same answer):

    - ``checkpoint.enable = false``: None; nothing is read or removed.
    - ``checkpoint.resume = true``: the newest ``step-N`` that verifies. Newer ones that
      do not are passed over with one line on stderr naming each and why, and kept
      (a later save of the same step replaces it; pruning leaves the good ones alone).
    - No checkpoint to resume from (none verifies, or ``resume = false``) while
      ``step-N`` folders exist: CheckpointError (exit 8) naming them, unless
      ``checkpoint.overwrite = true``; then they are deleted (one line says so; a
      ``step-N`` that is a symbolic link is unlinked, its target kept) and the jsonl
      ``logs`` (metrics.jsonl, ledger.jsonl) of that earlier run are emptied.
    - A checkpoint past ``total_steps`` (training.steps): ConfigError (exit 2).
    """
    if not cfg.enable:
        return None
    existing = step_folders(ckpt.folder)
    damaged: list[str] = []
    if cfg.resume:
        for step in reversed(existing):
            reason = ckpt.verify(step)
            if reason is None:
                if damaged and is_main:
                    print(
                        f"warning: passed over {len(damaged)} damaged checkpoint(s): "
                        f"{'; '.join(damaged)}; resuming from {ckpt.path(step)}, the newest "
                        "that verifies",
                        file=sys.stderr,
                        flush=True,
                    )
                if step > total_steps:
                    raise ConfigError(
                        f"training.steps: {total_steps} is below the step of the "
                        f"checkpoint to resume ({ckpt.path(step)}); raise "
                        "training.steps, or start over with checkpoint.resume=false "
                        "checkpoint.overwrite=true"
                    )
                if is_main:
                    for log in logs:
                        truncate_jsonl(log, step)
                return step
            damaged.append(reason)
    if not existing:
        return None
    names = ", ".join(f"step-{s}" for s in existing)
    if not cfg.overwrite:
        why = f"none verifies ({'; '.join(damaged)})" if cfg.resume else "checkpoint.resume = false"
        raise CheckpointError(
            f"{ckpt.folder} holds checkpoints of an earlier run ({names}) and "
            f"{why}; refusing to start at step 0 over them: set "
            "checkpoint.overwrite=true to delete them and start over, or choose "
            "another job.dump_folder"
        )
    if is_main:
        for s in existing:  # a step-N that is a symbolic link goes, never what it points to
            path = ckpt.path(s)
            if os.path.islink(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        for log in logs:
            truncate_jsonl(log, 0)
        print(
            f"checkpoint.overwrite: deleted the earlier run's checkpoints ({names}) under "
            f"{ckpt.folder}; starting at step 0",
            file=sys.stderr,
            flush=True,
        )
    _barrier()
    return None


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


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extras: Extras | None,
    model_only: bool = False,
) -> dict[str, Any]:
    # a rank that holds none of the model (a split run's generator) saves and loads nothing
    holds = any(True for _ in model.parameters()) or any(True for _ in model.buffers())
    state: dict[str, Any] = {"model": get_model_state_dict(model) if holds else {}}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM)
    for name, (m, o) in (extras or {}).items():
        state[name] = _state(m, None if model_only else o, None)
    return state


def _dcp_error(e: BaseException, what: str) -> BaseException:
    """One line for a DCP failure: KeyboardInterrupt when it wraps one (SIGINT during a save
    or load exits 130), else a CheckpointError naming the first rank's exception."""
    failures = e.failures if isinstance(e, CheckpointException) else {0: (e, None)}
    causes = [exc for exc, _ in failures.values()]
    if any(isinstance(exc, KeyboardInterrupt) for exc in causes):
        return KeyboardInterrupt()
    first = causes[0] if causes else e
    text = str(first).strip().splitlines()[0] if str(first).strip() else ""
    return CheckpointError(f"{what}: {type(first).__name__}{': ' + text if text else ''}")


def _model_difference(path: str, state: dict[str, Any]) -> str | None:
    """How the model parts of ``state`` (every rank's, so pipeline stages add up) differ from
    what checkpoint ``path`` holds for them, by parameter name and global shape (DCP's own
    ``.metadata``, covered by SHA256SUMS); None when they are the same. Collective."""
    here: dict[str, list[int] | None] = {}
    prefixes: list[str] = []  # "model." and "<extra>.model."
    parts = [("", state)]
    while parts:
        prefix, part = parts.pop()
        prefixes.append(f"{prefix}model.")
        for name, t in part["model"].items():
            here[f"{prefix}model.{name}"] = list(t.shape) if isinstance(t, torch.Tensor) else None
        parts += [(f"{prefix}{k}.", v) for k, v in part.items() if k not in ("model", "optim")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, here)
        here = {k: v for d in every for k, v in (d or {}).items()}
    saved = {
        k: list(v.size) if isinstance(v, TensorStorageMetadata) else None
        for k, v in _read_metadata(path).state_dict_metadata.items()
        if k.startswith(tuple(prefixes))
    }
    shape = sorted(k for k in here.keys() & saved.keys() if here[k] != saved[k])
    missing, unused = sorted(here.keys() - saved.keys()), sorted(saved.keys() - here.keys())
    count = len(shape) + len(missing) + len(unused)
    if not count:
        return None
    first = (
        f"{shape[0]} is {saved[shape[0]]} there and {here[shape[0]]} here"
        if shape
        else f"{missing[0]} of this model is not in the checkpoint"
        if missing
        else f"the checkpoint's {unused[0]} is not in this model"
    )
    return first + (f" ({count - 1} more parameters differ)" if count > 1 else "")


def _read_metadata(path: str) -> Any:
    try:
        return SafeReader(path).read_metadata()
    except (OSError, UnsafeCheckpointFile) as e:
        raise CheckpointError(f"checkpoint {path}: {e}; not loaded") from None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _all_min(value: int) -> int:
    """The minimum of ``value`` over all ranks (default group; CPU tensors go over gloo)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _check_finite_weights(step: int, models: list[nn.Module], rank: int) -> None:
    """Raise NonFiniteError on every rank when any rank holds a NaN/Inf weight (its local
    shards). One multi-tensor norm per model part (a NaN/Inf element makes its tensor's
    norm non-finite; 16 ms for 100M fp32 parameters on a 2-core CPU, against 190 ms for
    ``isfinite().all()`` per tensor), an exact check only of tensors it flags (finite
    values can overflow a norm), one host sync per part and one all-reduce."""
    bad_name = None
    for model in models:
        named = [
            (n, t.to_local() if isinstance(t, DTensor) else t)
            for n, t in model.state_dict().items()
        ]
        named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
        if not named:
            continue
        norms = torch.stack(
            [x.float().to(named[0][1].device) for x in torch._foreach_norm([t for _, t in named])]
        )
        flagged = (~torch.isfinite(norms)).nonzero().flatten().tolist()  # one host sync
        bad_name = next(
            (named[i][0] for i in flagged if not bool(torch.isfinite(named[i][1]).all())), None
        )
        if bad_name is not None:
            break
    first_bad_rank = _all_min(rank if bad_name is not None else 1 << 62)
    if first_bad_rank == 1 << 62:
        return
    where = f"{bad_name} on rank {rank}" if bad_name is not None else f"rank {first_bad_rank}"
    raise NonFiniteError(
        f"checkpoint step-{step}: refusing to save non-finite weights ({where}); "
        "nothing was written and the committed checkpoints are kept",
        {"step": step, "rank": rank, "tensor": bad_name, "phase": "checkpoint"},
    )
