"""Rewards: answer extraction, equivalence, the simple rewards and the RewardPool."""

from __future__ import annotations

import functools
import json
import os
import time

import pytest

import tests.reward_helpers  # noqa: F401  (registers the test_* rewards)
from tandem.rl.core.registry import RegistryError
from tandem.rl.rewards import REWARDS, get_reward
from tandem.rl.rewards.basic import (
    countdown_reward,
    exact_match,
    format_reward,
    length_penalty,
    sequence_match,
)
from tandem.rl.rewards.math import extract_answer, is_equiv, math_reward, normalize_answer, to_sympy
from tandem.rl.workers.reward_pool import RewardPool

# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so the result is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{a^{2}}{\sqrt{b}}} done", r"\frac{a^{2}}{\sqrt{b}}"),  # nested braces
        (r"first \boxed{1}, then \boxed{2}", "2"),  # last box wins
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
        (r"\boxed{unclosed", None),
        ("The answer is $\\frac{3}{4}$.", r"\frac{3}{4}"),
        ("Therefore the answer is: **12**", "12"),
        ("Answer: 42", "42"),
        ("The answer is 3. Let me check: 3 * 1 = 3.", "3"),
        ("The answer is 3.25.", "3.25"),
        ("Final Answer: The final answer is $5$. I hope it is correct.", "5"),
        ("**Answer:** 7", "7"),
        ("#### 1,234", "1,234"),
        ("<answer> 17 </answer>", "17"),
        ("blah 3 then 7 apples", "7"),  # last-number fallback
        ("-3.5 is it", "-3.5"),
        ("no answer here", None),
        ("", None),
        ("<think>\\boxed{1}</think> The answer is 2", "2"),  # only after </think>
        ("<think>I think 5</think>", None),
    ],
)
def test_extract_answer(text: str, want: str | None) -> None:
    assert extract_answer(text) == want


def test_extract_answer_without_number_fallback() -> None:
    assert extract_answer("it is 7", fallback_last_number=False) is None
    assert extract_answer(r"it is \boxed{7}", fallback_last_number=False) == "7"


@pytest.mark.parametrize(
    "raw, want",
    [
        ("$\\dfrac{1}{2}$", r"\frac{1}{2}"),
        (r"\left( 3, 4 \right)", "(3,4)"),
        (r"10 \text{ cm}", "10"),
        ("1,234,567", "1234567"),
        (r"x = \tfrac12", r"\frac{1}{2}"),
        (r"90^\circ", "90"),
        (".5", "0.5"),
        (r"\pi r^2", r"\pi r^2"),
    ],
)
def test_normalize_answer(raw: str, want: str) -> None:
    assert normalize_answer(raw) == want
    assert normalize_answer(want) == want  # idempotent


# --------------------------------------------------------------------------- equivalence

