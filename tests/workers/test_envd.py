"""tandem-envd on loopback: the quickstart's environment and rewards through two services equal
local workers; the token gate; a retried request runs once; kill -9 of one service mid-call
re-runs its steps on the other, each answered once."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import AuthenticationError
from pathlib import Path

import pytest

import tests.env_helpers  # noqa: F401  (registers "sleepy" and "tool_pid")
import tests.reward_helpers  # noqa: F401  (registers "test_len")
from tandem.rl.envs.base import make_env, step_episode
from tandem.rl.workers.env_pool import EnvPool
from tandem.rl.workers.envd_client import RemoteEnvPool, RemoteRewardPool, open_link
from tandem.rl.workers.reward_pool import RewardPool

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "loopback-test-token"
# the quickstart_agentic environment (configs/quickstart_agentic.toml), logging who ran each step
TOOL_KWARGS = {"tools": ["python"], "reward": "math", "schemas_in_prompt": False}
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(%d * %d)"}}</tool_call>'


class Envd:
    def __init__(self, tmp: Path, name: str) -> None:
        self.sandboxes = tmp / f"{name}-tmp"  # its TMPDIR: where its sandboxed runs work
        self.sandboxes.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_ENVD_TOKEN": TOKEN}
        env["TMPDIR"] = str(self.sandboxes)
        self.err = tmp / f"{name}.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.rl.workers.envd", "--port", "0", "--workers", "2"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.err.open("w"),
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("tandem-envd listening on "), (line, self.err.read_text())
        self.address = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Envd]]:
    tmp = tmp_path_factory.mktemp("envd")
    servers = [Envd(tmp, "a"), Envd(tmp, "b")]
    yield servers
    for s in servers:
        s.stop()


def tool_steps(log: Path) -> list[tuple[object, str]]:
    """(episode, assistant turn) pairs: python tool calls and final answers of math rows."""
    env = make_env("tool_pid", {"log": str(log), **TOOL_KWARGS})
    steps = []
    for i in range(6):
        ep = env.new_episode()
        ep.reset({"prompt": f"What is {i} * 7?", "answer": str(7 * i)})
        turn = CALL % (i, 7) if i % 2 else f"The answer is \\boxed{{{7 * i + i % 3 // 2}}}"
        steps.append((ep, turn))
    return steps


def run(pool: object, steps: list[tuple[object, str]]) -> dict[int, tuple]:
    tickets = {pool.submit(step_episode, ep, turn): i for i, (ep, turn) in enumerate(steps)}  # type: ignore[attr-defined]
    out: dict[int, tuple] = {}
    while len(out) < len(steps):
        for o in pool.poll(None):  # type: ignore[attr-defined]
            assert o.ticket not in out  # each step answered once
            assert o.status == "ok", o.error
            episode, result = o.value
            out[tickets[o.ticket]] = (
                result.observation_messages,
                result.done,
                result.reward,
                result.info,
                episode.turns,
                episode.row,
            )
    return out


def test_tool_env_and_rewards_equal_local_workers(two: list[Envd], tmp_path: Path) -> None:
    local_log, remote_log = tmp_path / "local.log", tmp_path / "remote.log"
    with EnvPool(2, step_timeout_s=60) as pool:
        want = run(pool, tool_steps(local_log))
    with RemoteEnvPool([s.address for s in two], TOKEN.encode(), step_timeout_s=60) as pool:
        got = run(pool, tool_steps(remote_log))
    assert got == want
    assert "35" in str(got[5][0])  # the python tool ran: 5 * 7
    assert [got[i][2] for i in (0, 2, 4)] == [1.0, 0.0, 1.0]  # 0 and 28 right, 15 for 14 wrong
    # every step ran once, and in both services' workers (the log holds the worker's parent)
    parents = [line.split()[0] for line in remote_log.read_text().splitlines()]
    assert len(parents) == 6 and {str(s.proc.pid) for s in two} == set(parents)

    fns = [("test_len", 1.0), ("math", 0.5)]
    completions = [f"so \\boxed{{{k}}}" + "x" * k for k in range(9)]
    samples = [{"answer": str(k % 4)} for k in range(9)]
    with RewardPool(1, 10.0) as local:
        want_r = local.score(fns, completions, samples)
    with RemoteRewardPool(
        [s.address for s in two], TOKEN.encode(), num_workers=1, timeout_s=10.0
    ) as remote:
        got_r = remote.score(fns, completions, samples)
    assert got_r == want_r and sum(want_r.scores["math"]) == 4.0  # k = 0, 1, 2, 3 match


def test_token_is_required_and_retries_run_once(two: list[Envd], tmp_path: Path) -> None:
    with pytest.raises(AuthenticationError):
        open_link(two[0].address, b"not-the-token")
    time.sleep(0.5)
    assert "refused a connection from 127.0.0.1" in two[0].err.read_text()
    log = tmp_path / "retry.log"
    ((ep, turn),) = tool_steps(log)[1:2]
    payload = pickle.dumps((step_episode, (ep, turn), 60.0))
    conn = open_link(two[0].address, TOKEN.encode())  # the service still serves
    answers = []
    for _ in range(2):  # the same request id twice, as a client retrying after a lost reply
        conn.send_bytes(pickle.dumps(("env", "retry-client:e1", payload)))
    for _ in range(2):
        answers.append(conn.recv_bytes())
    second = open_link(two[0].address, TOKEN.encode())  # and later, on a new connection
    second.send_bytes(pickle.dumps(("env", "retry-client:e1", payload)))
    answers.append(second.recv_bytes())
    conn.close()
    second.close()
    assert answers[0] == answers[1] == answers[2]
    rid, (status, value, _, _) = pickle.loads(answers[0])
    assert rid == "retry-client:e1" and status == "ok" and "7" in str(value[1].observation_messages)
    assert len(log.read_text().splitlines()) == 1  # the step ran once


@pytest.mark.slow
def test_kill9_of_one_envd_mid_call_reruns_its_steps_on_the_other(tmp_path: Path) -> None:
    servers = [Envd(tmp_path, "c"), Envd(tmp_path, "d")]
    slow = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
    try:
        env = make_env("tool", TOOL_KWARGS)
        eps = []
        for i in range(8):
            ep = env.new_episode()
            ep.reset({"prompt": f"What is {i} * 7?", "answer": str(7 * i)})
            eps.append(ep)
        pool = RemoteEnvPool([s.address for s in servers], TOKEN.encode(), step_timeout_s=60)
        code = "import time; time.sleep(2); print(%d * 7)"
        tickets = {pool.submit(step_episode, ep, slow % (code % i)): i for i, ep in enumerate(eps)}
        assert all(len(s.inflight) == 4 for s in pool.links.servers)  # spread over both
        deadline = time.monotonic() + 120
        while not list(servers[0].sandboxes.glob("tandem-sbx-*")):  # its python calls run
            assert time.monotonic() < deadline, servers[0].err.read_text()
            time.sleep(0.05)
        servers[0].proc.send_signal(signal.SIGKILL)
        outcomes = []
        while len(outcomes) < 8 and time.monotonic() < deadline:
            outcomes += pool.poll(5.0)
        pool.close()
        assert sorted(o.ticket for o in outcomes) == sorted(tickets)  # each step once
        for o in outcomes:
            episode, result = o.value
            i = tickets[o.ticket]
            assert o.status == "ok" and not result.done and episode.turns == 1
            assert str(7 * i) in str(result.observation_messages), result.observation_messages
        assert pool.counts["restarts"] == 1 and pool.counts["crashes"] == 0
        # the killed service's workers finish the calls they held; their sandboxes clean up
        while list(servers[0].sandboxes.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(servers[0].sandboxes.iterdir()) == []
    finally:
        for s in servers:
            s.stop()


def test_worker_addresses_and_token_are_checked_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.rl.config.schema import ConfigError, load_config

    monkeypatch.delenv("TANDEM_ENVD_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"^reward.workers: 'envd-0' is not host:port$"):
        load_config(str(ROOT / "configs/quickstart.toml"), ["--reward.workers=envd-0"])
    with pytest.raises(ConfigError, match=r"^env.workers: set TANDEM_ENVD_TOKEN to the token"):
        load_config(str(ROOT / "configs/quickstart_agentic.toml"), ["--env.workers=h:7000"])
    monkeypatch.setenv("TANDEM_ENVD_TOKEN", TOKEN)
    cfg = load_config(str(ROOT / "configs/quickstart_agentic.toml"), ["--env.workers=h:7000,g:1"])
    assert cfg.env.workers == ["h:7000", "g:1"]


@pytest.mark.slow
def test_agentic_quickstart_on_two_envds_equals_local_workers(
    two: list[Envd], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fixtures import train_run

    monkeypatch.setenv("TANDEM_ENVD_TOKEN", TOKEN)
    config = ROOT / "configs" / "quickstart_agentic.toml"
    quiet = ("--training.steps=1", "--metrics.loggers=[]", "--checkpoint.enable=false")
    local, _ = train_run(config, tmp_path / "local", 1, *quiet, "--env.step_timeout_s=61")
    workers = ",".join(s.address for s in two)
    remote, _ = train_run(
        config, tmp_path / "envd", 1, *quiet, "--env.step_timeout_s=61", f"--env.workers={workers}"
    )
    assert "step timeout 61 s" in two[0].err.read_text() + two[1].err.read_text()  # envd ran them
    keys = ("reward/total", "response/length_mean", "env/turns_mean", "env/tool_calls_per_episode")
    assert [{k: r[k] for k in keys} for r in remote] == [{k: r[k] for k in keys} for r in local]
    assert local[0]["env/tool_calls_per_episode"] > 0 and local[0]["env/env_errors"] == 0
