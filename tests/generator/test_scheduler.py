"""Scheduler: chunked prefill, continuous batching, prefix sharing, preemption, multi-turn.

Pure Python. `FakeRunner` stands in for the model runner and checks the KV
bookkeeping for real: it keeps a slot-level cache whose entry at position p is
a hash of the whole prefix (computed from the cached entry at p-1, as a
transformer's K/V depend on the cached context), performs the block copies
before the step's writes, asserts no slot is written twice in a step, and
before sampling asserts the cached context equals the reference for the
sequence's tokens. Its next token is a function of that cached prefix and the
seed, so a wrong copy, slot or recompute changes the outputs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tandem.rl.generator.block_manager import BlockManager
from tandem.rl.generator.scheduler import Scheduler, SchedulerOutput
from tandem.rl.generator.sequence import SamplingParams, Sequence, SequenceStatus

VOCAB = 50
EOS = 0


def _mix(h: int, token: int, pos: int) -> int:
    return (h * 1_000_003 + (token + 1) * 7919 + pos) % (1 << 61)


def reference_kv(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for pos, token in enumerate(tokens):
        h = _mix(h, token, pos)
        out.append(h)
    return out


class FakeRunner:
    """A deterministic stand-in for runner + model + sampler over a simulated paged cache."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.cache: list[int | None] = [None] * (bm.num_blocks * bm.block_size)
        self.tokens_computed = 0

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def __call__(self, out: SchedulerOutput) -> dict[int, tuple[int, float, float]]:
        bs = self.bs
        srcs, dsts = [s for s, _ in out.block_copies], [d for _, d in out.block_copies]
        assert len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts)
        snapshot = list(self.cache)  # read every source before writing any destination
        for src, dst in out.block_copies:
            self.cache[dst * bs : (dst + 1) * bs] = snapshot[src * bs : (src + 1) * bs]
        written: set[int] = set()
        for chunk in out.chunks:
            seq = chunk.seq
            h = self.cache[self._slot(seq, chunk.start - 1)] if chunk.start else 0
            for pos, token, slot in zip(
                chunk.positions, chunk.token_ids, chunk.slot_mapping(bs), strict=True
            ):
                assert slot not in written, "two tokens written to one slot in a step"
                written.add(slot)
                h = _mix(h, token, pos)
                self.cache[slot] = h
            self.tokens_computed += chunk.num_tokens
        sampled = {}
        for chunk in out.sample_chunks:
            seq = chunk.seq
            context = [self.cache[self._slot(seq, p)] for p in range(chunk.end)]
            assert context == reference_kv(seq.token_ids[: chunk.end]), f"corrupt KV for {seq!r}"
            token = ((context[-1] >> 7) ^ (chunk.step_key(1234)[0] * 2654435761)) % VOCAB
            sampled[seq.seq_id] = (token, -token / 100, -token / 50)
        return sampled


def run(
    sched: Scheduler,
    runner: FakeRunner,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    max_steps: int = 5000,
) -> int:
    """Drive to completion, checking budget and invariants every step; no leak at the end."""
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.chunks) <= sched.max_num_seqs
        sched.postprocess(out, runner(out))
        sched.check_invariants()
        if on_step is not None:
            on_step(steps, out)
        steps += 1
        assert steps < max_steps, "no progress"
    assert sched.block_manager.all_free()
    return steps


