"""An agent harness that trains through Tandem: the quickstart's tool task over the OpenAI API.

    python examples/agent_harness.py   # beside: torchrun ... configs/quickstart_agent_server.toml

An ordinary program built on the stock ``openai`` client. It waits for the endpoint to come
up, then loops: claim an episode (``POST /rl/episodes``: a session's ``base_url`` and the task's
data row), play it (chat turns through ``OpenAI(base_url=...)``; the task's python tool runs
here, in Tandem's sandbox), and report the episode's reward (``POST /rl/set_reward``). It
plays many episodes at once (``--concurrency``) so the trainer's generator decodes them in
one batch, and exits when the endpoint says the training is done. The defaults match
configs/quickstart_agent_server.toml, so neither command needs a flag, and the two may
start in either order. The task (python tool, math reward, 3 turns) is the one
configs/quickstart_agentic.toml plays in-process (tandem/rl/envs/tool_env.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openai import OpenAI

from tandem.rl.envs import make_env

TASK = {
    "tools": ["python"],
    "reward": "math",
    "schemas_in_prompt": False,
}  # the quickstart's [env] kwargs


def post(
    url: str, path: str, body: dict[str, Any], key: str | None, timeout: float = 30
) -> dict[str, Any]:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        },
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(url: str, patience_s: float) -> bool:
    """Block until GET /health answers; False when it has not for ``patience_s`` (0: forever)."""
    start, said = time.monotonic(), False
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if not said:
            print(
                f"waiting for the endpoint at {url} (start the training, or it is between steps)",
                flush=True,
            )
            said = True
        if patience_s and time.monotonic() - start > patience_s:
            return False
        time.sleep(0.5)


def play(ep: dict[str, Any], args: argparse.Namespace, tools: threading.Semaphore) -> float:
    """One episode: chat turns until the environment says done; returns the reward it reported."""
    episode = make_env("tool", TASK).new_episode()
    messages = episode.reset(ep["row"])
    # one client per episode, closed with it: its keep-alive connection is not left open for
    # the endpoint's idle timeout (the endpoint holds at most 128 connections at once)
    client = OpenAI(
        base_url=ep["base_url"], api_key=args.api_key or "none", max_retries=0, timeout=600
    )
    reward = 0.0
    try:
        for _ in range(args.max_turns):
            reply = client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            with tools:  # the python tool runs in a sandboxed process: a few at a time
                result = episode.step(text)
            if result.done:
                reward = result.reward or 0.0
                break
            messages += result.observation_messages
    except Exception as e:  # noqa: BLE001  (e.g. the context is full: 400; the episode scores 0)
        if getattr(e, "status_code", None) not in (400,):
            post(args.url, "/rl/abort", {"session_id": ep["session_id"]}, args.api_key)
            return 0.0
    finally:
        client.close()
    post(
        args.url, "/rl/set_reward", {"session_id": ep["session_id"], "reward": reward}, args.api_key
    )
    return reward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the endpoint (env.host / env.port; default %(default)s)",
    )
    ap.add_argument(
        "--api-key", default=os.environ.get("TANDEM_API_KEY"), help="bearer key (env.api_key)"
    )
    ap.add_argument("--concurrency", type=int, default=64, help="episodes played at once")
    ap.add_argument("--tool-workers", type=int, default=2, help="python tool runs at once")
    ap.add_argument("--max-turns", type=int, default=3, help="assistant turns per episode")
    ap.add_argument(
        "--patience-s",
        type=float,
        default=0.0,
        help="give up when the endpoint is unreachable this long (0: wait forever)",
    )
    args = ap.parse_args(argv)
    args.url = args.url.rstrip("/")
    tools = threading.Semaphore(args.tool_workers)
    played = 0
    with ThreadPoolExecutor(args.concurrency) as pool:
        busy: set[Any] = set()
        while True:
            for f in [f for f in busy if f.done()]:
                f.result()  # an episode's own error stops the harness, with its traceback
                busy.discard(f)
            if len(busy) >= args.concurrency:
                time.sleep(0.01)
                continue
            try:
                got = post(args.url, "/rl/episodes", {}, args.api_key)
            except (urllib.error.URLError, OSError):
                if not wait_for(args.url, args.patience_s):
                    print(f"the endpoint at {args.url} is gone; stopping", flush=True)
                    return 1
                continue
            if got.get("done"):
                break
            if got.get("episode") is None:
                time.sleep(0.05)
                continue
            future = pool.submit(play, got["episode"], args, tools)
            busy.add(future)
            played += 1
        for f in busy:
            f.result()
    print(f"the training is done; played {played} episodes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