EQUAL = [
    ("1/2", "0.5"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac12", "0.5"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    ("3.0", "3"),
    ("x+1", "1+x"),
    ("1,000", "1000"),
    (r"50\%", "50"),
    (r"50\%", "0.5"),
    ("1e3", "1000"),
    (r"x^2+2x+1", "(x+1)^2"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"),
    (r"\sqrt[3]{8}", "2"),
    (r"\pi r^2", r"r^{2}\pi"),
    (r"\sin x", r"\sin(x)"),
    (r"2\cdot 3", "6"),
    ("(1,2)", r"\left(1, 2\right)"),
    ("x = 5", "5"),
    (r"\{1, 2\}", r"\{2,1\}"),  # sets in any order
    (r"\text{\textbf{7}}", "7"),
]
NOT_EQUAL = [
    ("2", "3"),
    ("0.5", "0.51"),
    ("x+1", "x+2"),
    ("(1,2)", "(2,1)"),
    ("(1,2)", "[1,2]"),
    (r"\{1,2\}", r"\{1,3\}"),
    (r"\sqrt{2}", "1.414"),
    ("2ab", "2"),
    ("", ""),
    ("x", "y"),
    ("2^{100000}", "1"),  # refused, not computed
    ("__import__('os').getcwd()", "1"),  # never evaluated
]


@pytest.mark.parametrize("a, b", EQUAL)
def test_is_equiv_true(a: str, b: str) -> None:
    assert is_equiv(a, b) and is_equiv(b, a)


@pytest.mark.parametrize("a, b", NOT_EQUAL)
def test_is_equiv_false(a: str, b: str) -> None:
    assert not is_equiv(a, b) and not is_equiv(b, a)


def test_to_sympy_refuses_what_it_does_not_know() -> None:
    assert to_sympy("9^9^9") is None  # would take forever to compute
    assert to_sympy("x_1") is None
    assert to_sympy("a.b") is None
    assert to_sympy("2+3") == 5


def test_math_reward() -> None:
    sample = {"answer": "0.5"}
    assert math_reward(r"... so \boxed{\frac{1}{2}}", sample) == 1.0
    assert math_reward(r"... so \boxed{\frac{1}{3}}", sample) == 0.0
    assert math_reward("the value is 0.5", sample) == 1.0
    assert math_reward("the value is 0.5", sample, fallback_last_number=False) == 0.0
    assert math_reward("no idea", sample) == 0.0
    # a worked solution as ground truth is reduced to its boxed answer
    assert math_reward("Answer: 12", {"answer": r"3 \cdot 4 = \boxed{12}"}) == 1.0


DATA = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize(
    "right, wrong, answer",
    [
        (r"\boxed{3\frac{1}{2}}", r"\boxed{3\frac{1}{3}}", r"\frac{7}{2}"),  # mixed number
        (r"\boxed{-3\frac{1}{2}}", r"\boxed{-2\frac{1}{2}}", r"-\frac{7}{2}"),
        (r"\boxed{\log_2 8}", r"\boxed{\log_2 16}", "3"),  # logarithm
        (r"\boxed{3, 2}", r"\boxed{3, 4}", "2, 3"),  # unordered solutions
    ],
    ids=["mixed", "negative-mixed", "log", "unordered"],
)
def test_math_reward_uses_math_verify(right: str, wrong: str, answer: str) -> None:
    assert math_reward(f"so {right}", {"answer": answer}) == 1.0
    assert math_reward(f"so {wrong}", {"answer": answer}) == 0.0


def test_math_verify_never_evaluates_the_answer(tmp_path) -> None:
    from tandem.rl.rewards.math import verify

    marker = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"\\text{{__import__('os').system('touch {marker}')}}",
        f"exec(\"open('{marker}', 'w')\")",
        f"(lambda: __import__('os').system('touch {marker}'))()",
        f"1 + __import__('os').system('touch {marker}')",
        "().__class__.__bases__[0].__subclasses__()",
    ]
    for payload in payloads:
        assert not verify("5", payload, "math_verify") and not verify(payload, "5", "math_verify")
        for completion in (
            f"\\boxed{{{payload}}}",
            f"The final answer is {payload}",
            f"<answer>{payload}</answer>",
        ):
            assert math_reward(completion, {"answer": "5"}) == 0.0
        assert math_reward("\\boxed{5}", {"answer": payload}) == 0.0
    assert not marker.exists()


def test_math_verifier_on_hand_labelled_pairs() -> None:
    from tandem.rl.rewards.math import verify

    rows = [json.loads(line) for line in open(os.path.join(DATA, "math_answer_pairs.jsonl"))]
    right = {
        v: sum(verify(r["gold"], r["pred"], v) == r["equal"] for r in rows)
        for v in ("math_verify", "own")
    }
    false_pos = sum(verify(r["gold"], r["pred"]) and not r["equal"] for r in rows)
    assert len(rows) == 116 and false_pos == 0
    assert right == {"math_verify": 116, "own": 98}, right  # the table in docs/rewards.md


def test_math_reward_pool_bounds_explosive_answers() -> None:
    # math-verify evaluates powers exactly (an exponent tower runs for minutes in C, where
    # SIGALRM cannot reach): the pool's timeout and worker kill are what bound it.
    with RewardPool(1, timeout_s=1.0, kill_grace_s=1.0, rewards=["math"]) as p:
        start = time.monotonic()
        res = p.score(
            [("math", 1.0)],
            [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{5}"],
            [{"answer": "5"}, {"answer": "5"}],
        )
        assert time.monotonic() - start < 15.0
    assert res.scores["math"] == [0.0, 1.0]
    assert res.timeouts["math"] == 1


# -------------------------------------------------------------------------- basic rewards


def test_exact_match() -> None:
    s = {"answer": "Paris"}
    assert exact_match("  paris ", s) == 1.0
    assert exact_match("The answer is Paris.", s) == 1.0
    assert exact_match("<think>hmm</think>PARIS", s) == 1.0
    assert exact_match("PARIS", s, case_sensitive=True) == 0.0
    assert exact_match("Paris", s, case_sensitive=True) == 1.0
    assert exact_match("London", s) == 0.0
    assert exact_match("8", {"answer": 8}) == 1.0  # non-string ground truth


def test_format_reward() -> None:
    s: dict = {}
    assert format_reward("<think>reasoning</think> 42", s) == 1.0
    assert format_reward("\n<think>\na\nb\n</think>\n\\boxed{1}\n", s) == 1.0
    assert format_reward("<think>reasoning</think>   ", s) == 0.0  # empty answer
    assert format_reward("42", s) == 0.0
    assert format_reward("<think>a</think> 1 <think>b</think> 2", s) == 0.0
    assert format_reward("intro <think>a</think> 1", s) == 0.0
    boxed = functools.partial(format_reward, pattern=r".*\\boxed\{.+\}.*")
    assert boxed("so \\boxed{3}", s) == 1.0
    assert boxed("so 3", s) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "<think>a</think>answer <think>more",
        "<think>a</think><think>",
        "<think>a</think>x</think>",
        "<think>a</think> </think>",
    ],
)
def test_format_reward_refuses_extra_think_tags(text: str) -> None:
    assert format_reward(text, {}) == 0.0


