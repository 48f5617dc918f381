"""BlockManager: allocation counts, refcounts, fork, copy-on-write, no leaks (pure Python)."""

from __future__ import annotations

import pytest

from tandem.rl.generator.block_manager import BlockManager
from tandem.rl.generator.sequence import Sequence


def seq(seq_id: int, n: int = 1) -> Sequence:
    return Sequence(seq_id, list(range(1, n + 1)))


def test_allocate_and_free_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(0), seq(1)
    bm.allocate(a, 5)  # ceil(5/4) = 2 blocks
    assert len(a.block_table) == 2 and bm.num_free_blocks == 6
    bm.allocate(a, 8)  # still 2 blocks
    assert len(a.block_table) == 2 and bm.num_free_blocks == 6
    bm.allocate(a, 9)  # 3 blocks
    bm.allocate(b, 1)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    assert set(a.block_table).isdisjoint(b.block_table)
    assert all(bm.ref_count(x) == 1 for x in a.block_table + b.block_table)
    bm.check_invariants()
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7
    bm.free(b)
    bm.check_invariants()
    assert bm.all_free()


def test_allocate_beyond_pool_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate(seq(0), 9)
    bm.check_invariants()
    assert bm.all_free()


def test_fork_shares_every_block_including_partial_last() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = seq(0), seq(1)
    bm.allocate(parent, 6)  # blocks [p0 full, p1 with 2 of 4 slots]
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_count(x) for x in parent.block_table] == [2, 2]
    assert bm.num_used_blocks == 2  # sharing costs no block
    bm.check_invariants()
    bm.free(parent)
    assert [bm.ref_count(x) for x in child.block_table] == [1, 1]
    assert bm.num_used_blocks == 2  # still held by the child
    bm.free(child)
    assert bm.all_free()


def test_copy_on_write_partial_block_last_holder_keeps_original() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, c1, c2 = seq(0), seq(1), seq(2)
    bm.allocate(parent, 6)
    full, partial = parent.block_table
    bm.fork(parent, c1)
    bm.fork(parent, c2)
    assert bm.ref_count(partial) == 3
    # c1 writes position 6 (inside the shared partial block): needs exactly one fresh block
    assert bm.num_blocks_needed(c1, 6, 7) == 1
    bm.prepare_write(c1, 6, 7)
    assert c1.block_table[0] == full and c1.block_table[1] != partial
    assert bm.take_copies() == [(partial, c1.block_table[1])]
    assert bm.take_copies() == []  # taken once
    # c2 and parent still share it; c2 writes positions 6..9 (partial block + one new block)
    assert bm.num_blocks_needed(c2, 6, 10) == 2
    bm.prepare_write(c2, 6, 10)
    assert len(c2.block_table) == 3 and c2.block_table[1] != partial
    assert bm.take_copies() == [(partial, c2.block_table[1])]
    # the parent is the last holder: it writes in place, no copy
    assert bm.ref_count(partial) == 1
    assert bm.num_blocks_needed(parent, 6, 7) == 0
    bm.prepare_write(parent, 6, 7)
    assert parent.block_table == [full, partial] and bm.take_copies() == []
    assert bm.ref_count(full) == 3
    assert bm.num_used_blocks == 1 + 3 + 1  # full shared, three partials, c2's third block
    bm.check_invariants()
    for s in (parent, c1, c2):
        bm.free(s)
    bm.check_invariants()
    assert bm.all_free()


def test_write_into_fresh_block_of_shared_table_needs_no_copy() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    parent, child = seq(0), seq(1)
    bm.allocate(parent, 8)  # two full blocks
    bm.fork(parent, child)
    assert bm.num_blocks_needed(child, 8, 9) == 1  # a new third block, no copy
    bm.prepare_write(child, 8, 9)
    assert bm.take_copies() == [] and child.block_table[:2] == parent.block_table
    bm.free(parent)
    bm.free(child)
    assert bm.all_free()


def test_pending_copy_dropped_when_destination_freed() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    parent, child = seq(0), seq(1)
    bm.allocate(parent, 3)
    bm.fork(parent, child)
    bm.prepare_write(child, 3, 4)
    bm.free(child)  # e.g. preempted in the same step
    assert bm.take_copies() == []
    bm.free(parent)
    assert bm.all_free()


def test_double_free_and_fork_into_holder_raise() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq(0), seq(1)
    bm.allocate(a, 2)
    bm.allocate(b, 2)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.fork(a, b)
    stale = Sequence(0, [1])
    stale.block_table = list(a.block_table)  # a second object claiming a's blocks
    bm.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(stale)


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(0)
    bm.allocate(a, 3)
    bm.check_invariants()
    a.block_table.append(a.block_table[0])  # table edited behind the manager's back
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_one_position_writes_match_the_written_out_rule() -> None:
    """Decode steps write one position, which num_blocks_needed and prepare_write answer
    without the general loop: a copy exactly when that block is shared, a new block exactly
    when the position lies past the table, nothing otherwise (the refcounts, tables, copies
    and free list as the rule says)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    parent, child, lone = seq(0), seq(1), seq(2)
    bm.allocate(parent, 7)  # blocks for positions 0-3 and 4-7
    bm.fork(parent, child)  # both blocks shared
    bm.allocate(lone, 4)  # one private block, full
    cases = [(child, 5, 1, True), (lone, 3, 0, False), (lone, 4, 1, False), (child, 8, 1, False)]
    for s, pos, need, copies in cases:
        table, free = list(s.block_table), bm.num_free_blocks
        assert bm.num_blocks_needed(s, pos, pos + 1) == need
        bm.prepare_write(s, pos, pos + 1)
        assert bm.num_free_blocks == free - need
        j = pos // 4
        if copies:  # the shared block was swapped for a private copy
            assert s.block_table[j] != table[j] and bm.ref_count(s.block_table[j]) == 1
            assert bm.take_copies() == [(table[j], s.block_table[j])]
        else:
            assert s.block_table[: len(table)] == table and bm.take_copies() == []
        assert len(s.block_table) == max(len(table), j + 1)
        assert bm.num_blocks_needed(s, pos, pos + 1) == 0  # written once, private now
        bm.check_invariants()
