"""The one training shell: everything a run does around its recipe's steps.

For every recipe (tandem/rl/recipes/base.py) the shell owns, in one place:

- preemption: SIGTERM/SIGUSR1 at any moment (also while the recipe is being
  built: then after the first step) -> every rank agrees after the step ->
  checkpoint -> exit 75;
- the hang watchdog and its phases (build, resume, eval, step, checkpoint, export);
- checkpoints: resume (trainer state, RNG, model and optimizer resharded by
  DCP), periodic / asynchronous / final saves, and truncating what a crashed
  run logged after its last checkpoint (metrics.jsonl, ledger.jsonl, samples.jsonl);
- the NaN/Inf policy's counter (through the recipe's `Updater`);
- metrics: one row per logged step with one naming scheme (docs/architecture.md):
  ``time/*`` seconds, ``memory/*`` GB, ``throughput/*`` per second, ``fault/*``
  counts, ``checkpoint/*`` seconds, ``eval/*`` held-out, ``data/*`` counts;
- evaluation cadence: at the start of a fresh run, every ``training.eval_interval``
  steps, and after the last step;
- the ledger: the ids (and data-stream positions) each step trained on (all ranks),
  checked at the end (exit 5 when a step is missing or repeated across crashes and
  resumes, or a position trained twice);
- per-rank health (tandem/rl/core/health.py): every rank's phase times and collective wait ride
  on the ledger's gather; ``health/*`` metrics, ``health.jsonl``, and one line naming a
  straggler (``fault.straggler_ratio`` for ``fault.straggler_steps`` steps) with its host;
- fault drills (TANDEM_INJECT_KILL) and the HF export at the end.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tandem.parallel.distributed import DistInfo
from tandem.rl.config.schema import Config, format_config
from tandem.rl.core import errors, health
from tandem.rl.core.checkpoint import Checkpointer, resume_note, resume_step
from tandem.rl.core.configlib import to_dict
from tandem.rl.core.loggers import redact_argv
from tandem.rl.core.metrics import MetricsLogger, position_repeats, step_gaps, truncate_jsonl
from tandem.rl.core.system import peak_memory_gb, reset_peak_memory
from tandem.rl.fault import NonFiniteError, PreemptionHandler, Rollback, Watchdog
from tandem.rl.fault.inject import maybe_kill
from tandem.rl.fault.preflight import preflight
from tandem.rl.fault.replica import check_replicas
from tandem.rl.recipes.base import Recipe, Runtime

RecipeFactory = Callable[[Config, Runtime], Recipe]
# per-step files a resume cuts back to its checkpoint's step
STEP_LOGS = ("metrics.jsonl", "ledger.jsonl", "samples.jsonl", "health.jsonl")


class Shell:
    def __init__(self, cfg: Config, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        self.dump = cfg.job.dump_folder
        f = cfg.fault
        self.watchdog = Watchdog(
            self.dump,
            f.hang_timeout_s,
            info.rank,
            phase_timeouts={
                "checkpoint": max(f.hang_timeout_s, 1800.0),
                "build": max(f.hang_timeout_s, 1800.0),
            },
        )
        self.preempt = PreemptionHandler(self.dump, info.rank)
        health.install(self.watchdog.clock)  # collective waits are charged to its phases
        self.stragglers = health.StragglerWatch(f.straggler_ratio, f.straggler_steps)
        self.host = socket.gethostname()
        c = cfg.checkpoint
        self.ckpt = Checkpointer(
            os.path.join(self.dump, c.folder),
            keep_last=c.keep_last,
            async_save=c.async_save,
            model_only=c.model_only,
            before_commit=lambda step: maybe_kill(step, info.rank, self.dump, in_save=True),
        )
        self.logger: MetricsLogger | None = None
        self.recipe: Recipe | None = None
        self.step = 0
        self.ledger_from = 1  # first step ledger.jsonl must hold at the end
        self.ckpt_metrics: dict[str, float] = {}  # save/load seconds, logged with the next row
        self.rollbacks = 0

    # ---- entry -----------------------------------------------------------------------

    def run(self, make: RecipeFactory) -> int:
        self.preempt.install()  # before anything slow: a signal during start-up is a clean stop
        try:
            self._announce()
            m = self.cfg.metrics
            sys.argv[:] = redact_argv(sys.argv, self.cfg)  # W&B records the command line
            self.logger = MetricsLogger(
                self.dump,
                enabled=self.info.is_main,
                jsonl=m.jsonl,
                loggers=m.loggers,
                run_name=self.cfg.job.name,
                config=to_dict(self.cfg, redact=True),  # secrets never reach a logger
            )
            self.watchdog.start()
            if self.cfg.fault.preflight:
                with self.watchdog.phase("preflight"):
                    preflight(self.dump)  # prints and records; a slow rank does not stop the run
            with self.watchdog.phase("build"):
                self.recipe = make(
                    self.cfg,
                    Runtime(
                        self.info, self.dump, self.watchdog, self.logger, self.preempt.should_stop
                    ),
                )
            self.logger.console_keys = self.recipe.console_keys
            try:
                return self._run()
            except errors.StepInterrupted as e:  # every rank, at the same point
                return self._interrupted(str(e))
        finally:
            self.watchdog.stop()
            try:  # a stop signal while the run closes is absorbed: the run ends as it would have
                if self.recipe is not None:
                    self.recipe.close()
                if self.logger is not None:
                    self.logger.close()
            finally:
                self.preempt.uninstall()

    def _announce(self) -> None:
        """The start-up line, and the resolved config as config.toml in the dump folder (kept
        as it is when the folder already has one: a resumed run does not overwrite it)."""
        if not self.info.is_main:
            return
        cfg = self.cfg
        print(
            f"{cfg.job.name}: recipe {cfg.training.recipe!r} on {self.info.world_size} rank(s) "
            f"({self.info.device.type}), dump folder {self.dump}",
            flush=True,
        )
        os.makedirs(self.dump, exist_ok=True)
        path = os.path.join(self.dump, "config.toml")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(format_config(cfg))

    def _run(self) -> int:
        cfg, wd, recipe = self.cfg, self.watchdog, self.recipe
        assert recipe is not None
        steps = cfg.training.steps
        with wd.phase("resume"):
            self._resume()
        # A stop signal that arrived while starting is kept: the run takes one step, checkpoints
        # it and exits 75, so a job warned during start-up still makes progress.
        start_eval: dict[str, float] = {}
        if self.step == 0:
            with wd.phase("eval"):
                start_eval = recipe.evaluate()
            self._say_eval(start_eval, "at start: {}")
        last_eval = start_eval
        wd.clock.take()  # health rows count from the first step on, not the start-up
        while self.step < steps:
            t0 = time.monotonic()
            reset_peak_memory(self.info.device)
            try:
                with wd.phase("step"):
                    out = recipe.step(self.step)
                    rows = self._write_ledger(out.ids, out.positions, out.health_group)
            except Rollback as e:  # fault.on_nonfinite = "rollback"
                with wd.phase("checkpoint"):
                    self._rollback(e)
                continue
            self.step += 1
            # fault drills only (TANDEM_INJECT_KILL)
            maybe_kill(self.step, self.info.rank, self.dump)
            wd.beat(self.step)
            metrics = {**out.metrics, **self._shell_metrics(out.metrics, t0)}
            metrics.update(self._health(rows))
            self._poll_checkpoint()  # commits an asynchronous save whose write has finished
            last = self.step == steps
            every = cfg.training.eval_interval
            if last or (every and self.step % every == 0):
                with wd.phase("eval"):
                    last_eval = recipe.evaluate()
                metrics.update(last_eval)
            if self.step % cfg.metrics.log_interval == 0 or last:
                metrics.update(self.ckpt_metrics)
                self.ckpt_metrics = {}
                self.logger.log(self.step, metrics, total_steps=steps)
            self._check_replicas()  # before a save: a diverged state is never checkpointed
            saved = cfg.checkpoint.enable and (self.step % cfg.checkpoint.interval == 0 or last)
            if saved:
                self._save(finish=last)
            if not last and self.preempt.should_stop_all(step=self.step):
                if saved:
                    self._poll_checkpoint(wait=True)
                else:
                    self._save(finish=True)
                return self._preempted()
        if start_eval or last_eval:
            self._say_eval(last_eval, "start {} -> end {}", start_eval)
        if cfg.checkpoint.export_hf_at_end:
            with wd.phase("export"):
                out_dir = recipe.export(self.dump)
            if out_dir and self.info.is_main:
                print(f"exported the model to {out_dir}", flush=True)
        return self._check_ledger()

    # ---- metrics ---------------------------------------------------------------------

    def _shell_metrics(self, metrics: dict[str, float], t0: float) -> dict[str, float]:
        phase_peaks = [
            v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("peak_gb")
        ]
        updater = self.recipe.updater
        return {
            "time/step_s": time.monotonic() - t0,
            "memory/peak_gb": max([peak_memory_gb(self.info.device), *phase_peaks]),
            "lr": updater.last_lr,
            "fault/skipped_updates": float(updater.skipped),
        }

    def _check_replicas(self) -> None:
        """Every ``fault.replica_check_steps`` steps: the HSDP replicas hold the same bits
        (tandem/rl/fault/replica.py; ReplicaMismatch, exit 11, otherwise)."""
        every = self.cfg.fault.replica_check_steps
        if not every or self.step % every:
            return
        with self.watchdog.phase("replica_check"):
            parts = self.recipe.checkpoint_parts()
            modules = [parts.model, *(m for m, _ in parts.extras.values())]
            check_replicas(modules, self.step, self.info.rank, self.dump)

    def _say_eval(
        self, values: dict[str, float], form: str, start: dict[str, float] | None = None
    ) -> None:
        if not self.info.is_main:
            return
        for key, value in values.items():
            name = key.removeprefix("eval/").replace("_", " ")
            if start is None:
                print(f"eval {name} " + form.format(f"{value:.3f}"), flush=True)
            else:
                before = f"{start[key]:.3f}" if key in start else "n/a (resumed)"
                print(f"eval {name}: " + form.format(before, f"{value:.3f}"), flush=True)

    # ---- checkpoints -----------------------------------------------------------------

    def _resume(self) -> None:
        """Load the newest checkpoint that verifies (tandem/rl/core/checkpoint.py `resume_step`: it
        refuses a start at step 0 over an earlier run's checkpoints, exit 8) and cut the
        per-step logs back to its step; a start at step 0 cuts them to nothing (what an
        attempt logged before its first checkpoint is redone)."""
        logs = [os.path.join(self.dump, name) for name in STEP_LOGS]
        last = resume_step(
            self.ckpt, self.cfg.checkpoint, self.cfg.training.steps, self.info.is_main, logs=logs
        )
        if last is None:
            if self.info.is_main:
                for log in logs:
                    truncate_jsonl(log, 0)
            return
        saved_world, model_only = self._load(last)
        if not os.path.exists(os.path.join(self.dump, "ledger.jsonl")):
            # a checkpoint brought from elsewhere: its history is not here
            self.ledger_from = self.step + 1
        if self.info.is_main:
            note = resume_note(
                {"_saved_world": saved_world, "_model_only": model_only}, self.info.world_size
            )
            print(
                f"resumed from {self.ckpt.path(last)} at step {self.step}{note}; "
                f"loaded in {self.ckpt_metrics['checkpoint/load_s']:.2f}s",
                flush=True,
            )

    def _load(self, last: int) -> tuple[int, bool]:
        """Load checkpoint ``last`` (verified first) into the recipe and the shell; returns the
        world size it was saved on and whether it was model-only."""
        t0 = time.monotonic()
        parts = self.recipe.checkpoint_parts()
        state = self.ckpt.load(last, parts.model, parts.optimizer, parts.extras)
        self.ckpt_metrics["checkpoint/load_s"] = time.monotonic() - t0
        self.step = state.pop("step")
        saved_world = state.pop("_saved_world")
        model_only = state.pop("_model_only")
        # steps whose prompts a rollback skipped (absent from checkpoints written before them)
        self.recipe.updater.skip_steps = set(state.pop("rolled_back_steps", []))
        self.recipe.load_state_dict(state, saved_world=saved_world)
        return saved_world, model_only

    def _trainer_state(self) -> dict[str, Any]:
        state = {"step": self.step, **self.recipe.state_dict()}
        if self.recipe.updater.skip_steps:
            state["rolled_back_steps"] = sorted(self.recipe.updater.skip_steps)
        return state

    def _rollback(self, e: Rollback) -> None:
        """``fault.on_nonfinite = "rollback"``: the non-finite step ``e.step`` is undone by
        loading the newest committed checkpoint; the steps after it are trained again and step
        ``e.step``'s prompts are taken but not trained on (ledger.jsonl marks the step
        ``skipped``, rollback.jsonl says why). More than ``fault.max_rollbacks`` rollbacks in
        one run, or no checkpoint to go back to: NonFiniteError (exit 7)."""
        self.rollbacks += 1
        self._poll_checkpoint(wait=True)
        last = self.ckpt.latest_step() if self.cfg.checkpoint.enable else None
        limit = self.cfg.fault.max_rollbacks
        if last is None or self.rollbacks > limit:
            why = "no checkpoint to go back to" if last is None else f"rollback {self.rollbacks}"
            raise NonFiniteError(f"{e} ({why}; fault.max_rollbacks = {limit})", {"step": e.step})
        skipped = {*self.recipe.updater.skip_steps, e.step}
        self._load(last)
        self.recipe.updater.skip_steps = skipped  # the checkpoint predates this rollback
        self.recipe.updater.forget_after(last)
        if self.info.is_main:
            for name in STEP_LOGS:
                truncate_jsonl(os.path.join(self.dump, name), last)
            self.logger.reopen()  # metrics.jsonl was rewritten under its open handle
            with open(os.path.join(self.dump, "rollback.jsonl"), "a") as f:
                row = {"step": e.step, "to": last, "reason": str(e), "time": time.time()}
                f.write(json.dumps(row) + "\n")
            print(
                f"rollback {self.rollbacks}/{limit}: {e}; reloaded {self.ckpt.path(last)}, "
                f"step {e.step}'s prompts will be skipped",
                flush=True,
            )

    def _save(self, *, finish: bool = False) -> None:
        """Checkpoint this step; ``finish`` waits for an asynchronous write to commit."""
        # a previous write still pending: commit (and log) it first
        self._poll_checkpoint(wait=True)
        parts = self.recipe.checkpoint_parts()
        state = self._trainer_state()
        with self.watchdog.phase("checkpoint"):
            secs = self.ckpt.save(self.step, parts.model, parts.optimizer, state, parts.extras)
        self.ckpt_metrics["checkpoint/save_blocking_s"] = secs
        if self.ckpt.pending_step is None:
            self._committed(self.step, secs)
        elif self.info.is_main:
            print(
                f"checkpoint step-{self.step}: staged in {secs:.2f}s, writing in the background",
                flush=True,
            )
        if finish:
            self._poll_checkpoint(wait=True)

    def _poll_checkpoint(self, wait: bool = False) -> None:
        step = self.ckpt.pending_step
        if step is None:
            return
        with self.watchdog.phase("checkpoint"):
            total = self.ckpt.wait() if wait else self.ckpt.poll()
        if total is not None:
            self._committed(step, total)

    def _committed(self, step: int, total_s: float) -> None:
        self.ckpt_metrics["checkpoint/save_total_s"] = total_s
        if self.info.is_main:
            print(f"checkpoint step-{step} saved in {total_s:.2f}s", flush=True)

    def _interrupted(self, why: str) -> int:
        """A stop signal ended a wait inside step ``self.step + 1``: nothing of it is kept (the
        newest committed checkpoint stands; a resume redoes the step); exit 75."""
        self.preempt.should_stop_all(step=self.step)  # agreed (all ranks raised); the marker
        self._poll_checkpoint(wait=True)  # an asynchronous save in flight commits
        if self.info.is_main:
            print(
                f"preempted during step {self.step + 1} ({why}); the newest committed "
                f"checkpoint is kept and the step is redone on resume; exiting with "
                f"{errors.EXIT_PREEMPTED} to requeue",
                flush=True,
            )
        return errors.EXIT_PREEMPTED

    def _preempted(self) -> int:
        if self.info.is_main:
            print(
                f"preempted: checkpointed step {self.step}; exiting with {errors.EXIT_PREEMPTED}"
                " to requeue",
                flush=True,
            )
        return errors.EXIT_PREEMPTED

    # ---- ledger ----------------------------------------------------------------------

    def _write_ledger(
        self, ids: list[str], positions: list[int], group: str = ""
    ) -> list[dict[str, Any]]:
        """Append the ids this step trains on (all ranks) to dump_folder/ledger.jsonl, with their
        data-stream positions when the recipe gives them. The same gather carries every rank's
        health row (where its time went since the last one); returns them, index = rank."""
        every: list[Any] = [None] * self.info.world_size
        mine = {"rank": self.info.rank, "host": self.host, **self.watchdog.clock.take()}
        if group:
            mine["group"] = group
        with health.waiting("all_gather:ledger_and_health"):
            dist.all_gather_object(every, (sorted(set(ids)), sorted(set(positions)), mine))
        if self.info.is_main:
            row: dict[str, Any] = {
                "step": self.step + 1,
                "ids": sorted(i for part, _, _ in every for i in part),
            }
            where = sorted(p for _, part, _ in every for p in part)
            if where:
                row["positions"] = where
            if self.step + 1 in self.recipe.updater.skip_steps:
                row["skipped"] = "rollback"  # taken, not trained on (rollback.jsonl)
            with open(os.path.join(self.dump, "ledger.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        return [h for _, _, h in every]

    def _health(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """The step's ``health/*`` metrics; rank 0 appends the rows to health.jsonl and says
        the straggler's name once it has been slow for ``fault.straggler_steps`` steps."""
        summary = health.summarize(rows)
        line = self.stragglers.observe(self.step, summary, [r["host"] for r in rows])
        if self.info.is_main:
            record = {"step": self.step, "time": time.time(), **summary, "ranks": rows}
            if line:
                record["straggler"] = line
                print(line, flush=True)
            with open(os.path.join(self.dump, "health.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        out = {
            "health/slowest_rank": float(summary["slowest_rank"]),
            "health/straggler_ratio": summary["straggler_ratio"],
            "health/own_median_s": summary["median_own_s"],
            "health/wait_max_s": summary["wait_max_s"],
        }
        for g, s in summary.get("groups", {}).items():
            out[f"health/{g}/slowest_rank"] = float(s["slowest_rank"])
            out[f"health/{g}/straggler_ratio"] = s["straggler_ratio"]
        return out

    def _check_ledger(self) -> int:
        """Every step 1..steps (from the resumed step on, when the checkpoint came without
        its ledger) trained exactly once across crashes and resumes, and no data-stream
        position twice (an asynchronous run trains a prompt at a later step than it took
        it), or exit 5."""
        path = os.path.join(self.dump, "ledger.jsonl")
        box: list[Any] = [None]
        if self.info.is_main:
            gaps = step_gaps(path, self.cfg.training.steps, first=self.ledger_from)
            twice = position_repeats(path)
            box = [
                f"the run ended with fewer steps than asked: {gaps}"
                if gaps
                else f"a prompt was trained twice: {twice}"
                if twice
                else None
            ]
        dist.broadcast_object_list(box)
        if box[0] is None:
            return 0
        if self.info.is_main:
            print(f"error: {box[0]}", file=sys.stderr, flush=True)
        return errors.EXIT_SHORT_RUN


def run_recipe(make: RecipeFactory, cfg: Config, info: DistInfo) -> int:
    """Build the recipe and run it to the end (or to a preemption); returns the exit status."""
    return Shell(cfg, info).run(make)
