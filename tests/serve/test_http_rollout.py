"""``env.kind = "http"`` in the RL recipe: a harness on the stock ``openai`` client trains it.

One ``train.py`` process (``rl.exact``: the batch-invariant kernels, so the update's
recomputation must equal the rollout's log-probs bit for bit), the quickstart policy and
task, one step. The harness in this test plays two-turn episodes, records what the endpoint
returned, aborts one episode, walks away from another mid-stream and sends malformed
requests. The references: the trained samples (``advanced.dump_rollouts``) must be exactly the
harness's turns (the returned ids, the ids of its appended messages between them, the
returned log-probs at the sampled positions and 0 elsewhere), and the update's gap metric 0.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABORT, DISCONNECT = 10, 11  # claim numbers (the first 8 claims are the start's evaluation)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Harness:
    """Claims and plays episodes until the endpoint says done; keeps what each turn returned."""

    def __init__(self, url: str) -> None:
        self.url, self.records, self.claims, self.errors = url, {}, 0, []

    def play(self, ep: dict, claim: int) -> None:
        sid, base = ep["session_id"], ep["base_url"]
        if claim == DISCONNECT:  # go away mid-stream
            conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=60)
            conn.request(
                "POST",
                f"/v1/sessions/{sid}/chat/completions",
                json.dumps(
                    {
                        "messages": [{"role": "user", "content": ep["row"]["prompt"]}],
                        "stream": True,
                        "ignore_eos": True,
                        "max_tokens": 60,
                    }
                ),
                {"Content-Type": "application/json"},
            )
            assert conn.getresponse().status == 200
            conn.sock.close()
            conn.close()
            return
        client = OpenAI(base_url=base, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": ep["row"]["prompt"]}]
        turns = []
        for follow_up in ("Once more?", None):
            r = client.chat.completions.create(
                model="policy",
                messages=messages,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            c = r.choices[0]
            turns.append(
                (
                    r.prompt_token_ids,
                    c.token_ids,
                    [t.logprob for t in c.logprobs.content],
                    c.message.content,
                )
            )
            if follow_up:
                messages += [
                    {"role": "assistant", "content": c.message.content},
                    {"role": "user", "content": follow_up},
                ]
        status, _ = post(
            base, "/chat/completions", b"{broken"
        )  # a malformed request in the middle of it
        assert status == 400
        if claim == ABORT:
            assert post(self.url, "/rl/abort", {"session_id": sid})[0] == 200
            return
        reward = float("!" not in turns[0][3])
        assert post(self.url, "/rl/set_reward", {"session_id": sid, "reward": reward})[0] == 200
        self.records[sid] = turns

    def run(self) -> None:
        with ThreadPoolExecutor(32) as pool:
            futures = []
            while True:
                try:
                    status, got = post(self.url, "/rl/episodes", {})
                except (urllib.error.URLError, OSError):
                    time.sleep(0.2)
                    continue
                if got["done"]:
                    break
                if got["episode"] is None:
                    time.sleep(0.02)
                    continue
                self.claims += 1
                futures.append(pool.submit(self.play, got["episode"], self.claims))
            for f in futures:
                if f.exception() is not None:
                    self.errors.append(repr(f.exception()))


def expected_sample(turns: list) -> tuple[list[int], list[float]]:
    prompt = turns[0][0]
    ids, lps = [], []
    for context, sampled, logprobs, _ in turns:
        appended = context[len(prompt) + len(ids) :]
        assert context[: len(prompt) + len(ids)] == prompt + ids
        ids += appended + sampled
        lps += [0.0] * len(appended) + logprobs
    return ids, lps


def _http_train(dump, port: int) -> list[str]:
    """train.py on the quickstart, one step, its episodes played over http on ``port``."""
    return [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--job.dump_folder={dump}",
        "--training.steps=1",
        "--env.kind=http",
        f"--env.port={port}",
    ]


@pytest.fixture(scope="module")
def http_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("http_rl")
    port = free_port()
    cmd = [
        *_http_train(dump, port),
        "--env.max_total_tokens=128",
        "--env.episode_timeout_s=120",
        "--reward.functions=",
        "--rl.prompts_per_step=4",
        "--rl.eval_prompts=2",
        "--rl.exact=true",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        "--advanced.dump_rollouts=true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    harness = Harness(f"http://127.0.0.1:{port}")
    thread = threading.Thread(target=harness.run, daemon=True)
    thread.start()  # before the trainer: either order works
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    thread.join(timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not harness.errors, harness.errors
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    dumped = [json.loads(line) for line in open(dump / "rollouts" / "rank-0.jsonl")]
    return harness, rows, dumped, r.stdout


def test_trained_samples_are_the_harness_turns_exactly(http_run):
    harness, rows, dumped, _ = http_run
    assert (
        not harness.errors and harness.claims == 8 + 32 + 8
    )  # evaluation, the step's 4 x 8, evaluation
    expected = {}
    for turns in harness.records.values():
        ids, lps = expected_sample(turns)
        expected[tuple(ids)] = lps
    assert len(dumped) == rows[0]["env/episodes"] == 30  # 32 less the aborted and the abandoned one
    for d in dumped:
        assert tuple(d["completion_ids"]) in expected, d
        assert (
            d["gen_logprobs"] == expected[tuple(d["completion_ids"])]
        )  # bit for bit, after JSON both ways


def test_logprobs_equal_the_updates_recomputation_and_the_run_stays_healthy(http_run):
    _, rows, _, said = http_run
    (row,) = rows
    assert row["gap/abs_max"] == 0.0 and row["gap/tokens_differ"] == 0.0  # rl.exact: bitwise
    assert row["env/dropped_abort"] == 1 and row["env/dropped_disconnect"] == 1
    assert row["env/turns_mean"] == 2.0 and row["env/new_samples"] == 0
    assert row["env/requests"] == 30 * 2 + 2 + 1  # the aborted one's two turns, the abandoned one's
    assert "agent endpoint: http://127.0.0.1:" in said and "eval accuracy: start" in said


def test_sigterm_while_waiting_for_the_harness_exits_75_at_once(tmp_path):
    """No harness ever comes: the run waits in its first evaluation; SIGTERM ends the wait
    (the engine polls the flag every heartbeat) and the run exits 75 with one line."""
    import signal

    port = free_port()
    cmd = [*_http_train(tmp_path / "run", port), "--reward.functions=", "--metrics.loggers=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end:  # the endpoint is up: the episodes wait for a harness
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if json.loads(r.read())["serving"]:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the endpoint never served")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    assert took < 20, took  # a few heartbeats and the shutdown, well within a grace period
    assert "preempted during step 1 (a stop signal while the rollout waited for its harness)" in out
    assert "Traceback" not in err
