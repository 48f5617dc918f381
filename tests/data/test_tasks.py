"""Synthetic tasks: determinism, disjoint splits, and answers that verify with their reward."""

from __future__ import annotations

import json

import pytest

from tandem.rl.core.registry import RegistryError
from tandem.rl.data.loading import load_rows
from tandem.rl.data.tasks import TASK_REWARD, TASKS, make_task_rows, split_of, write_jsonl
from tandem.rl.rewards import REWARDS

ALL_TASKS = ["arithmetic", "countdown", "sorting", "addition_small"]  # text tasks
IMAGE_TASKS = ["shapes"]  # rows with a picture (configs/quickstart_vlm*.toml, their tests)
LONG_TASKS = ["needle"]  # long-context retrieval (configs/quickstart_long.toml)
FIELDS = {"id", "task", "prompt", "messages", "answer", "reward", "problem_id"}


def test_registered_tasks() -> None:
    assert TASKS.names() == sorted(ALL_TASKS + IMAGE_TASKS + LONG_TASKS)
    assert TASK_REWARD == {
        "arithmetic": "math",
        "countdown": "countdown",
        "sorting": "sequence",
        "addition_small": "exact_match",
        "shapes": "exact_match",
        "needle": "exact_match",
    }
    assert all(reward in REWARDS for reward in TASK_REWARD.values())


@pytest.mark.parametrize("name", ALL_TASKS)
def test_deterministic(name: str) -> None:
    a = make_task_rows(name, 30, seed=1, split="train")
    assert a == make_task_rows(name, 30, seed=1, split="train")
    assert a != make_task_rows(name, 30, seed=2, split="train")
    assert make_task_rows(name, 10, seed=1, split="train") == a[:10]  # a prefix, not a reshuffle


@pytest.mark.parametrize("name", ALL_TASKS)
def test_rows_have_the_contract(name: str) -> None:
    rows = make_task_rows(name, 20, seed=0, split="test")
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    for r in rows:
        assert FIELDS <= set(r)
        assert r["task"] == name and r["reward"] == TASK_REWARD[name]
        assert r["messages"] == [{"role": "user", "content": r["prompt"]}]
        assert isinstance(r["answer"], str) and r["answer"]
        assert split_of(name, _key_of(r)) == "test"


def _key_of(row: dict) -> str:
    """Keys as the generators build them (countdown's also sorts the numbers)."""
    prompt = row["prompt"]
    if row["task"] == "arithmetic":
        return prompt.removeprefix("What is ").removesuffix("?")
    if row["task"] == "sorting":
        return prompt.removeprefix("Sort in ascending order: ")
    if row["task"] == "addition_small":
        return prompt.removesuffix("=")
    return f"{sorted(row['numbers'])}->{row['target']}"


@pytest.mark.parametrize("name", ALL_TASKS)
def test_splits_are_disjoint(name: str) -> None:
    train = make_task_rows(name, 300, seed=0, split="train") + make_task_rows(
        name, 100, seed=5, split="train"
    )
    test = make_task_rows(name, 100, seed=0, split="test") + make_task_rows(
        name, 100, seed=9, split="test"
    )
    assert not {r["problem_id"] for r in train} & {r["problem_id"] for r in test}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(split_of(name, _key_of(r)) == "train" for r in train)
    assert all(split_of(name, _key_of(r)) == "test" for r in test)


def _wrong(row: dict) -> str:
    if row["task"] in ("arithmetic", "addition_small"):
        return str(int(row["answer"]) + 1)
    if row["task"] == "sorting":
        items = row["answer"].split()
        return " ".join(items[1:] + items[:1]) if len(set(items)) > 1 else "x " * len(items)
    return f"({row['answer']})+1"  # countdown: off by one (or uses a number not given)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_answers_verify(name: str) -> None:
    rows = make_task_rows(name, 40, seed=3, split="train") + make_task_rows(
        name, 20, seed=3, split="test"
    )
    fn = REWARDS.get(TASK_REWARD[name])
    assert [fn(r["answer"], r) for r in rows] == [1.0] * len(rows)
    assert [fn(f"<think>ok</think>The answer is {r['answer']}", r) for r in rows] == [1.0] * len(
        rows
    )
    assert [fn(_wrong(r), r) for r in rows] == [0.0] * len(rows)


