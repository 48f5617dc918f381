"""Split placement of the one RL recipe: generator ranks and trainer ranks, concurrently.

``rollout.mode = "split"``, ``rollout.gen_ranks = G``: ranks ``0 .. G-1`` generate
(`tandem.rl.rollout.split.SplitGenerator`), ranks ``G .. W-1`` train over themselves alone
(their mesh: `tandem.parallel.split.side_mesh`). The RL recipe (tandem/rl/recipes/rl.py) builds
what both placements share, the trainers' policy, reference, critic, teachers and update
included, over the trainers' group; `SplitPlacement` holds what differs: each side's role in a
step, the bridge, and the metrics, checkpoints and exports that meet over the control group.
Each step: the generators send the step's groups to the trainers; the trainers update, then
ask for the sync and send their shards over the bridge group while the generators keep
decoding; both sides then meet for the step's metrics, the ledger and checkpoints (the shell's
collectives over the whole world). Rank 0, a generator, writes the logs: the trainers' metrics
come to it at the end of every step.

What composes with split mode is the rows of tandem/rl/config/composes.py (checked by the
shared `setup`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.parallel.mesh import mesh_lines
from tandem.parallel.split import BridgeCopy, SplitWorld, split_world
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.samples import dump_rollouts
from tandem.rl.recipes.base import StepOutput
from tandem.rl.rollout.modes import ROLLOUT_MODES
from tandem.rl.rollout.phase import RolloutPhase
from tandem.rl.rollout.sampling import generation_dtype
from tandem.rl.rollout.split import (
    SplitGenerator,
    evaluate_split,
    receive_groups,
    request_sync,
)
from tandem.rl.rollout.types import RolloutBatch


def check_split_settings(cfg: Any, world: int) -> None:
    """One ConfigError line unless the split leaves a trainer (what composes with split mode is
    tandem/rl/config/composes.py's)."""
    g = cfg.rollout.gen_ranks
    if g >= world:
        raise ConfigError(f"rollout.gen_ranks: {g} leaves no trainer rank of the {world}")


class _Relay:
    """A generator's stand-in for the trainers' `Updater`: the shell logs ``last_lr`` and
    ``skipped`` from rank 0, so the trainers' values come here every step."""

    def __init__(self) -> None:
        self.last_lr, self.skipped = 0.0, 0
        self.skip_steps: set[int] = set()  # the shell's rollback bookkeeping (none in split mode)

    def forget_after(self, step: int) -> None:
        """Nothing to forget: the spike rule runs on the trainers."""


def split_world_of(cfg: Any, world: int) -> SplitWorld | None:
    """Collective (new groups) in split mode: the two sides of the world; None otherwise."""
    if ROLLOUT_MODES.cap(cfg.rollout.mode, "placement") != "split":
        return None
    check_split_settings(cfg, world)
    return split_world(cfg.rollout.gen_ranks)


def trainer_dp_group(mesh: Any) -> Any:
    """Collective (every rank): this trainer's data-parallel group over the trainers' ``mesh``
    (the trainers at one cp coordinate; a group of one under cp = trainers), None on a
    generator."""
    mine = None
    for ranks in mesh_lines(mesh, ("dp_replicate", "dp_shard")):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


class SplitPlacement:
    """``rollout.mode = "split"``: the recipe's step, evaluation, checkpoints and export, by side.
    ``r``: the RL recipe, whose shared parts (data, policy, update) this placement uses."""

    def __init__(self, r: Any, world: SplitWorld) -> None:
        self.r, self.world = r, world
        cfg, info = r.cfg, r.info
        dtype = (
            generation_dtype(cfg.rollout.dtype, info.device, cfg.training.mixed_precision_param)
            or torch.float32
        )
        bucket = cfg.advanced.reshard_bucket_mb << 20
        # the trainers' data-parallel groups (the ranks of a cp group take the same samples): a
        # group even of one trainer, so no collective of the update reaches the generators
        dp_group = trainer_dp_group(r.mesh)
        if world.in_first:
            self._build_generator(dtype, bucket)
        else:
            r.build_policy(group=world.second_group)
            r.build_update(dp_group)
            self.bridge = BridgeCopy(
                r.model, r.args, info.device, dtype, world=world, bucket_bytes=bucket
            )
        self._first_sync()

    def _build_generator(self, dtype: torch.dtype, bucket: int) -> None:
        r, w = self.r, self.world
        cfg, info = r.cfg, r.info
        r.model, r.opt, r.updater = nn.Module(), None, _Relay()
        bridge = BridgeCopy(nn.Module(), r.args, info.device, dtype, world=w, bucket_bytes=bucket)
        base = RolloutPhase(
            rl=cfg.rl,
            rollout=cfg.rollout,
            reward=cfg.reward,
            env=cfg.env,
            data=cfg.data,
            seed=cfg.job.seed,
            info=info,
            tok=r.tok,
            train=r.train_prompts,
            evals=r.eval_prompts,
            gen_copy=bridge,
            dp=(w.first, w.side_rank, w.first_group),
            mp=(1, 0, None),
            max_prompt=r.max_prompt,
            rollout_dumps=None,
        )
        r.rollout = SplitGenerator(base, w, bridge, replica=cfg.parallel.cp)

    def _first_sync(self) -> dict[str, float]:
        """Collective over the bridge: the generators' copy of the trainers' current weights."""
        if self.world.in_first:
            return self.r.rollout.first_sync()
        return self.bridge.send()

    # ---- the recipe protocol, by side ---------------------------------------------------

    def step(self, step: int) -> StepOutput:
        r, w = self.r, self.world
        wd = r.rt.watchdog
        out = StepOutput({})
        if w.in_first:
            with wd.phase("rollout"):
                mine = r.rollout.step(step)
        else:
            t0 = time.monotonic()
            with wd.phase("rollout"):
                groups = receive_groups(w)
            waited = time.monotonic() - t0
            samples = [s for _, group, _ in groups for s in group]
            scores = torch.tensor([v for _, _, sc in groups for v in sc], dtype=torch.float32)
            if r.cfg.advanced.dump_rollouts:  # the trainers' samples, by trainer index
                dump_rollouts(r.rt.dump_folder, step, w.side_rank, samples)
            ids = sorted({str(s.row.get("id", s.row.get("problem_id", ""))) for s in samples})
            batch = RolloutBatch(samples, scores, step, {}, ids, sorted({s.group for s in samples}))
            with wd.phase("update"):
                result = r.update.run(batch, step)
            request_sync(w, step + 1)
            with wd.phase("sync"):
                sync = self.bridge.send()
            mine = {
                **result.metrics,
                **sync,
                "split/train_wait_s": waited,
                "lr": r.updater.last_lr,
                "fault/skipped_updates": float(r.updater.skipped),
            }
            r.sample_log.log(step + 1, r.sample_records(batch, result.advantages))
            # a replica's positions once (its cp ranks trained the same groups)
            first = w.side_rank % r.cfg.parallel.cp == 0
            out = StepOutput({}, batch.ids, batch.positions if first else [])
        out.metrics = self._gather_metrics(mine)
        out.health_group = "generators" if w.in_first else "trainers"  # compared among themselves
        return out

    def _gather_metrics(self, mine: dict[str, float]) -> dict[str, float]:
        """Collective over the world: the first generator's metrics (already over the
        generators) and the first trainer's (already over the trainers), on every rank."""
        parts: list[Any] = [None] * self.world.world
        dist.all_gather_object(parts, mine, group=self.world.control)
        metrics = {**parts[0], **parts[self.world.first]}
        if self.world.in_first:
            self.r.updater.last_lr = metrics.pop("lr")
            self.r.updater.skipped = int(metrics.pop("fault/skipped_updates"))
        metrics.pop("lr", None)
        metrics.pop("fault/skipped_updates", None)
        return metrics

    def evaluate(self) -> dict[str, float]:
        if self.world.in_first:
            return self.r.rollout.evaluate()
        return evaluate_split(None, self.world, None)

    def state_dict(self) -> dict[str, Any]:
        """Collective, the same on every rank: the trainers' schedule, the generators' prompt
        stream and what is in flight."""
        r = self.r
        if self.world.in_first:
            stream = r.rollout.stream
            mine = {
                "cursor": stream.cursor,
                "requeued": stream.requeued,
                "rollout": r.rollout.state_dict(),
            }
        else:
            mine = {"scheduler": r.sched.state_dict()}
        parts: list[Any] = [None] * self.world.world
        dist.all_gather_object(parts, mine, group=self.world.control)
        return {**parts[self.world.first], **parts[0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each side takes its part; then the generators take the resumed weights (a sync)."""
        r = self.r
        if self.world.in_first:
            stream = r.rollout.stream
            stream.cursor, stream.requeued = state["cursor"], list(state.get("requeued", []))
            r.rollout.load_state_dict(state.get("rollout") or {})
        else:
            r.sched.load_state_dict(state["scheduler"])
        self._first_sync()

    def export(self, dump_folder: str) -> str:
        """The trainers gather the full weights; the first trainer writes the HF folder."""
        r = self.r
        out = os.path.join(dump_folder, "hf")
        if not self.world.in_first:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            from tandem.rl.core.lora import save_exports

            state = get_model_state_dict(r.model, options=StateDictOptions(full_state_dict=True))
            if self.world.side_rank == 0:
                save_exports({k: v.cpu() for k, v in state.items()}, r.args, out, r.tok, None)
        dist.barrier(group=self.world.control)
        return out
