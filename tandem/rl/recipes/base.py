"""What a recipe is, and the pieces every recipe shares with the shell (tandem/rl/recipes/loop.py).

A recipe is a small object that knows how to take one training step of its
kind (supervised, pairwise, rollout-then-update) and nothing about resuming,
saving, preemption, hang detection, logging cadence or export: the shell owns
those, identically for every recipe. The protocol:

    checkpoint_parts() -> CheckpointParts   what DCP saves and loads
    state_dict() / load_state_dict(state)   JSON-able trainer state (schedules, data position)
    step(step) -> StepOutput                one optimizer step (``step`` counts from 0)
    evaluate() -> dict                      held-out metrics, keys "eval/<name>"; {} when none
    export(dump_folder) -> str | None       the final model (collective); the path written
    close()                                 worker pools and the like

and an ``updater`` attribute (`Updater`). Adding a recipe is one file: a class
with these and one line in `tandem.rl.recipes.RECIPES`.

`Updater` is the one NaN/Inf rule for every recipe: a guarded optimizer update
either applies or is skipped (counted as ``fault/skipped_updates``), and in
both cases the learning-rate schedule advances, so the learning rate is a
function of the update count alone and a skipped update never shifts the
schedule of the rest of the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.models.args import ModelArgs
from tandem.models.tokenizer import Tokenizer
from tandem.parallel.cp import ContextParallel
from tandem.parallel.distributed import DistInfo
from tandem.parallel.mesh import Degrees, build_mesh, dp_rank
from tandem.parallel.split import side_mesh
from tandem.rl.config.composes import Facts, check_composes
from tandem.rl.config.schema import ConfigError, FaultConfig
from tandem.rl.core.lora import checkpoint_module
from tandem.rl.core.metrics import MetricsLogger
from tandem.rl.core.modeling import build_tokenizer, model_args
from tandem.rl.core.optim import Learner
from tandem.rl.fault import Rollback, Watchdog, check_finite
from tandem.rl.fault.inject import in_update, nan_at, spike_at
from tandem.rl.update.policy import check_layout, context_parallel

Extras = dict[str, tuple[nn.Module, "torch.optim.Optimizer | None"]]


@dataclass
class CheckpointParts:
    """The modules and optimizers one checkpoint holds: the main model (its parameter
    names are the checkpoint's), its optimizer, and named extras (e.g. a PPO critic)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    extras: Extras = field(default_factory=dict)

    def __post_init__(self) -> None:
        # LoRA: the trainable parameters alone (the base is rebuilt at start)
        self.model = checkpoint_module(self.model)
        self.extras = {k: (checkpoint_module(m), o) for k, (m, o) in self.extras.items()}


@dataclass
class StepOutput:
    """What one step gives the shell: its metrics, and the ids of the examples this rank
    trained on (written to ledger.jsonl, which proves every step ran exactly once) and their
    positions in the data stream (each trained at most once over the whole run)."""

    metrics: dict[str, float]
    ids: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # ranks compared with each other for stragglers (split mode: "generators" / "trainers");
    # "" for all ranks alike
    health_group: str = ""


@dataclass
class Runtime:
    """What the shell hands a recipe at construction."""

    info: DistInfo
    dump_folder: str
    watchdog: Watchdog  # recipes mark their own phases (rollout, update) inside the shell's "step"
    logger: MetricsLogger  # for text summaries; step rows are the shell's
    # whether this rank received a stop signal (its own flag, not agreed): a wait on the outside
    # world polls it and raises errors.StepInterrupted (the http rollout's wait for a harness)
    stop_requested: Callable[[], bool] = lambda: False


@dataclass
class Setup:
    """What every recipe builds first: the training mesh and this rank's data-parallel place in
    it, the tokenizer and the model's architecture."""

    degrees: Degrees
    mesh: DeviceMesh
    dp: int  # data-parallel ranks
    rank_dp: int  # this rank's index among them
    tokenizer: Tokenizer
    args: ModelArgs
    facts: Facts  # what the table of what composes was checked with (a recipe adds to it)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def row_split(self, parallel: Any) -> ContextParallel | None:
        """The cp group the sft and pairwise recipes split their rows over (None: cp = 1), the
        model's heads checked against ``parallel.cp_style`` first (one ConfigError line)."""
        check_layout(self.args, self.degrees, parallel.pp_schedule, parallel.cp_style)
        cp = context_parallel(self.mesh, parallel.cp_style)
        return cp if cp.size > 1 else None


def setup(
    cfg: Any,
    rt: Runtime,
    recipe: str,
    *,
    batch: tuple[str, int],
    ranks: tuple[int, int] | None = None,
) -> Setup:
    """The set-up every recipe shares, its config checks first (one ConfigError line each):
    ``data.path``, the global ``batch`` (key, value) dividing over the data-parallel ranks,
    and the table of what composes (tandem/rl/config/composes.py) with the model, the world
    and the device known.

    ``ranks`` (first, count): the training mesh covers global ranks ``first .. first + count - 1``
    only (split mode's trainers; collective over the world all the same); by default the whole
    world. A rank outside the mesh gets ``rank_dp`` 0."""
    first, count = ranks or (0, rt.info.world_size)
    degrees = Degrees(**cfg.parallel.resolve(count))
    if cfg.data.path is None:
        raise ConfigError(
            f"data.path: required by the {recipe} recipe (a jsonl/parquet file or "
            "folder, or synthetic:<task>)"
        )
    key, size = batch
    if size % degrees.dp:
        raise ConfigError(f"{key}: {size} is not divisible by the {degrees.dp} data-parallel ranks")
    if ranks is None:
        mesh = build_mesh(degrees, rt.info.device)
    else:
        mesh = side_mesh(degrees, rt.info.device, first)
    inside = first <= rt.info.rank < first + count
    m = cfg.model
    tokenizer = build_tokenizer(m.tokenizer, m.path, os.path.join(rt.dump_folder, "tokenizer"))
    args = model_args(m.flavor, m.path, tokenizer)
    facts = Facts(cfg, args=args, world=rt.info.world_size, device=rt.info.device.type)
    check_composes(facts)
    return Setup(degrees, mesh, degrees.dp, dp_rank(mesh) if inside else 0, tokenizer, args, facts)


class Recipe(Protocol):
    console_keys: tuple[str, ...]  # metrics printed on the console line
    updater: Updater  # the shell logs its learning rate and skipped-update count

    def checkpoint_parts(self) -> CheckpointParts: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, saved_world: int) -> None: ...

    def step(self, step: int) -> StepOutput: ...

    def evaluate(self) -> dict[str, float]: ...

    def export(self, dump_folder: str) -> str | None: ...

    def close(self) -> None: ...