def test_arithmetic_knobs() -> None:
    rows = make_task_rows("arithmetic", 50, seed=0, split="train", digits=3, num_ops=2, ops="*-")
    for r in rows:
        expr = r["prompt"].removeprefix("What is ").removesuffix("?")
        assert "+" not in expr
        nums = expr.replace("*", " ").replace("-", " ").split()
        assert len(nums) == 3 and all(len(n) == 3 for n in nums)
    assert make_task_rows("arithmetic", 1, 0, "train", digits=1)[0]["prompt"] != rows[0]["prompt"]


def test_arithmetic_precedence() -> None:
    for r in make_task_rows("arithmetic", 50, seed=4, split="train", digits=1, num_ops=3):
        expr = r["prompt"].removeprefix("What is ").removesuffix("?")
        assert int(r["answer"]) == eval(expr)  # trusted, generated text


def test_countdown_rows() -> None:
    rows = make_task_rows("countdown", 30, seed=0, split="train", num_numbers=3, max_number=10)
    for r in rows:
        assert len(r["numbers"]) == 3 and all(1 <= n <= 10 for n in r["numbers"])
        assert 0 < r["target"] <= 999 and f"equals {r['target']}" in r["prompt"]


def test_sorting_letters() -> None:
    r = make_task_rows("sorting", 1, seed=0, split="train", length=6, alphabet="letters")[0]
    items = r["prompt"].split(": ")[1].split()
    assert len(items) == 6 and all(c.isalpha() for c in items)
    assert r["answer"] == " ".join(sorted(items))


def test_addition_small_covers_its_split_then_repeats() -> None:
    train = make_task_rows("addition_small", 500, seed=0, split="train")
    test = make_task_rows("addition_small", 50, seed=0, split="test")
    train_keys, test_keys = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_keys) + len(test_keys) == 100  # every a+b with a, b in 0..9, once
    assert 5 <= len(test_keys) <= 40
    assert len({r["prompt"] for r in train[: len(train_keys)]}) == len(train_keys)  # unique first
    r = train[0]
    assert (
        len(r["prompt"]) == 4
        and r["prompt"].endswith("=")
        and r["answer"] == str(eval(r["prompt"][:-1]))
    )


def test_bad_arguments() -> None:
    with pytest.raises(RegistryError, match="unknown task"):
        make_task_rows("arith", 1, 0, "train")
    with pytest.raises(ValueError, match="unknown knob"):
        make_task_rows("arithmetic", 1, 0, "train", digit=3)
    with pytest.raises(ValueError, match="split"):
        make_task_rows("arithmetic", 1, 0, "valid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ops"):
        make_task_rows("arithmetic", 1, 0, "train", ops="/")


def test_write_jsonl_round_trip(tmp_path) -> None:
    rows = make_task_rows("countdown", 5, seed=0, split="test")
    path = write_jsonl(rows, tmp_path / "sub" / "countdown.jsonl")
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == rows
    assert load_rows(path) == rows


def test_addition_small_stray_habit_only_changes_the_sft_reply() -> None:
    from tandem.rl.data.sft import load_sft_records
    from tandem.rl.rewards.basic import exact_match

    clean = make_task_rows("addition_small", 200, seed=0, split="train", max_value=19)
    assert all(r["sft_reply"] == r["answer"] for r in clean)
    rows = make_task_rows("addition_small", 400, seed=0, split="train", max_value=19, stray=0.5)
    habit = [r for r in rows if r["sft_reply"] != r["answer"]]
    assert all(r["sft_reply"] == r["answer"] + "!" for r in habit)
    assert 0.4 < len(habit) / len(rows) < 0.6
    assert all(r["answer"] == str(eval(r["prompt"][:-1])) for r in rows)  # ground truth unchanged
    assert (
        exact_match(habit[0]["sft_reply"], habit[0]) == 0.0
        and exact_match(habit[0]["answer"], habit[0]) == 1.0
    )
    records = load_sft_records(
        "synthetic:addition_small?max_value=19&stray=0.5", "auto", seed=0, n_synthetic=400
    )
    assert [r["messages"][-1]["content"] for r in records] == [r["sft_reply"] for r in rows]
    with pytest.raises(ValueError, match="stray"):
        make_task_rows("addition_small", 1, seed=0, split="train", stray=1.5)
