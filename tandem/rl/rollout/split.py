"""Split-mode rollout: generator ranks that never stop for the update (``rollout.mode = "split"``).

The first ``rollout.gen_ranks`` ranks generate, the others train (tandem/rl/recipes/rl_split.py),
in one torchrun program (the groups: tandem/parallel/split.py). A generator's step ``t``:

1. admits prompt groups within the staleness bound and decodes until the step's P groups are
   complete on the generators together: `ColocatedAsyncRollout`'s admission, deadlines and
   decode loop (tandem/rl/rollout/inflight.py), with the generators in place of the
   data-parallel ranks. The flight is the reordering window over the prompt stream: at most
   ``P (S + 1)`` groups, and a step trains the complete ones by earliest deadline, so a
   straggler holds back only its own group, for at most S versions;
2. scores its share of them and sends each group to the trainers that train it (the i-th in
   stream order to trainer replica ``i mod R``, as the synchronous deal; under ``parallel.cp``
   a replica is cp consecutive trainers, each of which takes the same groups) by
   point-to-point sends;
3. while the trainers update, keeps decoding (with ``S >= 1`` it first admits the next step's
   groups, version ``t``), and between two decode steps takes the trainers' weights of
   version ``t + 1`` when their request arrives: every trainer sends its own shard over the
   bridge group, in buckets, by the plan made at the first sync
   (`tandem.parallel.split.BridgeCopy`), and the
   checksum of what the generators then hold is compared with the trainers'
   (`tandem.parallel.split.BridgeMismatch`, exit 10, on any difference).

With ``S = 0`` nothing is admitted during the update, so the generators sample exactly what
the synchronous run samples. Every token keeps the version that sampled it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.parallel.split import BridgeCopy, SplitWorld
from tandem.rl.core.metrics import Tally
from tandem.rl.rollout.inflight import Flight
from tandem.rl.rollout.phase import RolloutPhase
from tandem.rl.rollout.streaming import ColocatedAsyncRollout
from tandem.rl.rollout.types import RolloutSample, response_tally, staleness_tally

_SYNC_TAG, _SAMPLES_TAG = 36, 37


def request_sync(world: SplitWorld, version: int) -> None:
    """A trainer (the first): tell every generator that version ``version`` is ready to move."""
    if world.side_rank != 0 or world.in_first:
        return
    for g in range(world.first):
        dist.send(
            torch.tensor([version], dtype=torch.long), dst=g, group=world.control, tag=_SYNC_TAG
        )


def receive_groups(world: SplitWorld) -> list[tuple[int, list[RolloutSample], list[float]]]:
    """A trainer: this step's groups from every generator (position, samples, scores), in
    stream order."""
    out = []
    for g in range(world.first):
        box: list[Any] = [None]
        dist.recv_object_list(box, src=g, group=world.control)
        out += box[0]
    return sorted(out, key=lambda x: x[0])


class SplitGenerator(ColocatedAsyncRollout):
    """A generator rank's rollout across steps (``base``: its `RolloutPhase`, whose
    data-parallel group is the generators' group)."""

    def __init__(
        self, base: RolloutPhase, world: SplitWorld, bridge: BridgeCopy, replica: int = 1
    ) -> None:
        super().__init__(base)
        self.world, self.bridge = world, bridge
        self.replica = replica  # consecutive trainers that take the same groups (parallel.cp)

    def first_sync(self) -> dict[str, float]:
        """Collective over the bridge: the generation copy, built from the trainers' weights."""
        self.model, metrics = self.bridge.receive(self.model)
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """Generate step ``step``'s groups with version ``step``, send them to the trainers,
        keep generating through the update, then take version ``step + 1``. This rank's
        metrics (reduced over the generators)."""
        b, version = self.base, step
        t0 = time.monotonic()
        expired = self.admission.expire(version, self.stream)
        for f in expired:
            self.gen.drop(f.position)
        tally = Tally().sum(
            "async/dropped", sum(1 for f in expired if self.owner(f.position) == b.dp_rank)
        )
        self.gen.resume(self.model)  # the first step: the generator, and groups restored
        self._add(self.admission.admit(self.stream, version))
        before = self.gen.gen.stats.steps, self.gen.gen.stats.generated_tokens
        self.filtered, self.dropped_groups = Tally(), 0
        self.budget.reset()
        chosen = self._generate(version)
        self.gen.stamp(version)
        t_chosen = time.monotonic()
        self._send(chosen, version, tally)
        tally.merge(self.filtered)  # rl.dynamic_sampling: the dropped groups' rewards count too
        self.admission.remove({f.position for f in chosen})
        if b.rcfg.max_staleness > 0:  # the next step's groups, sampled through the update
            self._add(self.admission.admit(self.stream, version))
        idle = self._decode_until_request()
        tally.sum("async/suspended", self.gen.suspend(version))
        self.model, sync = self.bridge.receive(self.model)
        self.gen.resume(self.model)  # recompute: the suspended KV again, with the new weights
        stats = self.gen.gen.stats
        steps, made = stats.steps - before[0], stats.generated_tokens - before[1]
        slots = steps * self.gen.gen.scheduler.max_num_seqs
        tally.mean("async/gen_idle_frac", 1.0 - made / max(slots, 1))
        tally.mean("split/gen_wait_s", idle)
        tally.mean("time/rollout_s", t_chosen - t0)
        for k, v in sync.items():
            tally.mean(k, v)
        for k, v in self.gen.phase_metrics().items():
            tally.local(k, v)
        metrics = (
            tally.reduce(group=b.dp_group, device=b.info.device) if b.dp > 1 else tally.values()
        )  # (no group: the world's, which the trainers are in)
        if b.rl.dynamic_sampling:  # the same count on every generator
            metrics["dynamic/dropped_groups"] = float(self.dropped_groups)
        metrics.update(
            {
                "async/inflight": float(len(self.admission.flights)),
                "async/weight_sync_s": metrics["split/sync_s"],
            }
        )
        return metrics

    def _add(self, flights: list[Flight]) -> None:
        for f in flights:
            if self.owner(f.position) == self.base.dp_rank:
                self.gen.add(f, self.base.train_prompts[f.row], self.base.rl.num_samples)

    def _send(self, chosen: list[Flight], version: int, tally: Tally) -> None:
        """Score this rank's chosen groups and send every trainer its replica's share (possibly
        none)."""
        b, replicas = self.base, self.world.second // self.replica
        order = sorted(f.position for f in chosen)
        target = {pos: i % replicas for i, pos in enumerate(order)}
        parts: list[list[Any]] = [[] for _ in range(replicas)]
        for pos, group, sc in self._scored(order, tally):
            staleness_tally(group, version, b.rcfg.max_staleness, tally)
            response_tally(group, tally)  # over the generators, which hold every sample
            parts[target[pos]].append((pos, group, sc))
        for j in range(self.world.second):
            part = parts[j // self.replica]
            dist.send_object_list([part], dst=self.world.first + j, group=self.world.control)

    def _decode_until_request(self) -> float:
        """Decode this rank's sequences until the trainers ask for the sync; the seconds spent
        with nothing to decode (waiting on the update)."""
        buf = torch.zeros(1, dtype=torch.long)
        req = dist.irecv(buf, src=self.world.first, group=self.world.control, tag=_SYNC_TAG)
        arrived = threading.Event()  # gloo's irecv reports completion only through wait()
        threading.Thread(target=lambda: (req.wait(), arrived.set()), daemon=True).start()
        idle = 0.0
        while not arrived.is_set():
            if self.gen.busy():
                self.gen.step()
            else:
                t = time.monotonic()
                arrived.wait()
                idle += time.monotonic() - t
        return idle

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy from the generators' copy (the trainers add zeros: see
        `evaluate_split`)."""
        return evaluate_split(self.base, self.world, self.model)


def evaluate_split(base: RolloutPhase | None, world: SplitWorld, model: Any) -> dict[str, float]:
    """Collective over the world: the first reward function's mean over the eval prompts,
    sampled by the generators like `RolloutPhase.evaluate` (fixed seeds)."""
    from tandem.rl.data.images import release_images
    from tandem.rl.data.prompts import deal, rollout_seed

    acc = torch.zeros(2, dtype=torch.float64)
    if base is not None and base.eval_prompts:
        order = deal(list(range(len(base.eval_prompts))), world.side_rank, world.first)
        n = base.rl.eval_samples
        seeds = [rollout_seed(12345, -1, i) for i in order]
        samples, _ = base.generate(
            model, [base.eval_prompts[i] for i in order], max(n, 1), seeds, greedy=n == 0
        )
        base.score(samples)
        release_images(samples)
        acc += torch.tensor(
            [sum(s.info.get("accuracy", 0.0) for s in samples), len(samples)], dtype=torch.float64
        )
    dist.all_reduce(acc, group=world.control)
    if acc[1] == 0:
        return {}
    return {"eval/accuracy": acc[0].item() / acc[1].item()}