def test_format_reward_is_linear_on_long_failing_input() -> None:
    text = "<think>a</think>" + "x" * 20_000 + "<think><think>"  # was ~5 s (quadratic)
    start = time.monotonic()
    assert format_reward(text, {}) == 0.0
    assert format_reward("<think>a</think>" + "x " * 100_000, {}) == 1.0
    assert time.monotonic() - start < 0.5


def test_length_penalty() -> None:
    s: dict = {}
    assert length_penalty("x" * 10, s, soft_chars=100, hard_chars=200) == 0.0
    assert length_penalty("x" * 150, s, soft_chars=100, hard_chars=200) == pytest.approx(-0.5)
    assert length_penalty("x" * 500, s, soft_chars=100, hard_chars=200) == -1.0
    with pytest.raises(ValueError):
        length_penalty("x", s, soft_chars=10, hard_chars=10)


def test_sequence_match() -> None:
    s = {"answer": "1 2 3"}
    assert sequence_match("1 2 3", s) == 1.0
    assert sequence_match("The answer is [1, 2, 3]", s) == 1.0
    assert sequence_match("1 3 2", s) == 0.0
    assert sequence_match("123", s) == 0.0
    assert sequence_match("A b", {"answer": "a B"}) == 0.0
    assert sequence_match("A b", {"answer": "a B"}, case_sensitive=False) == 1.0


def test_countdown_reward() -> None:
    s = {"numbers": [3, 7, 2, 5], "target": 23}
    assert countdown_reward("3*7+2", s) == 1.0
    assert countdown_reward("<think>try</think> (7*3)+2 = 23", s) == 1.0
    assert countdown_reward(r"\boxed{3 \times 7 + 2}", s) == 1.0
    assert countdown_reward("(5-3)/2*7*3+2", s) == 0.0  # uses 3 twice
    assert countdown_reward("3*7+3", s) == 0.0  # wrong value and 3 twice
    assert countdown_reward("21+2", s) == 0.0  # 21 is not given
    assert countdown_reward("3*7+2-5+5", s) == 0.0  # 5 twice
    assert countdown_reward("(7+5)/2*3+5", {"numbers": [7, 5, 2, 3, 5], "target": 23}) == 1.0
    assert countdown_reward("3*7+2", s, use_all=True) == 0.0
    assert (
        countdown_reward("(7-5)*3*2*2", {"numbers": [7, 5, 3, 2, 2], "target": 24}, use_all=True)
        == 1.0
    )
    assert countdown_reward("7/(2-2)", {"numbers": [7, 2, 2], "target": 1}) == 0.0
    assert countdown_reward("-3+26", {"numbers": [3, 26], "target": 23}) == 0.0  # no unary minus
    assert countdown_reward("__import__('os')", s) == 0.0
    assert countdown_reward("3**2", {"numbers": [3, 2], "target": 9}) == 0.0  # no powers


def test_registry() -> None:
    for name in ("math", "exact_match", "format", "length_penalty", "sequence", "countdown"):
        assert name in REWARDS
    with pytest.raises(RegistryError, match="did you mean 'math'"):
        get_reward("maths")
    with pytest.raises(TypeError, match="bad config"):
        get_reward("format", no_such_knob=1)
    assert get_reward("format", pattern="a").keywords == {"pattern": "a"}


# ----------------------------------------------------------------------------- the pool

COMPLETIONS = [
    r"<think>easy</think> \boxed{42}",
    "The answer is 41",
    "<think>x</think>",
    r"\boxed{\frac{1}{2}}",
]
SAMPLES = [{"answer": "42"}, {"answer": "42"}, {"answer": "1"}, {"answer": "0.5"}]
MIX = [("math", 1.0), ("format", 0.5), ("exact_match", 0.25)]


