"""`Admission`, the staleness bound's bookkeeping: hand cases and a randomised schedule."""

import os
import random

import pytest

from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.data.prompts import PromptStream
from tandem.rl.rollout.inflight import Admission


def _positions(flights):
    return [f.position for f in flights]


def _more(adm, stream, version):
    """Top up as if every group in flight were complete: P more, within the capacity."""
    return adm.top_up(stream, version, {f.position for f in adm.flights})


def test_a_step_admits_up_to_p_in_flight_so_a_short_workload_stays_fresh():
    stream, adm = PromptStream(100, 0, shuffle=False), Admission(2, 3, 0)
    assert _positions(adm.admit(stream, 0)) == [0, 1]  # P, not P (S + 1), at once
    assert _positions(adm.choose({0, 1}, 0)) == [0, 1]
    adm.remove({0, 1})
    assert _positions(adm.admit(stream, 1)) == [2, 3]  # every group admitted fresh
    assert _positions(adm.top_up(stream, 1, {2})) == [4]  # half still running: one more
    adm.remove({2, 4})
    assert _positions(adm.admit(stream, 2)) == [5]  # the group left over counts


def test_a_step_waiting_on_stragglers_admits_one_new_group_per_complete_one():
    stream, adm = PromptStream(100, 0, shuffle=False), Admission(3, 1, 0)
    adm.admit(stream, 0)
    assert adm.choose({0}, 0) is None
    assert adm.top_up(stream, 0, {0}) == []  # more than half of P still running: no tail yet
    assert _positions(adm.top_up(stream, 0, {0, 1})) == [3, 4]  # one straggler: P running again
    assert _positions(adm.top_up(stream, 0, {0, 1, 3, 4})) == [5]  # capacity P (S + 1) = 6
    assert adm.top_up(stream, 0, {0, 1, 3, 4, 5}) == []  # full
    assert _positions(adm.choose({0, 1, 3, 4}, 0)) == [0, 1, 3]
    sync = Admission(3, 0, 0)
    sync.admit(stream, 0)
    assert _more(sync, stream, 0) == []  # S = 0: the capacity is P


def test_staleness_zero_is_the_synchronous_schedule():
    stream, adm = PromptStream(100, 0, shuffle=False), Admission(4, 0, 0)
    assert _positions(adm.admit(stream, 0)) == [0, 1, 2, 3]
    assert adm.admit(stream, 0) == []  # full: P (S + 1) = 4
    assert adm.choose({0, 1, 2}, 0) is None  # a step waits for every group it admitted
    assert _positions(adm.choose({0, 1, 2, 3}, 0)) == [0, 1, 2, 3]


def test_a_step_never_leaves_more_due_groups_than_the_next_steps_can_train():
    # P = 1, S = 2: A, B, C admitted at version 0 are all due at version 2
    stream, adm = PromptStream(100, 0, shuffle=False), Admission(1, 2, 0)
    adm.admit(stream, 0)
    for _ in range(3):
        _more(adm, stream, 0)
    assert _positions(adm.flights) == [0, 1, 2]  # the capacity, P (S + 1)
    assert _positions(adm.choose({2}, 0)) == [2]  # C first: A and B can still train at 1 and 2
    adm.remove({2})
    assert _positions(_more(adm, stream, 1)) == [3]  # D, due at 3
    assert adm.choose({3}, 1) is None  # training D now would leave A and B both for version 2
    assert _positions(adm.choose({0, 3}, 1)) == [0]  # earliest deadline first
    adm.remove({0})
    assert _positions(adm.choose({1, 3}, 2)) == [1]  # B is due now


@pytest.mark.parametrize("per_step,staleness", [(1, 0), (3, 1), (4, 2), (2, 3)])
def test_random_completion_times_keep_the_bound_and_train_every_prompt_once(per_step, staleness):
    rng = random.Random(per_step * 10 + staleness)
    stream, adm = PromptStream(10_000, 0, shuffle=False), Admission(per_step, staleness, 0)
    ready_at = {}  # position -> generator tick at which the group completes
    tick, trained, late = 0, [], 0
    for version in range(60):
        for f in adm.admit(stream, version):
            ready_at[f.position] = tick + int(rng.paretovariate(1.2) * 3)  # a long tail
        while True:
            complete = {p for p, t in ready_at.items() if t <= tick}
            chosen = adm.choose(complete, version)
            if chosen is not None:
                break
            for f in adm.top_up(stream, version, complete):  # as the rollout does
                ready_at[f.position] = tick + int(rng.paretovariate(1.2) * 3)
            tick += 1  # generation goes on until the step can be made
        for f in chosen:
            assert version - f.version <= staleness  # trained within S versions of its admission
            assert f.version <= version
            del ready_at[f.position]
        adm.remove({f.position for f in chosen})
        trained += _positions(chosen)
        late = max(late, max(version - f.version for f in chosen))
    assert late == staleness  # the long tail used the whole bound
    assert len(trained) == len(set(trained)) == 60 * per_step  # every prompt once
    assert sorted(trained + _positions(adm.flights)) == list(range(stream.cursor))  # none lost