class Updater:
    """Optimizer updates under the run's NaN/Inf policy (``fault.on_nonfinite``).

    ``apply(loss, step, learners)`` checks the loss and the gradients of every learner's
    modules on all ranks (tandem/rl/fault/nan.py). Finite: each of ``learners`` (default:
    all; a critic warming up steps alone) clips and steps. Not finite under "skip": every
    gradient is dropped and the update counted. Under "stop" the check raises
    NonFiniteError (exit 7); under "rollback" `Rollback` (the shell reloads the last
    checkpoint and adds the step to ``skip_steps``, whose updates are then skipped like
    "skip"'s). Otherwise the stepped learners' schedules advance by one and every gradient
    is zeroed. The first learner's schedule is the run's ``last_lr``.
    """

    def __init__(
        self,
        learners: Sequence[Learner],
        *,
        fault: FaultConfig,
        dump_folder: str,
        rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group  # the ranks that update together (None: the whole world)
        self.learners = list(learners)
        self.fault, self.dump_folder, self.rank = fault, dump_folder, rank
        self.skipped = 0
        self.last_lr = self._lr()  # the learning rate of the latest update
        self.skip_steps: set[int] = set()  # steps (from 1) a rollback skips (the shell's)
        self.norm_history: list[tuple[int, float]] = []  # (step, gradient norm): the spike rule

    def _lr(self) -> float:
        sched = self.learners[0].scheduler
        if sched is not None:
            return sched.get_last_lr()[0]
        return self.learners[0].optimizer.param_groups[0]["lr"]

    def apply(
        self, loss: torch.Tensor, step: int, learners: Sequence[Learner] | None = None
    ) -> dict[str, float]:
        """One guarded update of ``learners`` (default: all); returns each stepped learner's
        gradient norm by name ({} when the update was skipped)."""
        stepping = self.learners if learners is None else list(learners)
        in_update(step + 1, self.rank)  # fault drills (TANDEM_INJECT_SLOW / _STOP)
        if nan_at(step + 1):  # fault drill (TANDEM_INJECT_NAN)
            loss = loss * float("nan")
        modules = [m for learner in self.learners for m in learner.modules]
        if spike_at(step + 1):  # fault drill (TANDEM_INJECT_SPIKE): 1000x gradients
            for p in (p for m in modules for p in m.parameters() if p.grad is not None):
                p.grad.mul_(1000.0)
        policy = self.fault.on_nonfinite
        if step + 1 in self.skip_steps:
            policy = "skip"  # a rollback's step: skipped whatever it holds
        finite = check_finite(
            loss,
            modules,
            step + 1,
            self.rank,
            policy,
            dump_folder=self.dump_folder,
            group=self.group,
        )
        if step + 1 in self.skip_steps:  # a rollback's step: its prompts are not trained on
            finite = False
        elif not finite and policy == "rollback":
            self._drop_gradients()
            raise Rollback(step + 1)
        if self.learners[0] in stepping:
            self.last_lr = self._lr()
        norms: dict[str, float] = {}
        if finite:
            for learner in stepping:
                norms[learner.name] = learner.clip(learner.max_grad_norm)
            if self._spiked(step + 1, norms):
                self._drop_gradients()
                raise Rollback(
                    step + 1, f"gradient-norm spike ({norms[self.learners[0].name]:.4g})"
                )
            for learner in stepping:
                learner.optimizer.step()
        else:
            self.skipped += 1
        for learner in stepping:
            if learner.scheduler is not None:
                learner.scheduler.step()
        for learner in self.learners:
            learner.optimizer.zero_grad(set_to_none=True)
        return norms

    def _drop_gradients(self) -> None:
        for learner in self.learners:
            learner.optimizer.zero_grad(set_to_none=True)

    def _spiked(self, step: int, norms: dict[str, float]) -> bool:
        """``fault.spike_zscore``: whether the first learner's gradient norm is more than that
        many standard deviations above the mean of its last 50 values from earlier steps (at
        least 5 of them). Every rank has the same norm (clipping all-reduces it)."""
        norm = norms.get(self.learners[0].name)
        if self.fault.spike_zscore <= 0 or norm is None:
            return False
        before = [n for s, n in self.norm_history if s < step][-50:]
        self.norm_history.append((step, norm))
        if len(before) < 5:
            return False
        mean = sum(before) / len(before)
        std = (sum((n - mean) ** 2 for n in before) / len(before)) ** 0.5
        return std > 0 and (norm - mean) / std > self.fault.spike_zscore

    def forget_after(self, step: int) -> None:
        """A rollback to ``step``: the spike rule's history of the steps after it goes."""
        self.norm_history = [(s, n) for s, n in self.norm_history if s <= step]


class SingleModelTraining:
    """One trained model with its AdamW, LR schedule (over ``training.steps``) and `Updater`:
    the optimisation and checkpoint state the sft and pairwise recipes share. The recipe
    exposes ``updater`` (the shell reads its counters) and delegates the checkpoint methods."""

    def __init__(self, model: nn.Module, cfg: Any, dump_folder: str, rank: int) -> None:
        from tandem.parallel.grad import clip_grad_norm
        from tandem.rl.core.optim import build_optimizer, build_scheduler

        o, s = cfg.optimizer, cfg.lr_schedule
        self.model = model
        self.optimizer = build_optimizer(
            model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            total_steps=cfg.training.steps,
            warmup_steps=s.warmup_steps,
            decay=s.decay,
            min_lr_ratio=s.min_lr_ratio,
        )
        learner = Learner(
            "model",
            [model],
            self.optimizer,
            lambda max_norm: clip_grad_norm(model.parameters(), max_norm),
            o.max_grad_norm,
            self.scheduler,
        )
        self.updater = Updater([learner], fault=cfg.fault, dump_folder=dump_folder, rank=rank)

    def checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


class SingleModelRecipe:
    """The checkpoint half of the recipe protocol for a recipe that trains one model through a
    `SingleModelTraining` held as ``self.training`` (sft, dpo, reward_model)."""

    training: SingleModelTraining

    def checkpoint_parts(self) -> CheckpointParts:
        return self.training.checkpoint_parts()

    def state_dict(self) -> dict[str, Any]:
        return self.training.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, saved_world: int) -> None:
        self.training.load_state_dict(state)
