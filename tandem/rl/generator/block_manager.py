"""KV block accounting: a free list, reference counts, fork and copy-on-write.

The pool has ``num_blocks`` blocks of ``block_size`` token slots; block j of a
sequence's ``block_table`` holds its positions [j*block_size, (j+1)*block_size).
Blocks are shared by reference counting: `fork` gives a child the parent's
whole table (a partially filled last block included), and `prepare_write`
replaces any shared block a sequence is about to write by a private copy,
recording ``(src, dst)`` for the runner to copy before the step's attention.
The last holder of a shared block writes it in place (no copy).

Pure Python: it moves integers, never tensors. Counting is exact, so tests can
count the blocks saved by sharing.
"""

from __future__ import annotations

from collections import deque

from tandem.rl.generator.sequence import Sequence


class BlockManager:
    """Owns which KV blocks each sequence's ``block_table`` points at."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockManager needs block_size >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._holders: dict[int, Sequence] = {}  # seq_id -> sequence with a non-empty table
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet taken

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def holds_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._holders

    def holders(self) -> list[Sequence]:
        return list(self._holders.values())

    def num_blocks_needed(self, seq: Sequence, start: int, end: int) -> int:
        """Fresh blocks `prepare_write(seq, start, end)` takes: new blocks plus copies."""
        table = seq.block_table
        if end - start == 1:  # a decode step: the one block holding position start
            j = start // self.block_size
            if j < len(table):
                return 1 if self._ref_counts[table[j]] > 1 else 0
            return j + 1 - len(table)
        first = start // self.block_size
        last = min(len(table), self.blocks_for(end))  # existing blocks that get written
        shared = sum(1 for j in range(first, last) if self._ref_counts[table[j]] > 1)
        return max(0, self.blocks_for(end) - len(table)) + shared

    # ---- mutations -----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` with fresh blocks until it holds ``num_tokens`` positions."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return
        if need > len(self._free):
            raise RuntimeError(
                f"KV pool exhausted: sequence {seq.seq_id} needs {need} more blocks, "
                f"{len(self._free)} free (the scheduler should have preempted)"
            )
        self._register(seq)
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def prepare_write(self, seq: Sequence, start: int, end: int) -> None:
        """Make positions [start, end) of ``seq`` writable: private copies, then new blocks.

        Every shared block in the range is swapped for a fresh one and ``(src, dst)``
        is recorded (see `take_copies`); the old block keeps its other holders.
        """
        need = self.num_blocks_needed(seq, start, end)
        if need == 0:  # no shared block in the range and none missing: nothing to do
            return
        if need > len(self._free):
            raise RuntimeError(
                f"KV pool exhausted: sequence {seq.seq_id} needs {need} blocks to write "
                f"positions [{start}, {end}), {len(self._free)} free"
            )
        table = seq.block_table
        for j in range(start // self.block_size, min(len(table), self.blocks_for(end))):
            src = table[j]
            if self._ref_counts[src] > 1:
                dst = self._free.popleft()
                self._ref_counts[dst] = 1
                self._ref_counts[src] -= 1
                table[j] = dst
                self._copies.append((src, dst))
        self.allocate(seq, end)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (holding nothing) all of ``parent``'s blocks, shared."""
        if child.block_table:
            raise RuntimeError(
                f"fork: child {child.seq_id} already holds blocks {child.block_table}"
            )
        if not parent.block_table:
            return
        self._register(child)
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; a block returns to the free list at refcount 0.

        A pending copy whose destination is released is dropped: that block's
        contents are no longer wanted and it may be handed out again this step.
        """
        if not seq.block_table:
            return
        released: set[int] = set()
        for block in seq.block_table:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"double free of block {block} by sequence {seq.seq_id}")
            if self._ref_counts[block] == 0:
                self._free.append(block)
                released.add(block)
        if released:
            self._copies = [(s, d) for s, d in self._copies if d not in released]
        seq.block_table = []
        self._holders.pop(seq.seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        """Return and clear the pending copy-on-write list, in the order recorded.

        The runner performs them before the step's K/V writes, reading every
        source before writing any destination (as ``KVCache.copy_blocks`` does).
        No destination appears twice and no destination is also a source.
        """
        copies, self._copies = self._copies, []
        return copies

    # ---- test helpers --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless refcounts equal the block-table references."""
        counts = [0] * self.num_blocks
        for seq_id, seq in self._holders.items():
            if seq.seq_id != seq_id or not seq.block_table:
                raise AssertionError(f"holder {seq_id} is stale: {seq!r}")
            if len(set(seq.block_table)) != len(seq.block_table):
                raise AssertionError(f"sequence {seq_id} lists a block twice: {seq.block_table}")
            for block in seq.block_table:
                counts[block] += 1
        if counts != self._ref_counts:
            diff = {
                b: (c, r)
                for b, (c, r) in enumerate(zip(counts, self._ref_counts, strict=True))
                if c != r
            }
            raise AssertionError(
                f"refcounts differ from table references (block: (refs, count)): {diff}"
            )
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds a block twice")
        used = {b for b, c in enumerate(counts) if c > 0}
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)}")
        if free | used != set(range(self.num_blocks)):
            raise AssertionError(
                f"leaked blocks: {sorted(set(range(self.num_blocks)) - free - used)}"
            )

    def all_free(self) -> bool:
        """True when nothing is held: no leak after a scenario."""
        return (
            len(self._free) == self.num_blocks and not self._holders and not any(self._ref_counts)
        )

    def _register(self, seq: Sequence) -> None:
        other = self._holders.setdefault(seq.seq_id, seq)
        if other is not seq:
            raise RuntimeError(f"two different sequences share seq_id {seq.seq_id}")


class StateSlots:
    """Slots of the per-sequence recurrent state (linear-attention layers: Qwen3.5), beside the
    blocks: a sequence takes one with its first block (admission, or a fork, which copies the
    parent's state into it) and gives it back whenever its blocks go (finish, abort,
    preemption). Pure Python; the tensors are tandem/rl/generator/recurrent_state.py's."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"StateSlots needs num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._copies: list[tuple[int, int]] = []  # (src, dst) state copies of this step's forks

    def available(self, seq: Sequence) -> bool:
        """``seq`` holds a slot or one is free."""
        return seq.state_slot is not None or bool(self._free)

    def take(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            seq.state_slot = self._free.popleft()

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` a slot holding a copy of ``parent``'s state; False when none is free."""
        if not self._free:
            return False
        self.take(child)
        self._copies.append((parent.state_slot, child.state_slot))
        return True

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None

    def take_copies(self) -> list[tuple[int, int]]:
        out, self._copies = self._copies, []
        return out

    def all_free(self) -> bool:
        return len(self._free) == self.num_slots
