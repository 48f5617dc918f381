"""The endpoint in one process, driven by the stock ``openai`` client on loopback.

A `ServingEngine` over the shipped quickstart policy runs in a thread (as the trainer's
main thread runs it), the aiohttp server in another. The references are independent: a
fresh `Generator` run with the same prompt ids and seed (the ids and raw log-probs the
generator samples), the tokenizer's decode (the message text), and the session's own
sequence (what a rollout trains on).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402

from tandem.models.hf import load_model  # noqa: E402
from tandem.models.tokenizer import Tokenizer  # noqa: E402
from tandem.rl.core.reward_range import REWARD_LIMIT  # noqa: E402
from tandem.rl.generator.engine import GenerationSettings, Generator  # noqa: E402
from tandem.rl.generator.sequence import SamplingParams  # noqa: E402
from tandem.rl.generator.serve.engine import EngineSettings, ServingEngine  # noqa: E402
from tandem.rl.generator.serve.http import AgentServer, ServerSettings  # noqa: E402
from tandem.rl.generator.serve.sessions import samples_of  # noqa: E402
from tandem.rl.rollout.agentic import end_of_turn_id  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
QUESTION = [{"role": "user", "content": "What is 23 + 45?"}]
MAX_LEN = 384


def _generator(model, tok) -> Generator:
    return Generator(
        model,
        GenerationSettings(
            num_blocks=600, block_size=16, max_num_seqs=128, max_model_len=MAX_LEN, seed=3
        ),
        eos_token_ids=tok.eos_token_ids,
    )


@pytest.fixture(scope="module")
def served():
    tok = Tokenizer.from_dir(POLICY)
    model = load_model(POLICY, device=torch.device("cpu"), dtype=torch.float32).eval()
    engine = ServingEngine(
        _generator(model, tok),
        tok,
        EngineSettings(eot_id=end_of_turn_id(tok), max_model_len=MAX_LEN, max_tokens=32),
    )
    server = AgentServer(
        ServerSettings(port=0, max_request_mb=0.05, model_name="quickstart"), tok.vocab_size
    ).start()
    server.engine = engine
    stop = threading.Event()

    def loop() -> None:
        with torch.inference_mode():
            engine.run(until=stop.is_set)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield server.url, engine, tok, model
    stop.set()
    thread.join(timeout=30)
    server.stop()
    assert engine.gen.pool_is_free()


def _client(url: str, session: str | None = None) -> OpenAI:
    return OpenAI(
        base_url=f"{url}/v1" + (f"/sessions/{session}" if session else ""),
        api_key="none",
        max_retries=0,
    )


def _post(url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path,
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _settled(engine: ServingEngine, timeout: float = 20.0) -> bool:
    """Every sequence freed (read from this thread while the engine idles)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not engine.seqs and engine.gen.pool_is_free():
            return True
        time.sleep(0.05)
    return False