def test_a_resume_with_a_smaller_bound_gives_the_late_groups_back_to_the_stream():
    stream, adm = PromptStream(100, 0, shuffle=False), Admission(2, 2, 0)
    adm.admit(stream, 0)
    for _ in range(2):
        _more(adm, stream, 0)  # 6 groups due at 2
    adm.remove({0, 1})
    _more(adm, stream, 1)  # 2 more, due at 3
    state = adm.state_dict()
    tight = Admission(2, 1, 0)  # resumed with S = 1 at version 2
    tight.load_state_dict(state)
    expired = tight.expire(2, stream)
    assert sorted(_positions(expired)) == [2, 3, 4, 5]  # admitted at 0: due at 1 now, late
    assert _positions(tight.flights) == [6, 7]  # admitted at 1: due at 2, two for a step of 2
    assert stream.requeued == [2, 3, 4, 5]
    assert [p for p, _ in stream.take(3)] == [2, 3, 4]  # sampled again before new positions
    assert [p for p, _ in stream.take(2)] == [5, 8]
    smaller = Admission(1, 1, 0)  # and with P = 1 too: one group per step, two due at 2
    smaller.load_state_dict({"flights": [f for f in state["flights"] if f["version"] == 1]})
    assert _positions(smaller.expire(2, stream)) == [7]  # the youngest goes back


def test_a_staleness_bound_needs_an_asynchronous_mode():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "configs", "quickstart.toml")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["rollout.max_staleness=1"])
    assert str(e.value).startswith(
        "rollout.max_staleness: 1 needs rollout.mode = 'colocated_async'"
    )
    cfg = load_config(path, ["rollout.mode=colocated_async", "rollout.max_staleness=1"])
    assert (cfg.rollout.mode, cfg.rollout.max_staleness) == ("colocated_async", 1)


@pytest.mark.parametrize(
    "override, label",
    [
        ("env.kind=http", 'env.kind = "http"'),
        ("model.path=assets/quickstart-vlm-policy", "a vision-language model"),
    ],
)
def test_colocated_async_refuses_what_it_has_not_run_with(override, label):
    """The table's rows for the shipped async quickstart, loaded as a user would."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "configs", "quickstart_async.toml")
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    assert str(e.value).startswith(
        f"rollout.mode: rollout.mode = 'colocated_async' does not run with {label} yet ("
    )
    load_config(path, [override, "rollout.mode=sync", "rollout.max_staleness=0"])  # sync: fine


def test_the_drop_budget_drops_the_first_failing_groups_in_stream_order():
    """B = 2: of the failing groups 1, 3, 4, 5, 6 (stream order) the first two are dropped and
    the later ones train, whatever order they complete in; a failing group waits only while the
    incomplete groups before it could still take the budget."""
    from tandem.rl.rollout.inflight import DropBudget

    b = DropBudget(2)
    # 3 fails while 0, 1, 2 run: 3 failing ones could come before it, so it waits
    assert b.decide({0: None, 1: None, 2: None, 3: False}) == (set(), set())
    # 0 passes, 1 fails (first failing: dropped); 3 still waits on 2
    assert b.decide({0: True, 1: False, 2: None, 3: False}) == ({1}, set())
    # 2 passes: 3 is the second failing group (dropped), 4 the third (kept), and 6 is kept
    # though 5 runs: the budget is spent whatever 5 does
    assert b.decide({0: True, 2: True, 3: False, 4: False, 5: None, 6: False}) == ({3}, {4, 6})
    assert b.decide({5: False}) == (set(), {5})
    b.reset()  # the next step's budget
    assert b.decide({7: False, 8: False, 9: False}) == ({7, 8}, {9})
    # the same decisions in one synchronous round each: groups 0..6 complete together
    b = DropBudget(2)
    both = {0: True, 1: False, 2: True, 3: False, 4: False, 5: True, 6: False}
    assert b.decide(both) == ({1, 3}, {4, 6})


@pytest.mark.parametrize("seed", range(20))
def test_the_drop_budget_in_any_completion_order_drops_the_first_failing_groups(seed):
    """Groups complete one by one in a random order: the groups dropped are exactly the first B
    failing ones in stream order (the synchronous rule), and each is decided once."""
    from tandem.rl.rollout.inflight import DropBudget

    rng = random.Random(seed)
    n, budget = rng.randint(1, 30), rng.randint(0, 8)
    passes = {p: rng.random() < 0.4 for p in range(n)}
    b, groups, dropped, kept = DropBudget(budget), dict.fromkeys(range(n)), set(), set()
    for pos in rng.sample(range(n), n):
        groups[pos] = passes[pos]
        d, k = b.decide({p: v for p, v in groups.items() if p not in dropped | kept})
        assert not (d | k) & (dropped | kept)
        dropped |= d
        kept |= k
    failing = [p for p in range(n) if not passes[p]]
    assert dropped == set(failing[:budget]) and kept == set(failing[budget:])
