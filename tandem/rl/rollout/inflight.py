"""Which prompt groups are in flight, and when each must train: the staleness bound's bookkeeping.

A group admitted at policy version ``v`` (its seed keyed by ``v`` and its stream
position) must train by version ``v + S`` (``rollout.max_staleness``), so no sampled
token is more than S versions older than the update that trains it. Each step trains
``P`` groups (``rl.prompts_per_step``) and at most ``P (S + 1)`` are in flight. A step
first admits new groups until P are in flight (`admit`: the last step's leftovers count);
once at most half of P are still running and the step waits on them, `top_up` admits
new groups until P are running again, within that capacity, so the generator does not
idle through a long tail. A workload without stragglers thus runs like the synchronous
one (every sample fresh); a long tail trains its stragglers and the groups started
beside them up to S versions late. `choose` picks a step's P among the complete ones by
earliest deadline, only when the rest can still meet theirs: with ``c(d)`` the groups due by
version ``d``, the P chosen must include at least ``c(d) - P (d - t)`` of them for every ``d`` in
``t .. t + S`` (the later steps train P each). S = 0 is the synchronous schedule: the
capacity is P and every admitted group must be complete. Pure Python and identical on
every rank (every rank takes the same decisions from the same global completion vector)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tandem.rl.data.prompts import PromptStream, rollout_seed


@dataclass
class Flight:
    """One prompt group in flight."""

    position: int  # its place in the global prompt stream (its id)
    row: int  # its prompt's index in the training prompts
    version: int  # the policy version it was admitted at (its tokens are no older)
    seed: int  # its samples' sampling seed (+ sample index)


class Admission:
    def __init__(self, per_step: int, max_staleness: int, job_seed: int) -> None:
        self.per_step, self.max_staleness, self.job_seed = per_step, max_staleness, job_seed
        self.flights: list[Flight] = []  # in admission order

    @property
    def capacity(self) -> int:
        return self.per_step * (self.max_staleness + 1)

    def deadline(self, f: Flight) -> int:
        return f.version + self.max_staleness

    def admit(self, stream: PromptStream, version: int) -> list[Flight]:
        """A step's new groups: as many as bring the flight to P (the groups left over from
        the last step count), within the capacity (the stream serves given-back prompts
        first)."""
        return self._take(stream, version, self.per_step - len(self.flights))

    def top_up(self, stream: PromptStream, version: int, complete: set[int]) -> list[Flight]:
        """While a step waits on a tail (at most half of P still running): new groups until P
        are running again, within the capacity (none when S = 0)."""
        running = sum(1 for f in self.flights if f.position not in complete)
        if 2 * running > self.per_step:
            return []
        return self._take(stream, version, self.per_step - running)

    def _take(self, stream: PromptStream, version: int, n: int) -> list[Flight]:
        new = []
        while len(self.flights) < self.capacity and len(new) < n:
            pos, row = stream.take(1)[0]
            f = Flight(pos, row, version, rollout_seed(self.job_seed, version, pos))
            self.flights.append(f)
            new.append(f)
        return new

    def choose(self, complete: set[int], version: int) -> list[Flight] | None:
        """The step's ``P`` groups, or None while the complete ones cannot make a step that
        keeps every other group's deadline reachable."""
        done = sorted(
            (f for f in self.flights if f.position in complete),
            key=lambda f: (self.deadline(f), f.position),
        )
        chosen = done[: self.per_step]
        if len(chosen) < self.per_step:
            return None
        for d in range(version, version + self.max_staleness + 1):
            if self._due(chosen, d) < self._due(self.flights, d) - self.per_step * (d - version):
                return None
        return chosen

    def _due(self, flights: list[Flight], version: int) -> int:
        return sum(1 for f in flights if self.deadline(f) <= version)

    def remove(self, positions: set[int]) -> None:
        self.flights = [f for f in self.flights if f.position not in positions]

    def expire(self, version: int, stream: PromptStream) -> list[Flight]:
        """Groups that can no longer train within the bound at ``version`` (a resume with a
        smaller S or P, or a group that missed its deadline): taken out of the flight, their
        prompts given back to ``stream`` (sampled afresh when admitted again). Also trims the
        flight, youngest first, until every deadline is reachable."""
        out = [f for f in self.flights if self.deadline(f) < version]
        self.remove({f.position for f in out})
        while self._overdue(version):
            out.append(self.flights.pop())
        stream.requeue([f.position for f in out])
        return out

    def _overdue(self, version: int) -> bool:
        for d in range(version, version + self.max_staleness + 1):
            if self._due(self.flights, d) > self.per_step * (d - version + 1):
                return True
        return len(self.flights) > self.capacity

    def state_dict(self) -> dict[str, Any]:
        return {"flights": [asdict(f) for f in self.flights]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flights = [Flight(**f) for f in state["flights"]]


class DropBudget:
    """``rl.dynamic_sampling``'s rule, the same in every schedule: a step drops the first ``B``
    groups (in prompt-stream order) whose rewards are all equal, ``B = rl.max_refill_rounds x
    rl.prompts_per_step``, and trains the later ones. A streaming schedule decides a failing
    group as soon as the groups before it allow (`decide`), so the same groups are dropped as in
    the synchronous refill rounds. Pure Python, identical on every rank."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.failed: set[int] = set()  # this step's failing groups, decided (dropped or kept)

    def reset(self) -> None:
        """A new step: its budget is whole again."""
        self.failed = set()

    def decide(self, groups: dict[int, bool | None]) -> tuple[set[int], set[int]]:
        """``groups``: position -> passed the filter (None: not complete yet). The failing
        groups decided now: (dropped, kept over the budget); a failing group whose place among
        the failing ones the incomplete groups before it still decide waits (in neither)."""
        drop: set[int] = set()
        keep: set[int] = set()
        fails = unknown = 0  # failing (decided or not) and incomplete groups before ``pos``
        for pos in sorted(groups.keys() | self.failed):  # one pass: this runs every decode step
            state, failed = groups.get(pos), pos in self.failed
            if state is False and not failed:
                if fails + unknown < self.budget:
                    drop.add(pos)
                    self.failed.add(pos)
                elif fails >= self.budget:
                    keep.add(pos)
                    self.failed.add(pos)
            if failed or state is False:
                fails += 1
            elif state is None:
                unknown += 1
        return drop, keep