def _proc_state(pid: int) -> str | None:
    """Linux process state letter, or None once the pid is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def pool():
    with RewardPool(2, timeout_s=0.5, kill_grace_s=1.5, rewards=["math"]) as p:
        yield p


def test_pool_matches_inline(pool: RewardPool) -> None:
    res = pool.score(MIX, COMPLETIONS, SAMPLES)
    want = {
        name: [REWARDS.get(name)(c, s) for c, s in zip(COMPLETIONS, SAMPLES, strict=True)]
        for name, _ in MIX
    }
    assert res.scores == want
    assert want["math"] == [1.0, 0.0, 0.0, 1.0]
    assert want["format"] == [1.0, 0.0, 0.0, 0.0]
    assert res.total == pytest.approx([1.75, 0.0, 0.0, 1.0])
    assert res.errors == res.timeouts == res.crashes == {"math": 0, "format": 0, "exact_match": 0}
    inline = RewardPool(0, timeout_s=5.0).score(MIX, COMPLETIONS, SAMPLES)
    assert inline.scores == res.scores and inline.total == res.total
    m = res.metrics()
    assert m["reward/total"] == pytest.approx(2.75 / 4) and m["reward/math/mean"] == 0.5


def test_pool_workers_have_a_memory_cap() -> None:
    small, big = {"mb": 64}, {"mb": 3000}
    with RewardPool(1, timeout_s=5.0) as p:  # the default cap, 2048 MB
        pid = p.worker_pids()
        res = p.score([("test_alloc", 1.0)], ["a"] * 3, [small, big, small])
        assert p.worker_pids() == pid  # MemoryError is an error in the call, not a crash
    assert res.scores["test_alloc"] == [1.0, 0.0, 1.0]
    assert res.errors["test_alloc"] == 1 and res.crashes["test_alloc"] == 0
    assert res.error_examples["test_alloc"].startswith("MemoryError")
    with RewardPool(1, timeout_s=5.0, memory_mb=256) as p:
        assert p.score([("test_alloc", 1.0)], ["a"], [{"mb": 300}]).errors["test_alloc"] == 1
    with RewardPool(1, timeout_s=5.0, memory_mb=None) as p:
        assert p.score([("test_alloc", 1.0)], ["a"], [{"mb": 300}]).scores["test_alloc"] == [1.0]


def test_pool_weighted_total_and_kwargs() -> None:
    with RewardPool(1, timeout_s=5.0, reward_kwargs={"test_len": {"scale": 2.0}}) as p:
        res = p.score(
            [("test_len", 0.5), ("math", -1.0)], ["ab", "3"], [{"answer": "1"}, {"answer": "3"}]
        )
    assert res.scores == {"test_len": [4.0, 2.0], "math": [0.0, 1.0]}
    assert res.total == [2.0, 0.0]


def test_pool_error_counts(pool: RewardPool) -> None:
    samples = [{"bad": False}, {"bad": True}, {"bad": False}, {"bad": True}]
    res = pool.score([("test_raise", 1.0), ("test_nan", 1.0)], ["a"] * 4, samples)
    assert res.scores["test_raise"] == [1.0, 0.0, 1.0, 0.0]
    assert res.errors == {"test_raise": 2, "test_nan": 4}
    assert res.error_examples["test_raise"] == "ValueError: bad sample"
    assert res.crashes == res.timeouts == {"test_raise": 0, "test_nan": 0}


def test_pool_timeout_interrupts_call(pool: RewardPool) -> None:
    pids = pool.worker_pids()
    samples = [{"hang": i == 1} for i in range(6)]
    t0 = time.monotonic()
    res = pool.score([("test_hang", 1.0), ("test_len", 1.0)], ["abc"] * 6, samples)
    elapsed = time.monotonic() - t0
    assert res.scores["test_hang"] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert res.scores["test_len"] == [3.0] * 6
    assert res.timeouts == {"test_hang": 1, "test_len": 0}
    assert elapsed < 5.0
    assert pool.worker_pids() == pids  # SIGALRM stopped it; the worker lives on


def test_pool_timeout_kills_stuck_worker(pool: RewardPool) -> None:
    before = pool.worker_pids()
    samples = [{"hang": i == 2} for i in range(4)]
    t0 = time.monotonic()
    res = pool.score([("test_stubborn_hang", 1.0)], ["x"] * 4, samples)
    assert time.monotonic() - t0 < 8.0
    assert res.scores["test_stubborn_hang"] == [1.0, 1.0, 0.0, 1.0]
    assert res.timeouts["test_stubborn_hang"] == 1 and res.crashes["test_stubborn_hang"] == 0
    after = pool.worker_pids()
    killed = set(before) - set(after)
    assert len(killed) == 1 and len(after) == 2
    assert all(_proc_state(pid) is None for pid in killed)  # reaped, not a zombie
    assert pool.score(MIX, COMPLETIONS, SAMPLES).total == pytest.approx([1.75, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("fn", ["test_crash", "test_kill9"])
def test_pool_survives_crashes(pool: RewardPool, fn: str) -> None:
    before = pool.worker_pids()
    samples = [{"crash": i == 1} for i in range(5)]
    res = pool.score([(fn, 1.0), ("test_len", 1.0)], ["ab"] * 5, samples)
    dead = set(before) - set(pool.worker_pids())
    assert len(dead) == 1 and all(_proc_state(pid) is None for pid in dead)  # reaped
    assert res.scores[fn] == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert res.crashes == {fn: 1, "test_len": 0}
    assert res.scores["test_len"] == [2.0] * 5  # items queued behind the crash ran elsewhere
    assert "worker died" in res.error_examples[fn]
    assert pool.score(MIX, COMPLETIONS, SAMPLES).total == pytest.approx([1.75, 0.0, 0.0, 1.0])


def test_pool_unknown_names_and_bad_args() -> None:
    with pytest.raises(RegistryError, match="unknown reward function 'exact'"):
        RewardPool(2, timeout_s=1.0, rewards=["exact"])
    with pytest.raises(RegistryError, match="did you mean 'format'"):
        RewardPool(2, timeout_s=1.0, reward_kwargs={"formt": {}})
    with pytest.raises(ValueError, match="not fork"):
        RewardPool(1, timeout_s=1.0, start_method="fork")
    inline = RewardPool(0, timeout_s=1.0)
    with pytest.raises(RegistryError):
        inline.score([("nope", 1.0)], ["a"], [{}])
    with pytest.raises(ValueError, match="listed twice"):
        inline.score([("math", 1.0), ("math", 2.0)], ["a"], [{}])
    with pytest.raises(ValueError, match="completions"):
        inline.score([("math", 1.0)], ["a", "b"], [{}])
    assert inline.score([("math", 1.0)], [], []).total == []


def test_inline_pool_errors_and_timeout() -> None:
    p = RewardPool(0, timeout_s=0.3)
    t0 = time.monotonic()
    res = p.score(
        [("test_hang", 1.0), ("test_raise", 2.0)],
        ["a", "b"],
        [{"hang": True, "bad": False}, {"hang": False}],
    )
    assert time.monotonic() - t0 < 3.0
    assert res.scores == {"test_hang": [0.0, 1.0], "test_raise": [1.0, 0.0]}
    assert res.timeouts["test_hang"] == 1 and res.errors["test_raise"] == 1
    assert res.total == [2.0, 1.0]


def test_pool_close_leaves_no_processes() -> None:
    p = RewardPool(1, timeout_s=5.0)
    assert p.score([("test_len", 1.0)], ["abc"], [{}]).total == [3.0]
    pids = p.worker_pids()
    assert all(_proc_state(pid) not in (None, "Z") for pid in pids)
    p.close()
    p.close()  # idempotent
    assert all(_proc_state(pid) is None for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.score([("test_len", 1.0)], ["a"], [{}])
    assert os.getpid() > 0


def test_a_reward_outside_the_range_is_a_counted_error_in_the_dtype_it_is_summed_in() -> None:
    """1e39 is finite in float64 and inf in float32 (where rewards are summed): an error."""
    from tandem.rl.core.reward_range import REWARD_LIMIT
    from tandem.rl.envs.base import StepResult

    for scale, ok in ((1e39, False), (REWARD_LIMIT, True), (REWARD_LIMIT * 1.5, False)):
        pool = RewardPool(0, timeout_s=5.0, reward_kwargs={"test_len": {"scale": scale}})
        res = pool.score([("test_len", 1.0)], ["a"], [{}])
        assert res.errors["test_len"] == (0 if ok else 1), scale
        assert res.scores["test_len"] == [scale if ok else 0.0]
        if not ok:
            assert res.error_examples["test_len"].startswith("the reward must lie in [-1e+06")
    with pytest.raises(ValueError, match=r"reward must lie in \[-1e\+06, 1e\+06\], got 1e\+39"):
        StepResult([], done=True, reward=1e39)
    with pytest.raises(ValueError, match="an integer of 400 digits"):
        StepResult([], done=True, reward=10**399)