def test_returned_ids_are_the_generators_and_decode_to_the_text(served):
    url, engine, tok, model = served
    r = _client(url).chat.completions.create(
        model="quickstart",
        messages=QUESTION,
        temperature=1.0,
        seed=11,
        max_tokens=24,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    ids, lps = choice.token_ids, [t.logprob for t in choice.logprobs.content]
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    assert r.prompt_token_ids == prompt and len(ids) == len(lps) == r.usage.completion_tokens > 0
    # an independent generator, same prompt ids and seed: the same tokens and raw log-probs
    eot = end_of_turn_id(tok)
    ref = _generator(model, tok)
    with torch.inference_mode():
        out = ref.generate(
            [prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
        )[0][0]
    ref.close()
    assert out.token_ids[: len(ids)] == ids and out.raw_logprobs[: len(ids)] == lps
    assert (choice.finish_reason == "stop") == (ids[-1] == eot) and eot not in ids[:-1]
    assert tok.decode(ids, skip_special_tokens=True) == choice.message.content
    assert choice.message.content and r.usage.prompt_tokens == len(prompt)
    assert _settled(engine)


def test_streaming_gives_the_same_turn(served):
    url, _, _, _ = served
    kw = dict(
        model="quickstart",
        messages=QUESTION,
        temperature=1.0,
        seed=5,
        max_tokens=24,
        extra_body={"return_token_ids": True},
    )
    whole = _client(url).chat.completions.create(**kw).choices[0]
    text, ids, reasons = "", [], []
    for ch in _client(url).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            ids += ch.choices[0].token_ids
            reasons.append(ch.choices[0].finish_reason)
        else:
            assert ch.usage.completion_tokens == len(whole.token_ids)
    assert (text, ids) == (whole.message.content, whole.token_ids) and len(reasons) > 1
    assert reasons[-1] == whole.finish_reason and set(reasons[:-1]) == {None}


def test_a_multi_turn_session_is_the_trained_sequence_with_its_mask(served):
    url, engine, tok, _ = served
    client = _client(url, "episode-a")
    messages, turns = list(QUESTION), []
    for follow_up in ("Are you sure?", "Say it once more.", None):  # three turns
        r = client.chat.completions.create(
            model="quickstart",
            messages=messages,
            seed=2,
            max_tokens=24,
            extra_body={"return_token_ids": True},
        )
        turns.append((r.prompt_token_ids, r.choices[0].token_ids))
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": follow_up},
            ]
    session = engine.sessions["episode-a"]
    (sample,) = samples_of(session)
    prompt = turns[0][0]
    assert sample["prompt_ids"] == prompt
    # each turn's context: the previous context + the sampled ids + the new messages, rendered
    expected_ids, expected_mask = [], []
    for k, (context, sampled) in enumerate(turns):
        assert (
            context[: len(prompt) + len(expected_ids)] == prompt + expected_ids
        )  # nothing re-tokenized
        appended = context[len(prompt) + len(expected_ids) :]
        assert (k == 0) == (not appended)
        expected_ids += appended + sampled
        expected_mask += [False] * len(appended) + [True] * len(sampled)
    assert sample["completion_ids"] == expected_ids and sample["loss_mask"] == expected_mask
    lps = iter(session.seq.raw_logprobs)
    assert sample["gen_logprobs"] == [next(lps) if m else 0.0 for m in expected_mask]
    assert session.forks == 0 and session.turns == 3
    # a history that is not append-only (first question edited): a new sample, the old one kept
    edited = [{"role": "user", "content": "What is 23 + 46?"}, *messages[1:]]
    client.chat.completions.create(model="quickstart", messages=edited, max_tokens=8)
    first, second = samples_of(session)
    assert first == sample and session.forks == 1
    assert second["prompt_ids"] == tok.encode(
        tok.apply_chat_template(edited, add_generation_prompt=True)
    )
    status, body = _post(url, "/rl/set_reward", {"session_id": "episode-a", "reward": 1.0})
    assert status == 200 and body["closed"] == "reward" and session.total_reward() == 1.0
    status, body = _post(url, "/v1/sessions/episode-a/chat/completions", {"messages": messages})
    assert status == 409 and "closed" in body["error"]["message"]
    assert _settled(engine)


def test_64_concurrent_sessions_complete(served):
    url, engine, _, _ = served

    def episode(i: int) -> int:
        client = _client(url, f"many-{i}")
        messages = [{"role": "user", "content": f"What is {i} + {i + 3}?"}]
        r = client.chat.completions.create(model="quickstart", messages=messages, max_tokens=16)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Again?"},
        ]
        r2 = client.chat.completions.create(model="quickstart", messages=messages, max_tokens=16)
        assert _post(url, "/rl/abort", {"session_id": f"many-{i}"})[0] == 200
        return r.usage.completion_tokens + r2.usage.completion_tokens

    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        tokens = list(pool.map(episode, range(64)))
    assert len(tokens) == 64 and min(tokens) >= 2, tokens
    assert all(engine.sessions[f"many-{i}"].turns == 2 for i in range(64))
    assert time.monotonic() - t0 < 300
    assert _settled(engine)


