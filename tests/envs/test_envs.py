"""Environments, the environment worker pool and the agentic tasks (no model involved)."""

from __future__ import annotations

import json
import pickle
import time

import pytest

import tests.env_helpers  # noqa: F401  (registers "sleepy")
from tandem.rl.core.registry import RegistryError
from tandem.rl.data.agentic_tasks import (
    AGENTIC_TASKS,
    load_agentic_jsonl,
    make_agentic_rows,
    make_agentic_sft_rows,
)
from tandem.rl.data.loading import DataError
from tandem.rl.envs import ENVIRONMENTS, StepResult, make_env, step_episode
from tandem.rl.rewards import get_reward
from tandem.rl.workers.env_pool import EnvPool

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def calc(expr: str) -> str:
    return CALL.format(name="calculator", args=json.dumps({"expression": expr}))


def python_call(code: str) -> str:
    return CALL.format(name="python", args=json.dumps({"code": code}))


# ---- registry and the tool environment -------------------------------------------------------


def test_registry_and_config_errors() -> None:
    assert {"tool", "code", "sleepy"} <= set(ENVIRONMENTS.names())
    with pytest.raises(RegistryError, match="did you mean 'tool'"):
        make_env("tools")
    with pytest.raises(TypeError, match="environment 'tool': bad config"):
        make_env("tool", {"max_turns": 3})
    with pytest.raises(RegistryError, match="unknown tool 'shell'"):
        make_env("tool", {"tools": ["shell"]})
    with pytest.raises(RegistryError, match="reward function"):
        make_env("tool", {"reward": "nope"})


def test_tool_env_calculator_then_answer() -> None:
    env = make_env("tool", {"tools": ["calculator"]})
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator"]
    ep = env.new_episode()
    assert ep.reset({"prompt": "What is 1234*5678?", "answer": "7006652"}) == [
        {"role": "user", "content": "What is 1234*5678?"}
    ]
    r = ep.step("Let me compute. " + calc("1234*5678"))
    assert r == StepResult(
        [{"role": "tool", "content": "7006652"}],
        done=False,
        info={"tool_calls": 1.0, "tool_errors": 0.0, "sandbox_limit_hits": 0.0},
    )
    r = ep.step("The answer is \\boxed{7006652}")
    assert r.done and r.reward == 1.0 and r.observation_messages == []
    ep2 = env.new_episode()
    ep2.reset({"prompt": "x", "answer": "3"})
    assert ep2.step("\\boxed{4}").reward == 0.0


def test_malformed_tool_calls_are_error_observations() -> None:
    env = make_env("tool", {"max_tool_calls_per_turn": 2})
    ep = env.new_episode()
    ep.reset({"prompt": "q", "answer": "1"})
    text = (
        "<tool_call>{not json}</tool_call>"
        + CALL.format(name="shell", args="{}")
        + calc("1/0")
        + '<tool_call>{"name": "calculator"'
    )
    r = ep.step(text)
    assert not r.done and r.reward is None
    contents = [m["content"] for m in r.observation_messages]
    assert len(contents) == 4 and all(c.startswith("Error:") for c in contents)
    assert "not valid JSON" in contents[0] and "unknown tool 'shell'" in contents[1]
    assert all("at most 2 tool calls" in c for c in contents[2:])  # over the cap: not run
    assert r.info["tool_calls"] == 4 and r.info["tool_errors"] == 4


def test_python_tool_counts_sandbox_limits_and_errors() -> None:
    env = make_env(
        "tool", {"tools": ["python"], "python_limits": {"cpu_time_s": 1, "wall_time_s": 3}}
    )
    ep = env.new_episode()
    ep.reset({"prompt": "q", "answer": "1"})
    r = ep.step(
        python_call("print(6*7)")
        + python_call("raise SystemExit(3)")
        + python_call("while True: pass")
    )
    out = [m["content"] for m in r.observation_messages]
    assert out[0] == "42\n" and "[exit code 3]" in out[1] and "[stopped:" in out[2]
    assert r.info == {"tool_calls": 3.0, "tool_errors": 2.0, "sandbox_limit_hits": 1.0}
    # the episode (with its env) pickles small: the tool closures are rebuilt, not shipped
    blob = pickle.dumps(ep)
    assert len(blob) < 2000
    again, res = step_episode(pickle.loads(blob), "\\boxed{1}")
    assert res.done and res.reward == 1.0


def test_reward_error_is_counted_not_raised() -> None:
    env = make_env("tool", {"reward": "code_unit_tests"})
    ep = env.new_episode()
    ep.reset({"prompt": "q", "answer": "x"})  # no 'tests': the reward raises KeyError
    r = ep.step("final")
    assert r.done and r.reward == 0.0 and r.info["reward_errors"] == 1.0


