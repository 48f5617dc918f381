"""Colocated asynchronous rollout: generation stops once a step's groups are complete.

``rollout.mode = "colocated_async"`` on the same ranks as training. Each step's
generation phase refills the generation copy in place with the policy's weights
(version ``t``, the step), admits new prompt groups within the staleness bound
(`tandem.rl.rollout.inflight.Admission`), resumes the sequences suspended at the last
step and decodes until the step's ``P`` groups are complete (every rank steps its own
generator and, after each step, the ranks agree on the groups complete anywhere),
admitting new groups into the room complete ones leave (`Admission.top_up`).
The sequences still running are then suspended through the update, with their tokens,
log-probs, sampling seeds (the sampler is keyed by seed and token index, so it has no
other state) and the version of every token; their KV stays in device memory
(``rollout.suspended_kv = "keep"``), goes to host memory and back (``offload``), or is
freed and recomputed on resume with the new weights (``recompute``). Long completions
no longer hold a step. The chosen groups are scored, dealt over the data-parallel ranks
in stream order (so S = 0 gives the synchronous run's batches) and handed to the update
as one `RolloutBatch`. `state_dict` holds everything in flight for a checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tandem.rl.algorithms import filter_groups
from tandem.rl.core.metrics import Tally
from tandem.rl.core.samples import dump_rollouts
from tandem.rl.core.system import peak_memory_gb, reset_peak_memory
from tandem.rl.rollout.inflight import Admission, DropBudget, Flight
from tandem.rl.rollout.phase import RolloutPhase, deal_in_stream_order
from tandem.rl.rollout.streaming_episodes import streaming_generator
from tandem.rl.rollout.types import RolloutBatch, RolloutSample, staleness_tally

_KEPT, _FILTERED = 1.0, 2.0  # a complete group's flag in the ranks' completion vector


class ColocatedAsyncRollout:
    """``rollout.mode = "colocated_async"``: the rollout phase of one step, on the training ranks.

    Uses a `RolloutPhase` for prompts, scoring, metrics and evaluation; generation is
    this class's. What it runs with is the table's (tandem/rl/config/composes.py)."""

    def __init__(self, base: RolloutPhase) -> None:
        self.base = base
        r, rc = base.rl, base.rcfg
        self.admission = Admission(r.prompts_per_step, rc.max_staleness, base.seed)
        per_rank = -(-self.admission.capacity // base.dp)
        self.gen = streaming_generator(base, per_rank * r.num_samples)
        self.model: Any = None  # the generation copy, refilled in place every phase
        self.stream = base.stream
        # rl.dynamic_sampling: this rank's complete groups scored before the step chooses (a
        # cache; a restored group is scored again), and this step's filtered groups
        self.scored: dict[int, tuple[torch.Tensor, Tally]] = {}
        self.filtered, self.dropped_groups = Tally(), 0
        self.budget = DropBudget(r.max_refill_rounds * r.prompts_per_step)
        self.over_budget: set[int] = set()  # failing groups the budget keeps: they train

    def owner(self, position: int) -> int:
        """The data-parallel rank that generates a group."""
        return position % self.base.dp

    def batch(self, step: int) -> RolloutBatch:
        b, version = self.base, step
        t0 = time.monotonic()
        reset_peak_memory(b.info.device)
        if b.optimizer is not None:
            from tandem.parallel.offload import move_optimizer_state

            move_optimizer_state(b.optimizer, "cpu")
        expired = self.admission.expire(version, self.stream)
        for f in expired:
            self.gen.drop(f.position)
        mine = [f for f in expired if self.owner(f.position) == b.dp_rank]
        tally = Tally().sum("async/dropped", len(mine))
        new = self.admission.admit(self.stream, version)
        kv_metrics = b.kv_ready()  # collective: FP8 KV scales exist before anything samples
        if self.model is None:
            self.model, reshard = b.gen_copy.build()
        else:
            reshard = b.gen_copy.refill(self.model)
        requantized = self.gen.resume(self.model, self.kv_scales())
        for f in new:
            if self.owner(f.position) == b.dp_rank:
                self.gen.add(f, b.train_prompts[f.row], b.rl.num_samples)
        before = dataclasses.replace(self.gen.gen.stats)
        t_gen = time.monotonic()
        self.filtered, self.dropped_groups = Tally(), 0
        self.budget.reset()
        chosen = self._generate(version)
        t_gen = time.monotonic() - t_gen
        suspended = self.gen.suspend(version)
        samples, scores, rewards = self._collect(chosen)
        self.admission.remove({f.position for f in chosen})
        if b.optimizer is not None:
            from tandem.parallel.offload import move_optimizer_state

            move_optimizer_state(b.optimizer, b.info.device)
        stats = self.gen.gen.stats
        steps, made = stats.steps - before.steps, stats.generated_tokens - before.generated_tokens
        slots = steps * self.gen.gen.scheduler.max_num_seqs
        tally.mean("async/gen_idle_frac", 1.0 - made / max(slots, 1))
        tally.sum("async/suspended", suspended)
        tally.local("rollout/seconds", t_gen).local("rollout/generated_tokens", made)
        tally.local("rollout/preemptions", stats.preemptions - before.preemptions)
        tally.local("rollout/kv_cache_gb", stats.kv_cache_bytes / 1e9)
        staleness_tally(samples, version, b.rcfg.max_staleness, tally)
        tally.local("async/weight_sync_s", reshard["reshard/seconds"])
        for k, v in {**reshard, **kv_metrics, **self.gen.phase_metrics()}.items():
            tally.local(k, v)
        if b.kv is not None:
            tally.sum("kv/requantized_heads", requantized)
        tally.merge(rewards).merge(self.filtered)
        metrics = tally.reduce(device=b.info.device)
        if b.rl.dynamic_sampling:  # the same count on every rank
            metrics["dynamic/dropped_groups"] = float(self.dropped_groups)
        if b.kv is not None:
            metrics.update(b.kv.rollout_metrics(step))
        metrics.update(
            {
                "async/inflight": float(len(self.admission.flights)),
                "time/rollout_s": time.monotonic() - t0,
                "memory/rollout_peak_gb": peak_memory_gb(b.info.device),
            }
        )
        if b.rollout_dumps:  # advanced.dump_rollouts
            dump_rollouts(b.rollout_dumps, step, b.info.rank, samples)
        return RolloutBatch(samples, scores, version, metrics, b.ids(samples), b.positions(samples))

    def kv_scales(self) -> Any:
        """The FP8 pool's calibrated scales of this rank's KV heads for this phase (None
        without FP8 or with per-token scales)."""
        kv, layout = self.base.kv, self.base.gen_copy.layout
        return None if kv is None else kv.for_heads(layout.tp, layout.rank)

    def _generate(self, version: int) -> list[Flight]:
        """Decode until the step's groups are complete on all ranks together; the chosen flights."""
        b = self.base
        self.over_budget &= {f.position for f in self.admission.flights}  # trained ones leave
        while True:
            mine = self._judged(self.gen.complete(), version)
            flights = self.admission.flights
            flags = torch.tensor(
                [mine.get(f.position, 0.0) for f in flights] + [float(self.gen.busy())],
                dtype=torch.float64,
                device=b.info.device,
            )
            if b.dp_group is not None:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=b.dp_group)
            values = flags.tolist()
            states = {f.position: None if x == 0 else x == _KEPT for f, x in zip(flights, values)}
            if b.rl.dynamic_sampling:  # the budget's decision, in stream order
                drop, keep = self.budget.decide(
                    {p: v for p, v in states.items() if p not in self.over_budget}
                )
                self.over_budget |= keep
                if drop:  # their room takes new groups, admitted as any other
                    self._drop_filtered(drop)
                    continue
                states.update(dict.fromkeys(self.over_budget & states.keys(), True))
            complete = {p for p, v in states.items() if v}
            chosen = self.admission.choose(complete, version)
            if chosen is not None:
                return chosen
            new = self.admission.top_up(self.stream, version, complete)
            for f in new:  # the straggling groups leave room: fill it with new work
                if self.owner(f.position) == b.dp_rank:
                    self.gen.add(f, b.train_prompts[f.row], b.rl.num_samples)
            if new:
                continue
            if not values[-1]:
                raise RuntimeError(
                    f"colocated_async: no rank has work left at version {version}, "
                    f"yet the {len(flights)} groups in flight make no step of "
                    f"{self.admission.per_step}"
                )
            if self.gen.busy():
                self.gen.step()

    def _judged(self, complete: set[int], version: int) -> dict[int, float]:
        """This rank's complete groups: `_KEPT`, or `_FILTERED` when ``rl.dynamic_sampling``
        is on and all its rewards are equal (DAPO's `filter_groups`); whether a filtered group
        is dropped is the step's `DropBudget`'s decision."""
        if not self.base.rl.dynamic_sampling:
            return dict.fromkeys(complete, _KEPT)
        out = {}
        for pos in complete:
            if pos not in self.scored:
                self.scored[pos] = self.base.score(self.gen.peek(pos, version))
            sc = self.scored[pos][0]
            drop = not bool(filter_groups(sc, torch.zeros(sc.numel(), dtype=torch.long)).any())
            out[pos] = _FILTERED if drop else _KEPT
        return out

    def _drop_filtered(self, positions: set[int]) -> None:
        """Every rank: the filtered groups leave the flight (their prompts are spent, as in the
        synchronous schedule); their reward metrics count in the step's."""
        self.admission.remove(positions)
        self.dropped_groups += len(positions)
        for pos in positions:
            if self.owner(pos) == self.base.dp_rank:
                self.gen.take(pos)
                self.filtered.merge(self.scored.pop(pos)[1])

    def _collect(self, chosen: list[Flight]) -> tuple[list[RolloutSample], torch.Tensor, Tally]:
        """Score this rank's chosen groups, then deal the step's groups over the data-parallel
        ranks in stream order (the i-th to rank i mod dp): this rank's batch."""
        b = self.base
        order = sorted(f.position for f in chosen)
        rewards = Tally()
        mine = list(self._scored(order, rewards))
        samples, scores = deal_in_stream_order(mine, order, b.dp, b.dp_rank, b.dp_group)
        return samples, scores, rewards

    def _scored(
        self,
        order: list[int],
        tally: Tally,
    ) -> Iterator[tuple[int, list[RolloutSample], list[float]]]:
        """This rank's groups among the complete ``order``, taken from the generator and scored
        (their reward metrics into ``tally``)."""
        for pos in order:
            if self.owner(pos) != self.base.dp_rank:
                continue
            group = self.gen.take(pos)
            cached = self.scored.pop(pos, None)  # dynamic sampling scored it already
            sc, t = cached if cached is not None else self.base.score(group)
            tally.merge(t)
            yield pos, group, sc.tolist()

    def evaluate(self) -> dict[str, float]:
        return self.base.evaluate()

    def state_dict(self) -> dict[str, Any]:
        """Collective: the flight (the same on every rank) and every rank's groups."""
        b = self.base
        parts: list[Any] = [self.gen.state()]
        if b.dp > 1:
            parts = [None] * b.dp
            dist.all_gather_object(parts, self.gen.state(), group=b.dp_group)
        return {
            "admission": self.admission.state_dict(),
            "groups": [g for part in parts for g in part],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank takes the groups it owns on this layout (any number of ranks), sampled
        tokens and versions as saved; their KV is recomputed at the next phase. Groups of
        multi-turn episodes are given back to the prompt stream (`StreamingEpisodes`)."""
        if not state:  # a checkpoint of a synchronous run: nothing in flight
            return
        self.admission.load_state_dict(state["admission"])
        again = sorted(g["position"] for g in state["groups"] if g.get("episodes"))
        self.admission.remove(set(again))
        self.stream.requeue(again)
        state = {**state, "groups": [g for g in state["groups"] if not g.get("episodes")]}
        flights = {f.position: f for f in self.admission.flights}
        mine = [
            g
            for g in state["groups"]
            if g["position"] in flights and self.owner(g["position"]) == self.base.dp_rank
        ]
        self.gen.restore(mine, flights, self.base.train_prompts)

    def sample_metrics(self, samples: list[RolloutSample]) -> dict[str, float]:
        return self.base.sample_metrics(samples)

    def ids(self, samples: list[RolloutSample]) -> list[str]:
        return self.base.ids(samples)

    def close(self) -> None:
        self.gen.close()
        self.base.close()
