"""The OpenAI endpoint's cost: turn latency, throughput, and HTTP against the in-process env path.

The shipped quickstart policy is served by a `ServingEngine` (this process: the engine in
its main thread, aiohttp in another, as in a rollout); the harness is a second process of
stock ``openai`` clients, one thread per session.

- ``sessions`` rows: S concurrent sessions (1, 8, 64), each playing 2-turn episodes
  back to back for ``--seconds``; every turn samples exactly ``--turn-tokens`` tokens
  (``ignore_eos``); requests/s and the p50 / p99 latency of a turn.
- ``path`` rows: the same 64 two-turn episodes (a question, the model's answer, a fixed
  follow-up message, its second answer) played in-process by
  `tandem.rl.rollout.agentic.run_agentic_rollout` (an environment stepping inline) and over
  HTTP by 64 client threads. Both sides end a turn at the end-of-turn token or after
  ``--turn-tokens`` (the in-process rollout always stops at the end of a turn), so the sampled
  tokens differ a little: each row prints its count, and the ratio is taken on sampled tokens
  per second (in-process / HTTP) beside the plain seconds.

    python -m bench.serve
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

from tandem.rl.envs.base import ENVIRONMENTS, Environment, Episode, StepResult, row_messages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
FOLLOW_UP = "Once more, please."


class _TwoTurns(Episode):
    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: Any) -> list:
        return row_messages(row)

    def step(self, assistant_text: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": FOLLOW_UP}], done=False)
        return StepResult([], done=True, reward=0.0)


@ENVIRONMENTS.register("bench_two_turns")
class TwoTurns(Environment):
    """The bench's task in-process: one fixed follow-up message, then done."""

    def new_episode(self) -> Episode:
        return _TwoTurns()


def _questions(n: int) -> list[str]:
    return [f"{i % 17}+{(3 * i) % 19}=" for i in range(n)]


def _client_load(
    url: str, sessions: int, seconds: float, episodes: int, turn_tokens: int, out: Any
) -> None:
    """The harness process: ``sessions`` threads; each plays 2-turn episodes until ``seconds``
    pass (or ``episodes`` in all, when > 0: then turns stop at the end of a turn, as in-process).
    Sends back (latencies, wall seconds, sampled tokens)."""
    from openai import OpenAI

    lat: list[float] = []
    lock, count, sampled = threading.Lock(), [0], [0]
    t_end = time.monotonic() + seconds

    def worker(k: int) -> None:
        j = 0
        while True:
            with lock:
                if (episodes and count[0] >= episodes) or (
                    not episodes and time.monotonic() > t_end
                ):
                    return
                count[0] += 1
            client = OpenAI(
                base_url=f"{url}/v1/sessions/s{sessions}-{k}-{j}", api_key="none", max_retries=0
            )
            messages = [{"role": "user", "content": _questions(k + 1)[-1]}]
            for turn in range(2):
                t0 = time.monotonic()
                r = client.chat.completions.create(
                    model="m",
                    messages=messages,
                    max_tokens=turn_tokens,
                    extra_body={} if episodes else {"ignore_eos": True},
                )
                with lock:
                    lat.append(time.monotonic() - t0)
                    sampled[0] += r.usage.completion_tokens
                if turn == 0:
                    messages += [
                        {"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": FOLLOW_UP},
                    ]
            j += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((lat, time.monotonic() - t0, sampled[0]))


def _serve_while(engine: Any, proc: mp.Process) -> None:
    import torch

    with torch.inference_mode():
        engine.run(until=lambda: not proc.is_alive())


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per sessions row")
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=64, help="path rows")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 64], help="sessions rows")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="1 s rows of 1 and 2 sessions, 4 episodes (the test suite's run)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.seconds, args.episodes, args.sessions = 1.0, 4, [1, 2]
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    from bench.header import print_header

    print_header("bench.serve", argv)
    import torch

    from tandem.models.hf import load_model
    from tandem.models.tokenizer import Tokenizer
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.sequence import SamplingParams
    from tandem.rl.generator.serve.engine import EngineSettings, ServingEngine
    from tandem.rl.generator.serve.http import AgentServer, ServerSettings
    from tandem.rl.rollout.agentic import end_of_turn_id, run_agentic_rollout
    from tandem.rl.workers.env_pool import EnvPool

    tok = Tokenizer.from_dir(POLICY)
    model = load_model(POLICY, device=torch.device("cpu"), dtype=torch.float32).eval()

    def generator() -> Generator:
        return Generator(
            model,
            GenerationSettings(num_blocks=2048, max_num_seqs=128, max_model_len=256),
            eos_token_ids=tok.eos_token_ids,
        )

    ctx = mp.get_context("spawn")

    def over_http(sessions: int, seconds: float, episodes: int) -> tuple[list[float], float, int]:
        gen = generator()
        engine = ServingEngine(
            gen, tok, EngineSettings(eot_id=end_of_turn_id(tok), max_model_len=256)
        )
        server = AgentServer(ServerSettings(port=0), tok.vocab_size).start()
        server.engine = engine
        q = ctx.Queue()
        proc = ctx.Process(
            target=_client_load, args=(server.url, sessions, seconds, episodes, args.turn_tokens, q)
        )
        proc.start()
        _serve_while(engine, proc)
        server.stop()
        gen.close()
        return q.get(timeout=60)

    print(
        f"{'row':<22}{'sessions':>9}{'turns':>7}{'req/s':>9}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'seconds':>9}"
    )
    for s in args.sessions:
        lat, wall, _ = over_http(s, args.seconds, 0)
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"{'sessions (HTTP)':<22}{s:>9}{len(lat):>7}{len(lat) / wall:>9.1f}"
            f"{1e3 * statistics.median(lat):>9.0f}"
            f"{1e3 * p99:>9.0f}{wall:>9.1f}",
            flush=True,
        )
    rows = [{"prompt": q} for q in _questions(args.episodes)]
    gen = generator()
    pool = EnvPool(0)
    t0 = time.monotonic()
    with torch.inference_mode():
        samples, _ = run_agentic_rollout(
            gen,
            tok,
            "bench_two_turns",
            {},
            rows,
            1,
            SamplingParams(max_tokens=2 * args.turn_tokens),
            max_turns=2,
            max_total_tokens=256,
            pool=pool,
            max_turn_tokens=args.turn_tokens,
        )
    local = time.monotonic() - t0
    gen.close()
    turns = sum(int(s.info["turns"]) for s in samples)
    sampled = sum(s.num_sampled for s in samples)  # a turn ends early on an end-of-turn token
    print(
        f"{'path: in-process':<22}{args.episodes:>9}{turns:>7}{turns / local:>9.1f}{'':>18}"
        f"{local:>9.1f}   {sampled} sampled tokens, {sampled / local:.1f}/s"
    )
    lat, wall, http_sampled = over_http(args.episodes, 1e9, args.episodes)
    print(
        f"{'path: HTTP':<22}{args.episodes:>9}{len(lat):>7}{len(lat) / wall:>9.1f}{'':>18}"
        f"{wall:>9.1f}   {http_sampled} sampled tokens, {http_sampled / wall:.1f}/s"
    )
    print(
        f"the same {args.episodes} episodes: HTTP / in-process seconds {wall / local:.2f}x; "
        "in-process / HTTP sampled tokens per second "
        f"{sampled / local / (http_sampled / wall):.2f}x"
    )


if __name__ == "__main__":
    main()