def test_code_env_scores_hidden_tests() -> None:
    row = make_agentic_rows("code_function", 1, seed=3)[0]
    env = make_env("code", {"reward_kwargs": {"wall_time_s": 10.0}})
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["python"]
    ep = env.new_episode()
    msgs = ep.reset(row)
    assert msgs[0]["role"] == "system" and msgs[-1]["content"] == row["prompt"]
    assert not any(t in row["prompt"] for t in row["tests"])  # the tests stay hidden
    probe = ep.step(python_call(row["reference"] + "\nprint('ok')"))
    assert probe.observation_messages == [{"role": "tool", "content": "ok\n"}] and not probe.done
    final = ep.step("Here it is:\n```python\n" + row["reference"] + "```")
    assert final.done and final.reward == 1.0
    with pytest.raises(ValueError, match="no 'tests'"):
        env.new_episode().reset({"prompt": "p"})


# ---- the pool ---------------------------------------------------------------------------------


def _square(x: int) -> int:
    return x * x


def _boom(x: int) -> int:
    raise ValueError(f"boom {x}")


def _die(x: int) -> int:
    import os

    os._exit(7)


def _nap(s: float) -> float:
    time.sleep(s)
    return s


@pytest.fixture(scope="module")
def pool():
    with EnvPool(2, step_timeout_s=1.5) as p:
        p.wait_ready()
        yield p


def test_pool_runs_tasks_and_survives_errors_crashes_and_hangs(pool: EnvPool) -> None:
    ok = [pool.submit(_square, i) for i in range(5)]
    bad = pool.submit(_boom, 1)
    t0 = time.monotonic()
    outs = {o.ticket: o for o in pool.poll(0.0)}  # never blocks
    assert time.monotonic() - t0 < 0.5
    while len(outs) < 6:
        outs.update({o.ticket: o for o in pool.poll(None)})
    assert [outs[t].value for t in ok] == [0, 1, 4, 9, 16]
    assert outs[bad].status == "error" and "ValueError: boom 1" in outs[bad].error
    crash = pool.submit(_die, 0)
    hang = pool.submit(_nap, 30.0)
    after = pool.submit(_square, 12)
    outs = {}
    while len(outs) < 3:
        outs.update({o.ticket: o for o in pool.poll(None)})
    assert outs[crash].status == "crash" and outs[crash].attempts == 2  # retried once
    # cut at its 1.5 s, counted from when it started running (a replacement worker first
    # imports this module: seconds on a busy machine, not the step's)
    assert outs[hang].status == "timeout" and outs[hang].seconds < 10
    assert outs[after].status == "ok" and outs[after].value == 144
    assert pool.counts["crashes"] == 2 and pool.counts["timeouts"] == 1
    assert pool.poll(None) == []  # nothing pending: returns at once
    assert pool.submit(_square, 3) is not None and pool.poll(None)[0].value == 9


