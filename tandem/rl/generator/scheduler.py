"""Continuous-batching scheduler: which tokens of which sequences to compute each step.

Every step `schedule` returns an explicit `SchedulerOutput` (the chunks to run, the
copy-on-write block copies, the sequences preempted) within a token budget: decodes first,
then continuing prefills, then admissions first come first served. Running out of blocks
preempts by recompute, never fails; the n samples of a prompt share its KV blocks. Pure
Python, no torch; call `pause`, `append_tokens`, `resume` and `abort` between
`postprocess` and the next `schedule`. Policy, preemption order and prefix sharing:
docs/internals.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tandem.rl.generator.block_manager import BlockManager, StateSlots
from tandem.rl.generator.sequence import FinishReason, Sequence, SequenceStatus

_WAITING, _RUNNING = SequenceStatus.WAITING, SequenceStatus.RUNNING
_PAUSED, _FINISHED = SequenceStatus.PAUSED, SequenceStatus.FINISHED


@dataclass
class ScheduledChunk:
    """Compute positions [start, start + num_tokens) of ``seq`` this step.

    The runner feeds ``token_ids`` at ``positions``, stores their K/V at
    ``slot_mapping(block_size)``, attends over ``seq.block_table`` with context
    length ``end``, and, when ``sample`` is set, samples the token that gets
    index ``end`` from the logits of the chunk's last position.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool

    @property
    def end(self) -> int:
        """Context length after this step (the new tokens included)."""
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end]

    @property
    def positions(self) -> range:
        return range(self.start, self.end)

    def slot_mapping(self, block_size: int) -> list[int]:
        """Cache slot (block * block_size + offset) of every new token."""
        table = self.seq.block_table
        return [table[p // block_size] * block_size + p % block_size for p in self.positions]

    def step_key(self, default_seed: int) -> tuple[int, int]:
        """The sampler's randomness key: (seed, index of the token being sampled).

        Without ``params.seed`` the seed is derived from ``default_seed`` and the
        seq_id, so it survives preemption and does not depend on the batch.
        """
        seed = self.seq.params.seed
        if seed is None:
            seed = (default_seed * 0x9E3779B1 + self.seq.seq_id) % (1 << 63)
        return seed, self.end


@dataclass
class SchedulerOutput:
    """One step's work, in row order: decodes, then prefills, then admissions."""

    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]  # (src, dst): copy before this step's K/V writes
    preempted: list[Sequence] = field(default_factory=list)
    # linear-attention models: (src, dst) recurrent-state slots to copy first (forks)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sample_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.sample]

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def is_pure_decode(self) -> bool:
        """Every chunk is one new token that is sampled (what decode graphs and the mirror run)."""
        return all(c.sample and c.num_tokens == 1 for c in self.chunks)


class _Step:
    """The step being built: chunks keyed by seq_id (insertion order = row order)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks: dict[int, ScheduledChunk] = {}
        self.preempted: list[Sequence] = []

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.seq.seq_id] = chunk
        self.budget -= chunk.num_tokens

    def drop(self, seq: Sequence) -> None:
        chunk = self.chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens


class Scheduler:
    """Admission, chunked prefill, prefix sharing, preemption and multi-turn pauses."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_sharing: bool = True,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        state_slots: StateSlots | None = None,
    ) -> None:
        """``state_slots``: a linear-attention model's recurrent-state slots (a sequence holds
        one while it holds blocks)."""
        if max_num_seqs < 1:
            raise ValueError(f"Scheduler needs max_num_seqs >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(
                f"Scheduler needs max_num_batched_tokens >= 1, got {max_num_batched_tokens}"
            )
        pool_tokens = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = pool_tokens if max_model_len is None else max_model_len
        if self.max_model_len < 2:
            raise ValueError(f"Scheduler needs max_model_len >= 2, got {self.max_model_len}")
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_sharing = enable_prefix_sharing
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.paused: list[Sequence] = []  # pause order
        self.finished: list[Sequence] = []
        self.num_preemptions = 0
        self._pending: dict[int, list[Sequence]] = {}  # leader seq_id -> members to fork
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._num_arrived = 0
        self._num_groups = 0

    # ---- adding work ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Add one sequence (a group of one)."""
        self.add_group([seq])

    def add_group(self, seqs: list[Sequence]) -> None:
        """Add the n samples of one prompt; with prefix sharing the prompt is prefilled once."""
        if not seqs:
            raise ValueError("add_group needs at least one sequence")
        prompt = seqs[0].token_ids
        ids = [s.seq_id for s in seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"add_group: duplicate seq_ids in the group: {ids}")
        for seq in seqs:
            self._check_new(seq)
            if seq.token_ids != prompt:
                raise ValueError(
                    f"add_group: sequence {seq.seq_id}'s prompt differs from sequence "
                    f"{seqs[0].seq_id}'s; a group is n samples of one prompt"
                )
        group_id = seqs[0].group_id if seqs[0].group_id is not None else self._num_groups
        self._num_groups += 1
        for seq in seqs:
            seq.group_id = group_id if seq.group_id is None else seq.group_id
            seq.arrival = self._num_arrived
            self._num_arrived += 1
            self._seqs[seq.seq_id] = seq
        if self.enable_prefix_sharing and len(seqs) > 1 and len(prompt) > 1:
            self._pending[seqs[0].seq_id] = list(seqs[1:])
            self.waiting.append(seqs[0])
        else:
            self.waiting.extend(seqs)

    def add_resumed(self, seq: Sequence) -> None:
        """Add a sequence that already holds sampled tokens (restored from a checkpoint, or
        carried over from another generator): it recomputes its K/V, then samples on from its
        next token index (the sampler's key), as a preempted sequence would."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in the scheduler")
        if seq.status is not _WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"add_resumed: sequence {seq.seq_id} holds K/V state ({seq!r})")
        seq.params.validate()
        left = seq.params.max_tokens - seq.num_generated
        if seq.num_tokens >= self.max_model_len or left < 1:
            raise ValueError(
                f"add_resumed: sequence {seq.seq_id} has no token left to sample ({seq!r})"
            )
        self._check_fits(
            seq,
            min(self.max_model_len, seq.num_tokens + left) - 1,
            f"{seq.num_tokens} tokens + {left} left to sample",
        )
        seq.group_id = self._num_groups if seq.group_id is None else seq.group_id
        self._num_groups += 1
        seq.arrival = self._num_arrived
        self._num_arrived += 1
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def preempt_all(self) -> None:
        """Free every unfinished sequence's K/V (they recompute it when scheduled again), keeping
        the queue order: running ones first, in admission order, then the waiting ones."""
        for seq in self.running:
            seq.status = _WAITING
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        for seq in self._seqs.values():
            self._free(seq)
            seq.num_computed_tokens = 0
        self.block_manager.take_copies()

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in the scheduler")
        if seq.status is not _WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(
                f"sequence {seq.seq_id} is not fresh ({seq!r}); add new Sequence objects"
            )
        seq.params.validate()
        n = seq.num_tokens
        if n >= self.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt of {n} tokens leaves no room to generate "
                f"under max_model_len={self.max_model_len}"
            )
        longest = min(self.max_model_len, n + seq.params.max_tokens)
        self._check_fits(
            seq,
            longest - 1,
            f"prompt {n} + max_tokens {seq.params.max_tokens}, "
            f"capped by max_model_len {self.max_model_len}",
        )

    def _check_fits(self, seq: Sequence, kv_tokens: int, why: str) -> None:
        bm = self.block_manager
        if bm.blocks_for(kv_tokens) > bm.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} may need K/V for {kv_tokens} tokens ({why}), that is "
                f"{bm.blocks_for(kv_tokens)} blocks of {bm.block_size}, but the whole pool has "
                f"{bm.num_blocks}; enlarge the KV pool or lower max_tokens / max_model_len"
            )

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks within the token budget; may preempt to make room."""
        self._fork_ready_groups()
        step = _Step(self.max_num_batched_tokens)
        decodes = [s for s in self.running if self._remaining(s) == 1]
        prefills = [s for s in self.running if self._remaining(s) > 1]
        for seq in decodes + prefills:
            if step.budget == 0:
                break
            if seq.status is _RUNNING:  # not preempted earlier in this step
                self._schedule_running(seq, step)
        self._admit(step)
        copies = self.state_slots.take_copies() if self.state_slots is not None else []
        return SchedulerOutput(
            list(step.chunks.values()), self.block_manager.take_copies(), step.preempted, copies
        )

    def _remaining(self, seq: Sequence) -> int:
        """Tokens to compute before the next stop point (the next sample, or a fork)."""
        return self._target(seq) - seq.num_computed_tokens

    def _target(self, seq: Sequence) -> int:
        if seq.seq_id in self._pending:  # a group leader stops before the last prompt token
            return seq.num_prompt_tokens - 1
        return seq.num_tokens

    def _chunk(self, seq: Sequence, step: _Step) -> ScheduledChunk:
        start = seq.num_computed_tokens
        n = min(self._remaining(seq), step.budget)
        return ScheduledChunk(seq, start, n, sample=start + n == seq.num_tokens)

    def _fits(self, chunk: ScheduledChunk) -> bool:
        bm, slots = self.block_manager, self.state_slots
        if slots is not None and not slots.available(chunk.seq):
            return False
        return bm.can_allocate(bm.num_blocks_needed(chunk.seq, chunk.start, chunk.end))

    def _schedule_running(self, seq: Sequence, step: _Step) -> None:
        chunk = self._chunk(seq, step)
        while not self._fits(chunk):  # a preempted sharer may change the need: recount
            victim = self._pick_victim(seq, include_running=True)
            assert victim is not None, "a running sequence always has itself as a victim"
            self._preempt(victim, step)
            if victim is seq:
                return
            chunk = self._chunk(seq, step)  # budget refunded by a preempted, scheduled victim
        self._place(chunk, step)

    def _admit(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in step.preempted:
                return  # just evicted for room: readmitting it this step would only thrash
            chunk = self._chunk(seq, step)
            while not self._fits(chunk):
                victim = self._pick_victim(seq, include_running=False)
                if victim is None:
                    return  # head of line waits for running sequences to free blocks
                self._preempt(victim, step)
            self.waiting.popleft()
            seq.status = _RUNNING
            self.running.append(seq)
            self._place(chunk, step)

    def _place(self, chunk: ScheduledChunk, step: _Step) -> None:
        self.block_manager.prepare_write(chunk.seq, chunk.start, chunk.end)
        if self.state_slots is not None:
            self.state_slots.take(chunk.seq)
        step.add(chunk)

    def _pick_victim(self, requester: Sequence, include_running: bool) -> Sequence | None:
        """Paused holders, then waiting holders, then (if allowed) the newest running."""
        bm = self.block_manager
        for seq in reversed(self.paused):
            if bm.holds_blocks(seq):
                return seq
        for seq in reversed(self.waiting):
            if seq is not requester and bm.holds_blocks(seq):
                return seq
        if include_running and self.running:
            return self.running[-1]
        return None

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Free ``seq``'s blocks; it recomputes all its tokens when scheduled again."""
        self._free(seq)
        seq.num_computed_tokens = 0
        if seq.status is _RUNNING:
            self.running.remove(seq)
            seq.status = _WAITING
            self.waiting.appendleft(seq)
            step.drop(seq)
        step.preempted.append(seq)
        self.num_preemptions += 1

    def _fork_ready_groups(self) -> None:
        """Fork the members of every leader whose prompt[:-1] is now in the cache."""
        for leader_id in list(self._pending):
            leader = self._seqs[leader_id]
            if leader.num_computed_tokens < leader.num_prompt_tokens - 1:
                continue
            members = self._pending.pop(leader_id)
            for member in members:
                # no free state slot: the member prefills its prompt alone
                if self.state_slots is None or self.state_slots.fork(leader, member):
                    self.block_manager.fork(leader, member)
                    member.num_computed_tokens = leader.num_computed_tokens
            self.waiting.extendleft(reversed(members))

    def _free(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks and its recurrent-state slot (if it holds them)."""
        if self.block_manager.holds_blocks(seq):
            self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)

    def postprocess(
        self, output: SchedulerOutput, sampled: Mapping[int, tuple[int, float, float]]
    ) -> list[Sequence]:
        """Record the step: computed counts, sampled tokens, stops. Returns the newly finished.

        ``sampled`` maps seq_id -> (token_id, logprob, raw_logprob) for every chunk
        with ``sample`` set; other entries are ignored.
        """
        done: list[Sequence] = []
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is _FINISHED:  # aborted after schedule
                continue
            if seq.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"postprocess: sequence {seq.seq_id} has {seq.num_computed_tokens} "
                    f"computed tokens but the chunk starts at {chunk.start}; "
                    "postprocess each output once, in order"
                )
            seq.num_computed_tokens = chunk.end
            if not chunk.sample:
                continue
            if seq.seq_id not in sampled:
                raise ValueError(
                    f"postprocess: no sampled token for sequence {seq.seq_id}, whose chunk "
                    "has sample=True"
                )
            token, logprob, raw_logprob = sampled[seq.seq_id]
            seq.append_sampled(int(token), float(logprob), float(raw_logprob))
            reason = self._stop_reason(seq, int(token))
            if reason is not None:
                self._finish(seq, reason)
                done.append(seq)
        return done

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (
            not params.ignore_eos and token in self.eos_token_ids
        ) or token in params.stop_token_ids:
            return "stop"
        if seq.num_generated >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._detach(seq)
        self._free(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self.finished.append(seq)

    def _detach(self, seq: Sequence) -> None:
        """Take ``seq`` out of every queue; a leader's unforked members prefill alone."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.paused:
            self.paused.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for members in self._pending.values():
                if seq in members:
                    members.remove(seq)
        members = self._pending.pop(seq.seq_id, None)
        if members:
            self.waiting.extendleft(reversed(members))

    # ---- multi-turn and control ----------------------------------------------------------

    def pause(self, seq: Sequence) -> None:
        """Stop scheduling ``seq`` (e.g. waiting for a tool); it keeps its KV blocks.

        Under memory pressure a paused sequence is preempted first and later
        recomputes its tokens.
        """
        if seq.status not in (_WAITING, _RUNNING) or seq.seq_id not in self._seqs:
            raise ValueError(
                f"pause: sequence {seq.seq_id} is {seq.status.name}, not waiting or running"
            )
        self._detach(seq)
        seq.status = _PAUSED
        self.paused.append(seq)

    def append_tokens(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        """Append tokens the policy did not sample (mask False); they are prefilled on resume."""
        new = [int(t) for t in token_ids]
        if seq.status is _FINISHED or seq.seq_id not in self._seqs:
            raise ValueError(f"append_tokens: sequence {seq.seq_id} is finished or unknown")
        total = seq.num_tokens + len(new)
        if total >= self.max_model_len:
            raise ValueError(
                f"append_tokens: sequence {seq.seq_id} would have {total} tokens, leaving no "
                f"room to sample under max_model_len={self.max_model_len}"
            )
        self._check_fits(seq, total, f"{seq.num_tokens} tokens + {len(new)} appended")
        seq.append_external(new)

    def resume(self, seq: Sequence) -> None:
        """Make a paused sequence schedulable again (front of the queue)."""
        if seq.status is not _PAUSED:
            raise ValueError(f"resume: sequence {seq.seq_id} is {seq.status.name}, not PAUSED")
        self.paused.remove(seq)
        seq.status = _WAITING
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` now with reason "abort" and free its blocks (no-op if finished)."""
        if seq.status is _FINISHED:
            return
        if seq.seq_id not in self._seqs:
            raise ValueError(f"abort: sequence {seq.seq_id} is not in the scheduler")
        self._finish(seq, "abort")

    # ---- queries -------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Any sequence not finished (paused ones included)."""
        return bool(self._seqs)

    def has_schedulable(self) -> bool:
        """Any sequence `schedule` could run (paused ones excluded)."""
        return bool(self.running or self.waiting or self._pending)

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent state. A test helper: call between steps."""
        bm = self.block_manager
        bm.check_invariants()
        placed: dict[int, SequenceStatus] = {}
        queues = (
            (self.running, _RUNNING),
            (self.waiting, _WAITING),
            (self.paused, _PAUSED),
            ([m for ms in self._pending.values() for m in ms], _WAITING),
        )
        for queue, status in queues:
            for seq in queue:
                if seq.seq_id in placed:
                    raise AssertionError(f"sequence {seq.seq_id} is in two queues")
                if seq.status is not status:
                    raise AssertionError(
                        f"sequence {seq.seq_id} is {seq.status.name} in the {status.name} queue"
                    )
                placed[seq.seq_id] = status
        if set(placed) != set(self._seqs):
            raise AssertionError(f"unplaced or unknown sequences: {set(placed) ^ set(self._seqs)}")
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs={self.max_num_seqs}")
        for holder in bm.holders():
            if holder.seq_id not in self._seqs:
                raise AssertionError(f"finished or unknown sequence {holder.seq_id} holds blocks")
        for seq in self._seqs.values():
            if seq.num_uncomputed_tokens < 1:
                raise AssertionError(f"sequence {seq.seq_id} has no token left to compute: {seq!r}")
            if len(seq.block_table) != bm.blocks_for(seq.num_computed_tokens):
                raise AssertionError(
                    f"sequence {seq.seq_id}'s table does not match its computed tokens: {seq!r}"
                )