def make_group(
    first_id: int, prompt_len: int, n: int, max_tokens: int, **kw: object
) -> list[Sequence]:
    prompt = [(7 * first_id + 3 * i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    return [
        Sequence(
            first_id + j, prompt, SamplingParams(max_tokens=max_tokens, seed=first_id + j, **kw)
        )
        for j in range(n)
    ]


def outputs(seqs: list[Sequence]) -> dict[int, tuple[list[int], str | None, list[float]]]:
    return {s.seq_id: (s.token_ids, s.finish_reason, s.logprobs) for s in seqs}


def make_sched(
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 16,
    sharing: bool = True,
    max_model_len: int | None = 64,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(
        bm,
        max_num_seqs,
        budget,
        enable_prefix_sharing=sharing,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
    )


def chunks_of(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    return [(c.seq.seq_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


def test_single_sequence_prefill_then_decode() -> None:
    sched = make_sched(num_blocks=8)
    runner = FakeRunner(sched.block_manager)
    (s,) = make_group(0, 5, 1, max_tokens=3, ignore_eos=True)
    sched.add(s)
    history = []
    run(sched, runner, lambda i, out: history.append((chunks_of(out), len(s.block_table))))
    assert history == [([(0, 0, 5, True)], 2), ([(0, 5, 1, True)], 2), ([(0, 6, 1, True)], 0)]
    assert s.finish_reason == "length" and s.num_tokens == 8 and s.num_generated == 3
    assert s.sampled == [False] * 5 + [True] * 3 and len(s.raw_logprobs) == 3
    assert sched.finished == [s]


def test_chunked_prefill_and_step_order() -> None:
    sched = make_sched(num_blocks=32, budget=6)
    runner = FakeRunner(sched.block_manager)
    a = make_group(0, 2, 1, max_tokens=3, ignore_eos=True)[0]
    b = make_group(10, 10, 1, max_tokens=2, ignore_eos=True)[0]
    c = make_group(20, 4, 1, max_tokens=1, ignore_eos=True)[0]
    for s in (a, b, c):
        sched.add(s)
    history: list[list[tuple[int, int, int, bool]]] = []
    run(sched, runner, lambda i, out: history.append(chunks_of(out)))
    assert history[:4] == [
        [(0, 0, 2, True), (10, 0, 4, False)],  # admissions in order; B cut by the budget
        [(0, 2, 1, True), (10, 4, 5, False)],  # decode first, then B's continuing prefill
        [(0, 3, 1, True), (10, 9, 1, True), (20, 0, 4, True)],  # A done; C admitted with the rest
        [(10, 10, 1, True)],
    ]
    assert [s.finish_reason for s in (a, b, c)] == ["length"] * 3


@pytest.mark.parametrize("budget", [3, 5, 64])
def test_chunking_does_not_change_outputs(budget: int) -> None:
    results = []
    for b in (budget, 1000):
        sched = make_sched(num_blocks=64, budget=b, max_num_seqs=4)
        runner = FakeRunner(sched.block_manager)
        seqs = make_group(0, 20, 1, 8) + make_group(1, 13, 1, 8) + make_group(2, 3, 1, 8)
        for s in seqs:
            sched.add(s)
        run(sched, runner)
        results.append(outputs(seqs))
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "prompt_len,block_size,n", [(10, 4, 4), (9, 4, 3), (3, 4, 5), (17, 4, 2), (2, 1, 3)]
)
def test_prefix_sharing_saves_exact_blocks(prompt_len: int, block_size: int, n: int) -> None:
    shared_blocks = (
        prompt_len - 1
    ) // block_size + n  # floor((P-1)/bs) full-or-forked + one per member
    alone_blocks = n * -(-prompt_len // block_size)
    finals = []
    for sharing in (True, False):
        sched = make_sched(num_blocks=100, block_size=block_size, budget=100, sharing=sharing)
        runner = FakeRunner(sched.block_manager)
        group = make_group(0, prompt_len, n, max_tokens=6)
        sched.add_group(group)
        first = sched.schedule()
        sched.postprocess(first, runner(first))
        sched.check_invariants()
        if sharing:
            assert chunks_of(first) == [
                (0, 0, prompt_len - 1, False)
            ]  # the leader alone, no sample
            second = sched.schedule()
            assert chunks_of(second) == [(j, prompt_len - 1, 1, True) for j in range(n)]
            expected_copies = n - 1 if (prompt_len - 1) % block_size else 0
            assert len(second.block_copies) == expected_copies
            sched.postprocess(second, runner(second))
            sched.check_invariants()
            assert runner.tokens_computed == prompt_len - 1 + n
            assert sched.block_manager.num_used_blocks == shared_blocks
        else:
            assert chunks_of(first) == [(j, 0, prompt_len, True) for j in range(n)]
            assert runner.tokens_computed == n * prompt_len
            assert sched.block_manager.num_used_blocks == alone_blocks
        assert all(s.num_generated == 1 for s in group)
        run(sched, runner)
        finals.append(outputs(group))
    assert finals[0] == finals[1]
    assert alone_blocks - shared_blocks == (n - 1) * ((prompt_len - 1) // block_size)


def test_continuous_batching_frees_and_admits_next_step() -> None:
    sched = make_sched(num_blocks=16, max_num_seqs=2)
    runner = FakeRunner(sched.block_manager)
    a = make_group(0, 3, 1, max_tokens=1, ignore_eos=True)[0]
    b = make_group(1, 3, 1, max_tokens=4, ignore_eos=True)[0]
    c = make_group(2, 3, 1, max_tokens=2, ignore_eos=True)[0]
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [ch.seq for ch in out.chunks] == [a, b] and c.status is SequenceStatus.WAITING
    assert sched.postprocess(out, runner(out)) == [a]
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert sched.block_manager.num_used_blocks == 1  # only b's block
    out = sched.schedule()
    assert chunks_of(out) == [(1, 3, 1, True), (2, 0, 3, True)]  # c joins as a leaves
    sched.postprocess(out, runner(out))
    run(sched, runner)
    assert [s.num_generated for s in (a, b, c)] == [1, 4, 2]


GROUPS = [(7, 3), (12, 1), (5, 2), (9, 4)]  # (prompt length, n)


def run_groups(
    num_blocks: int, sharing: bool, budget: int = 16, max_tokens: int = 12, max_num_seqs: int = 8
) -> tuple[dict, int]:
    sched = make_sched(
        num_blocks=num_blocks, budget=budget, sharing=sharing, max_num_seqs=max_num_seqs
    )
    runner = FakeRunner(sched.block_manager)
    seqs: list[Sequence] = []
    for g, (plen, n) in enumerate(GROUPS):
        group = make_group(100 * g, plen, n, max_tokens=max_tokens)
        sched.add_group(group)
        seqs += group
    run(sched, runner)
    return outputs(seqs), sched.num_preemptions


@pytest.mark.parametrize("sharing", [True, False])
def test_preemption_in_tiny_pool_gives_same_tokens(sharing: bool) -> None:
    reference, none = run_groups(num_blocks=200, sharing=True)
    assert none == 0
    # longest sequence: 12 prompt + 12 sampled -> K/V for 23 tokens -> 6 blocks: the whole pool
    tiny, preemptions = run_groups(num_blocks=6, sharing=sharing)
    assert preemptions > 0
    assert tiny == reference
    assert any(r == "length" for _, r, _ in reference.values())


def test_pool_too_small_for_one_sequence_rejected_at_add() -> None:
    sched = make_sched(num_blocks=5, max_model_len=100)
    with pytest.raises(ValueError, match="whole pool has 5"):
        sched.add_group(make_group(0, 12, 2, max_tokens=12))  # needs 6 blocks
    assert not sched.has_unfinished()
    sched = make_sched(num_blocks=5, max_model_len=21)  # 20 K/V tokens = 5 blocks: fits
    sched.add_group(make_group(0, 12, 2, max_tokens=12))
    with pytest.raises(ValueError, match="no room to generate"):
        sched.add(make_group(9, 21, 1, max_tokens=1)[0])
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add(make_group(0, 3, 1, max_tokens=1)[0])
    with pytest.raises(ValueError, match="prompt differs"):
        sched.add_group([Sequence(50, [1, 2]), Sequence(51, [1, 3])])


def test_stop_conditions() -> None:
    sched = make_sched(num_blocks=16, max_model_len=8)
    eos = Sequence(0, [1, 2], SamplingParams())
    ignored = Sequence(1, [1, 2], SamplingParams(ignore_eos=True, stop_token_ids=[5]))
    capped = Sequence(2, [1, 2, 3, 4, 5], SamplingParams(ignore_eos=True))
    for s in (eos, ignored, capped):
        sched.add(s)
    script = {0: [EOS], 1: [EOS, 3, 5], 2: [EOS, EOS, EOS]}
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(
            out,
            {c.seq.seq_id: (script[c.seq.seq_id].pop(0), -1.0, -2.0) for c in out.sample_chunks},
        )
        sched.check_invariants()
    assert (eos.finish_reason, eos.completion_token_ids) == ("stop", [EOS])
    assert (ignored.finish_reason, ignored.completion_token_ids) == ("stop", [EOS, 3, 5])
    assert (capped.finish_reason, capped.num_tokens) == ("length", 8)  # max_model_len
    assert capped.logprobs == [-1.0] * 3 and capped.raw_logprobs == [-2.0] * 3
    assert sched.block_manager.all_free()


def test_pause_append_resume_keeps_blocks_while_others_progress() -> None:
    sched = make_sched(num_blocks=32)
    runner = FakeRunner(sched.block_manager)
    a = make_group(0, 4, 1, max_tokens=6, ignore_eos=True)[0]
    b = make_group(1, 4, 1, max_tokens=8, ignore_eos=True)[0]
    sched.add(a)
    sched.add(b)
    for _ in range(2):
        out = sched.schedule()
        sched.postprocess(out, runner(out))
    assert a.num_generated == 2 and a.num_computed_tokens == 5
    sched.pause(a)
    table, b_before = list(a.block_table), b.num_tokens
    for _ in range(3):
        out = sched.schedule()
        assert [c.seq for c in out.chunks] == [b]
        sched.postprocess(out, runner(out))
        sched.check_invariants()
        assert a.block_table == table and a.status is SequenceStatus.PAUSED
        assert all(sched.block_manager.ref_count(x) == 1 for x in table)
    assert b.num_tokens == b_before + 3
    sched.append_tokens(a, [7, 8, 9])
    sched.resume(a)
    out = sched.schedule()
    assert (a.seq_id, 5, 4, True) in chunks_of(out)  # extend: last sample + 3 env tokens, one chunk
    sched.postprocess(out, runner(out))
    run(sched, runner)
    assert a.sampled == [False] * 4 + [True, True] + [False] * 3 + [True] * 4
    assert a.num_generated == 6 and a.finish_reason == "length"
    assert a.completion_token_ids[2:5] == [7, 8, 9]


def multi_turn_run(num_blocks: int, sharing: bool, budget: int = 16) -> tuple[dict, int]:
    """Groups whose members pause after 3 samples, get env tokens, and resume two steps later."""
    sched = make_sched(num_blocks=num_blocks, budget=budget, sharing=sharing)
    runner = FakeRunner(sched.block_manager)
    seqs: list[Sequence] = []
    for g, (plen, n) in enumerate(GROUPS):
        group = make_group(100 * g, plen, n, max_tokens=8, ignore_eos=True)
        sched.add_group(group)
        seqs += group
    resume_at: dict[int, int] = {}

    def on_step(step: int, out: SchedulerOutput) -> None:
        for s in seqs:
            if (
                s.status is SequenceStatus.RUNNING
                and s.num_generated == 3
                and s.seq_id not in resume_at
            ):
                sched.pause(s)
                resume_at[s.seq_id] = step + 2
            elif s.status is SequenceStatus.PAUSED and resume_at[s.seq_id] == step:
                sched.append_tokens(s, [(s.seq_id + s.num_tokens) % VOCAB, 1])
                sched.resume(s)
        sched.check_invariants()

    run(sched, runner, on_step)
    assert len(resume_at) == len(seqs)
    return outputs(seqs), sched.num_preemptions


def test_multi_turn_under_memory_pressure_recomputes_paused() -> None:
    reference, none = multi_turn_run(num_blocks=200, sharing=True)
    assert none == 0
    # longest: 12 prompt + 8 sampled + 2 env -> K/V for 21 tokens -> 6 blocks
    tiny, preemptions = multi_turn_run(num_blocks=6, sharing=True, budget=5)
    assert preemptions > 0
    assert tiny == reference
    assert multi_turn_run(num_blocks=9, sharing=False)[0] == reference


def test_paused_sequence_is_preempted_first() -> None:
    sched = make_sched(num_blocks=4, max_model_len=16)
    runner = FakeRunner(sched.block_manager)
    a = make_group(0, 8, 1, max_tokens=7, ignore_eos=True)[0]  # K/V for up to 14 tokens = 4 blocks
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out, runner(out))
    sched.pause(a)
    assert len(a.block_table) == 2
    b = make_group(1, 12, 1, max_tokens=3, ignore_eos=True)[0]  # needs 3 blocks now
    sched.add(b)
    out = sched.schedule()
    assert out.preempted == [a] and [c.seq for c in out.chunks] == [b]
    assert a.status is SequenceStatus.PAUSED and a.block_table == [] and a.num_computed_tokens == 0
    sched.postprocess(out, runner(out))
    sched.resume(a)
    run(sched, runner)
    assert a.num_generated == 7 and b.num_generated == 3


def test_abort_everywhere_leaks_nothing() -> None:
    sched = make_sched(num_blocks=40, budget=4)
    runner = FakeRunner(sched.block_manager)
    group = make_group(0, 10, 3, max_tokens=5, ignore_eos=True)
    sched.add_group(group)
    out = sched.schedule()  # the leader's first prefill chunk; members wait to be forked
    sched.postprocess(out, runner(out))
    sched.abort(group[0])
    sched.check_invariants()
    assert group[0].finish_reason == "abort" and group[0].block_table == []
    other = make_group(10, 6, 2, max_tokens=5, ignore_eos=True)
    sched.add_group(other)
    for _ in range(6):
        out = sched.schedule()
        sched.postprocess(out, runner(out))
        sched.check_invariants()
    sched.abort(other[1])  # forked member (shares blocks) or running: either way no leak
    sched.abort(other[1])  # no-op
    run(sched, runner)
    assert [s.finish_reason for s in group[1:]] == ["length", "length"]
    assert other[0].finish_reason == "length" and other[1].finish_reason == "abort"


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_match_big_pool(seed: int) -> None:
    """Random pools, budgets and groups: same tokens as an unconstrained run, no leak."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    groups = [
        (rng.randint(1, 14), rng.randint(1, 4), rng.randint(1, 10))
        for _ in range(rng.randint(1, 6))
    ]

    def once(num_blocks: int, budget: int, max_num_seqs: int, sharing: bool) -> dict:
        sched = Scheduler(
            BlockManager(num_blocks, block_size),
            max_num_seqs,
            budget,
            enable_prefix_sharing=sharing,
            max_model_len=64,
            eos_token_ids=[EOS],
        )
        runner = FakeRunner(sched.block_manager)
        seqs = []
        for g, (plen, n, max_tokens) in enumerate(groups):
            seqs += make_group(100 * g, plen, n, max_tokens=max_tokens)
            sched.add_group(seqs[-n:])
        run(sched, runner)
        return outputs(seqs)

    reference = once(1000, 1000, 64, False)
    min_blocks = max(-(-(plen + mt - 1) // block_size) for plen, _, mt in groups)
    for _ in range(3):
        num_blocks = rng.randint(min_blocks, 3 * min_blocks)
        got = once(num_blocks, rng.randint(1, 24), rng.randint(1, 8), rng.random() < 0.7)
        assert got == reference