def test_loading_a_task_is_not_charged_to_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh worker imports a task's module when it unpickles the task (2 s here; a fresh
    checkout on a busy machine spent seconds compiling): the step's clock starts after that.
    Before, every first task timed out and so did each replacement worker's first task, so
    with a 1 s step timeout all five came back "timeout" (the flaky [None, None, 4, None, 16]
    of the test above). A load longer than STARTUP_TIMEOUT_S is still a timeout."""
    from tandem.rl.workers import env_pool
    from tests.envs import slow_import_task

    with EnvPool(2, step_timeout_s=1.0) as p:
        p.wait_ready()
        tickets = [p.submit(slow_import_task.square, i) for i in range(5)]
        outs: dict[int, object] = {}
        while len(outs) < 5:
            outs.update({o.ticket: o for o in p.poll(None)})
        assert [outs[t].value for t in tickets] == [0, 1, 4, 9, 16]
        assert p.counts["timeouts"] == 0 and p.counts["restarts"] == 0
    monkeypatch.setattr(env_pool, "STARTUP_TIMEOUT_S", 0.5)
    with EnvPool(1, step_timeout_s=30.0) as p:
        p.wait_ready()
        t = p.submit(slow_import_task.square, 3)
        (out,) = p.poll(None)
        assert (out.ticket, out.status, out.error) == (
            t,
            "timeout",
            "the worker did not load the task in 0.5 s",
        )


def test_inline_pool() -> None:
    p = EnvPool(0)
    t = p.submit(_square, 4)
    assert p.num_pending == 1
    (o,) = p.poll(0.0)
    assert o.ticket == t and o.value == 16 and p.num_pending == 0
    p.submit(_boom, 2)
    assert p.poll(0.0)[0].status == "error"


# ---- agentic tasks ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["calc_arithmetic", "code_function"])
def test_agentic_tasks_deterministic_and_split(name: str) -> None:
    a = make_agentic_rows(name, 20, seed=1)
    assert a == make_agentic_rows(name, 20, seed=1) and a != make_agentic_rows(name, 20, seed=2)
    test = make_agentic_rows(name, 10, seed=1, split="test")
    assert {r["problem_id"] for r in a}.isdisjoint({r["problem_id"] for r in test})
    assert len({r["problem_id"] for r in a}) == 20
    assert all(r["env"] == AGENTIC_TASKS.get(name).env for r in a)


def test_agentic_task_answers_verify() -> None:
    math = get_reward("math")
    for row in make_agentic_rows("calc_arithmetic", 20, seed=0, digits=5, num_ops=3):
        assert math(f"\\boxed{{{row['answer']}}}", row) == 1.0
        assert eval(row["prompt"].split("What is ")[1].split("?")[0]) == int(row["answer"])
    code = get_reward("code_unit_tests")
    rows = make_agentic_rows("code_function", 5, seed=0, num_tests=4)
    assert {len(r["tests"]) for r in rows} == {4}
    assert [code(f"```python\n{r['reference']}```", r) for r in rows] == [1.0] * 5
    assert code("```python\ndef nothing(): pass\n```", rows[0]) == 0.0


@pytest.mark.parametrize("tool", ["calculator", "python"])
def test_sft_transcripts_replay_through_the_tool_env(tool: str) -> None:
    """Worked episodes for SFT are what the "tool" env does: each assistant turn, played
    into a real episode, yields exactly the transcript's tool turn, and the last scores 1."""
    knobs = dict(digits=3, num_ops=1, ops="*", tool=tool)
    rows = make_agentic_rows("calc_arithmetic", 12, 0, **knobs)
    recs = make_agentic_sft_rows("calc_arithmetic", 12, 0, tool_rate=0.5, **knobs)
    env = make_env("tool", {"tools": [tool]})
    kinds = set()
    for row, rec in zip(rows, recs, strict=True):
        assert rec["tools"] == env.tool_schemas()  # schemas=1 (default): rendered like the env
        msgs = rec["messages"]
        ep = env.new_episode()
        assert ep.reset(row) == msgs[:1]
        i = 1
        while True:
            assert msgs[i]["role"] == "assistant"
            res = ep.step(msgs[i]["content"])
            if res.done:
                break
            assert res.observation_messages == msgs[i + 1 : i + 2] and res.info["tool_errors"] == 0
            i += 2
        assert res.reward == 1.0 and i == len(msgs) - 1
        kinds.add(len(msgs))
    assert kinds == {2, 4}  # both direct answers and tool episodes at tool_rate 0.5
    direct = make_agentic_sft_rows("calc_arithmetic", 5, 0, tool_rate=0.0, schemas=0, **knobs)
    assert all(len(r["messages"]) == 2 and "tools" not in r for r in direct)
    assert make_env("tool", {"tools": [tool], "schemas_in_prompt": False}).tool_schemas() is None
    with pytest.raises(ValueError, match="no worked transcripts"):
        make_agentic_sft_rows("code_function", 2, 0)
    with pytest.raises(ValueError, match="tool_rate"):
        make_agentic_sft_rows("calc_arithmetic", 2, 0, tool_rate=1.5)


def test_load_agentic_jsonl(tmp_path) -> None:
    good = tmp_path / "good.jsonl"
    rows = make_agentic_rows("calc_arithmetic", 2, 0) + make_agentic_rows("code_function", 2, 0)
    lines = [json.dumps(r) for r in rows] + ["", json.dumps({"prompt": "2+2?", "answer": 4})]
    good.write_text("\n".join(lines) + "\n")
    loaded = load_agentic_jsonl(good)
    assert loaded[:4] == rows
    assert loaded[4]["env"] == "tool" and loaded[4]["answer"] == "4"
    assert loaded[4]["messages"] == [{"role": "user", "content": "2+2?"}]
    assert loaded[4]["id"] == "good.jsonl:6"
    cases = {
        '{"prompt": "x", "answer": 1}\n{"prompt": ': r"bad\.jsonl:2: invalid JSON",
        "[1, 2]\n": r"bad\.jsonl:1: expected a JSON object",
        '{"answer": "1"}\n': r"bad\.jsonl:1: needs a non-empty 'prompt'",
        '{"prompt": "x"}\n': r"bad\.jsonl:1: tool rows need an 'answer'",
        '{"prompt": "x", "tests": []}\n': r"bad\.jsonl:1: code rows need 'tests'",
        '{"prompt": "x", "tests": ["assert 1"], '
        '"entry_point": "a b"}\n': r"bad\.jsonl:1: 'entry_point'",
        '{"prompt": "x", "answer": "1", "env": "web"}\n': r"bad\.jsonl:1: unknown 'env'",
        '{"messages": [{"role": "user"}], "answer": "1"}\n': r"bad\.jsonl:1: 'messages' must be",
    }
    bad = tmp_path / "bad.jsonl"
    for text, pattern in cases.items():
        bad.write_text(text)
        with pytest.raises(DataError, match=pattern):
            load_agentic_jsonl(bad)
    with pytest.raises(DataError, match="file not found"):
        load_agentic_jsonl(tmp_path / "missing.jsonl")