def test_malformed_requests_a_disconnect_and_an_abort_leave_it_healthy(served):
    url, engine, _, _ = served
    bad = [
        (b"{not json", 400),
        (b'{"messages": []}', 400),
        (b'{"messages": "hi"}', 400),
        (json.dumps({"messages": QUESTION, "n": 2}).encode(), 400),
        (json.dumps({"messages": QUESTION, "temperature": -1}).encode(), 400),
        (json.dumps({"messages": QUESTION, "max_tokens": MAX_LEN}).encode(), 400),
        (json.dumps({"messages": QUESTION, "prompt_token_ids": [10**6]}).encode(), 400),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 60_000}]}).encode(), 413),
    ]
    for body, status in bad:
        got, err = _post(url, "/v1/chat/completions", body)
        assert got == status and err["error"]["message"], (body[:60], got, err)
    assert _post(url, "/v1/nowhere", {})[0] == 404
    # a client that goes away mid-stream: its sequence is freed
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.request(
        "POST",
        "/v1/sessions/gone/chat/completions",
        json.dumps({"messages": QUESTION, "stream": True, "max_tokens": 300, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    before = engine.stats["disconnects"]
    conn.sock.close()
    conn.close()
    assert _settled(engine) and engine.stats["disconnects"] == before + 1
    assert engine.sessions["gone"].closed == "disconnect"
    # an abort closes a session for good
    _client(url, "to-abort").chat.completions.create(
        model="quickstart", messages=QUESTION, max_tokens=8
    )
    assert _post(url, "/rl/abort", {"session_id": "to-abort"}) == (
        200,
        {"session_id": "to-abort", "closed": "abort"},
    )
    assert _post(url, "/rl/abort", {"session_id": "to-abort"})[0] == 409
    assert _post(url, "/rl/set_reward", {"session_id": "nobody", "reward": 1})[0] == 404
    assert _post(url, "/rl/set_reward", {"session_id": "x", "reward": "high"})[0] == 400
    # and the next request is served as before
    r = _client(url).completions.create(
        model="quickstart",
        prompt="What is",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert len(r.choices[0].token_ids) == 4 and r.choices[0].finish_reason == "length"
    assert _settled(engine)


def test_bearer_key_and_loopback_default():
    assert ServerSettings().host == "127.0.0.1" and ServerSettings().check() is None
    assert "bearer key" in ServerSettings(host="0.0.0.0").check()
    assert ServerSettings(host="0.0.0.0", api_key="k").check() is None
    server = AgentServer(ServerSettings(port=0, api_key="sesame"), 512).start()
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        for key, status in ((None, 401), ("wrong", 401), ("sesame", 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            req = urllib.request.Request(server.url + "/v1/models", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    assert (r.status, json.loads(r.read())["data"][0]["owned_by"]) == (
                        200,
                        "tandem",
                    )
            except urllib.error.HTTPError as e:
                assert (
                    e.code == status
                    and json.loads(e.read())["error"]["type"] == "authentication_error"
                )
        # no generator between rollouts: 503, not a hang
        got = _post(
            server.url,
            "/v1/chat/completions",
            {"messages": QUESTION},
            {"Authorization": "Bearer sesame"},
        )
        assert got[0] == 503
    finally:
        server.stop()


def test_hostile_rewards_and_bodies_get_4xx_and_leave_it_healthy(served):
    """1e39 (finite in float64, inf in float32), a 400-digit integer, per-turn rewards whose
    sum leaves the range, JSON nested 20,000 deep (under the fixture's 50 KB cap), a
    400-digit max_tokens: each a 400 with a message, none a 500; the session stays open and
    takes a reward in range afterwards."""
    url, engine, _, _ = served
    _client(url, "hostile").chat.completions.create(
        model="quickstart", messages=QUESTION, max_tokens=4
    )
    for reward in (1e39, -1e39, 10**400, REWARD_LIMIT * 2):
        got, err = _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": reward})
        assert got == 400 and err["error"]["message"].startswith("reward: must lie in"), err
    half = REWARD_LIMIT * 0.75
    assert (
        _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": half, "turn": 0})[0] == 200
    )
    got, err = _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": half, "turn": 1})
    assert got == 400 and "rewards would sum to 1.5e+06" in err["error"]["message"], err
    got, err = _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": half})
    assert got == 400 and "would sum" in err["error"]["message"], err
    for body in (b"[" * 20_000 + b"]" * 20_000, b'{"messages": ' + b"[" * 40_000):
        got, err = _post(url, "/v1/chat/completions", body)
        assert got == 400, (got, err)
    got, err = _post(url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 10**400})
    assert got == 400 and err["error"]["param"] == "max_tokens", err
    assert (
        _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": 1.0, "turn": 1})[0] == 200
    )
    status, body = _post(url, "/rl/set_reward", {"session_id": "hostile", "reward": 2.0})
    assert status == 200 and engine.sessions["hostile"].total_reward() == half + 3.0
    assert _settled(engine)


def test_a_non_utf8_authorization_header_is_a_401():
    server = AgentServer(ServerSettings(port=0, api_key="sesame"), 512).start()
    try:
        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=10)
        conn.putrequest("GET", "/v1/models")
        conn.putheader("Authorization", b"Bearer \xff\xfe\xc3")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 401, resp.read()
        assert json.loads(resp.read())["error"]["type"] == "authentication_error"
    finally:
        server.stop()


def test_training_caps_a_requests_max_tokens_at_the_rollouts(served):
    """An http environment's turn samples at most rollout.max_tokens (the engine's 32 here),
    whatever the request asks; tandem-serve (no cap) samples what it asks."""
    url, engine, _, _ = served

    def sampled(session: str) -> int:
        r = _client(url, session).chat.completions.create(
            model="quickstart", messages=QUESTION, max_tokens=60, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    assert sampled("uncapped") == 60
    engine.s.cap_max_tokens = True
    try:
        assert sampled("capped") == engine.s.max_tokens == 32
    finally:
        engine.s.cap_max_tokens = False
    for session in ("uncapped", "capped"):
        assert _post(url, "/rl/abort", {"session_id": session})[0] == 200
    assert _settled(engine)


def test_idle_connections_are_capped_and_closed_and_errors_do_not_flood(capsys):
    """Past max_connections a connection gets one 503 and is closed; a connection with no
    request is closed after idle_timeout_s; then the server answers as before."""
    import socket

    server = AgentServer(ServerSettings(port=0, max_connections=4, idle_timeout_s=1.0), 512).start()
    host, port = "127.0.0.1", server.port
    try:
        idle = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
        time.sleep(0.2)  # accepted and counted
        extra = socket.create_connection((host, port), timeout=10)
        reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many open connections" in reply
        assert extra.recv(4096) == b""  # closed by the server
        assert server.cap.refused == 1
        t0 = time.monotonic()
        assert all(s.recv(1) == b"" for s in idle)  # each closed by the idle timeout
        assert 0.5 < time.monotonic() - t0 < 8
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
    finally:
        server.stop()
    # the loop's errors and the server's own 500s: one line per 10 s, the rest counted
    for _ in range(100):
        server.quiet.loop_errors(
            None,
            {
                "message": "socket.accept() out of system resource",
                "exception": OSError(24, "Too many open files"),
            },
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err
        == [
            "[tandem-http] socket.accept() out of system resource: OSError: [Errno 24] Too many "
            "open files"
        ]
        and server.quiet.dropped == 99
    )


def test_idle_sessions_expire_and_are_forgotten(served):
    url, engine, _, _ = served
    _client(url, "lingering").chat.completions.create(
        model="quickstart", messages=QUESTION, max_tokens=4
    )
    assert engine.sessions["lingering"].seq is not None and not _settled(engine, timeout=0.5)
    engine.s.session_idle_s = 1.0
    try:
        end = time.monotonic() + 20
        while "lingering" in engine.sessions and time.monotonic() < end:
            time.sleep(0.1)
        assert "lingering" not in engine.sessions and engine.stats["expired"] >= 1
    finally:
        engine.s.session_idle_s = 0.0
    assert _settled(engine)  # its KV freed
