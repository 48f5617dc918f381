"""``env.kind = "http"``: the rollout's episodes are played by an external harness over HTTP.

Each rollout turns the step's prompts into tasks (``rl.num_samples`` per prompt, each with
the seed the in-process rollout would give it) and opens a session per task. A harness
claims one (``POST /rl/episodes`` returns its ``session_id``, a ``base_url`` for any OpenAI
client, and the data row), talks to the policy through that base URL, and closes the
episode with ``POST /rl/set_reward`` (the episode's reward; per-turn rewards are summed
into it) or ``POST /rl/abort``. The generator serves meanwhile (`ServingEngine`, on every
rank of the generation group, the leader running the HTTP server), and the rollout ends
when every episode is closed: rewarded ones are trained, each of its segments one sample
with the episode's reward; aborted, disconnected, timed-out (``env.episode_timeout_s``
after the claim) and unclaimed (``env.claim_timeout_s``) ones are counted and dropped,
never trained half. Until a harness claims the first episode the rollout waits (the
watchdog is fed), so the trainer and the harness may start in either order.

One generation group serves every episode (``rollout.tp`` is the world size; the recipe
checks it): its ranks pool their prompts, and each rank gets its own prompts' samples back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from tandem.parallel.generation_layout import GenerationLayout, from_leader
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.errors import StepInterrupted
from tandem.rl.data.prompts import Prompt
from tandem.rl.generator.serve.engine import EngineSettings, ServingEngine
from tandem.rl.generator.serve.http import AgentServer, ServerSettings
from tandem.rl.generator.serve.sessions import Session, Task, samples_of
from tandem.rl.rollout.agentic import end_of_turn_id
from tandem.rl.rollout.sampling import _with_generator, generator_settings, pool_prompts
from tandem.rl.rollout.types import RolloutSample

_DROPS = ("abort", "timeout", "disconnect", "unclaimed", "empty")


class EpisodeBoard:
    """The rollout's tasks, handed out once each, in order (called from the HTTP thread)."""

    def __init__(self, tasks: list[Task]) -> None:
        self.tasks, self._next, self._lock = tasks, 0, threading.Lock()

    def claim(self) -> Task | None:
        with self._lock:
            while self._next < len(self.tasks):
                task = self.tasks[self._next]
                self._next += 1
                if task.claimed_at is None:  # not already started through its base URL
                    task.claimed_at = time.monotonic()
                    return task
            return None


def _outcome(s: Session) -> dict[str, Any]:
    """What the group needs of a closed session (picklable)."""
    samples = samples_of(s) if s.closed == "reward" else []
    closed = "empty" if s.closed == "reward" and not samples else s.closed
    return {
        "closed": closed,
        "samples": samples,
        "reward": s.total_reward(),
        "turns": s.turns,
        "forks": s.forks,
    }


def _metrics(
    outcomes: list[dict[str, Any]], stats: dict[str, int], counts: dict[str, int], elapsed: float
) -> dict[str, float]:
    trained = [o for o in outcomes if o["closed"] == "reward"]
    rewards = [o["reward"] for o in trained if o["reward"] is not None]
    return {
        "env/episodes": float(len(trained)),
        "env/requests": float(stats["requests"]),
        "env/bad_requests": float(stats["bad_requests"]),
        "env/turns_mean": sum(o["turns"] for o in trained) / max(len(trained), 1),
        "env/new_samples": float(sum(o["forks"] for o in trained)),
        "env/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        **{f"env/dropped_{k}": float(v) for k, v in counts.items()},
        "env/elapsed_s": elapsed,
    }


def serve_episodes(
    server: AgentServer | None,
    gen_model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    n: int,
    rcfg: Any,
    ecfg: Any,
    *,
    seeds: list[int] | None,
    greedy: bool,
    layout: GenerationLayout,
    version: int,
    beat: Callable[[], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    kv_scales: Any = None,
) -> tuple[list[RolloutSample], dict[str, float]]:
    """n episodes per prompt, played by the harness; every rank of the group calls (the
    leader with ``server``). Returns this rank's prompts' samples and the ``env/*`` metrics.
    ``kv_scales``: the FP8 pool's scales of this rank's KV heads (``rollout.kv_dtype``)."""
    t0 = time.monotonic()
    pooled, start = pool_prompts(
        list(zip(prompts, seeds if seeds is not None else [None] * len(prompts))), layout
    )
    if not pooled:
        return [], {}
    settings = generator_settings(
        rcfg, ecfg.max_total_tokens - rcfg.max_tokens, 0
    )  # max_model_len: the episode cap
    tag = uuid.uuid4().hex[:8]

    def run(gen: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
        engine = ServingEngine(
            gen,
            tokenizer,
            EngineSettings(
                eot_id=end_of_turn_id(tokenizer),
                max_model_len=gen.scheduler.max_model_len,
                max_tokens=rcfg.max_tokens,
                cap_max_tokens=True,  # rollout.max_tokens caps every turn (docs/serving.md)
                temperature=rcfg.temperature,
                top_p=rcfg.top_p,
                top_k=rcfg.top_k,
                min_p=rcfg.min_p,
                policy_version=version,
                open_sessions=False,
                episode_timeout_s=ecfg.episode_timeout_s,
                claim_timeout_s=ecfg.claim_timeout_s,
            ),
            layout,
        )
        sessions: list[Session] = []
        if server is not None:
            tasks = [
                Task(f"{tag}-{g}-{i}", g, dict(p.row), None if s is None else s + i, greedy)
                for g, (p, s) in enumerate(pooled)
                for i in range(n)
            ]
            sessions = [Session(t.id, task=t) for t in tasks]
            engine.add_tasks(sessions)
            server.board, server.engine = EpisodeBoard(tasks), engine
        try:  # a stop signal ends the wait for the harness (polled every heartbeat_s)
            engine.run(until=lambda: stop() or all(s.closed for s in sessions), beat=beat)
        finally:
            if server is not None:
                server.board = server.engine = None
        cut = not all(s.closed for s in sessions)  # the leader's answer is every rank's
        return from_leader(([_outcome(s) for s in sessions], engine.stats, cut), layout)

    (outcomes, stats, cut), metrics = _with_generator(
        gen_model, tokenizer, settings, len(pooled) * n, run, layout, kv_scales
    )
    if cut:
        raise StepInterrupted("a stop signal while the rollout waited for its harness")
    samples, counts = [], {k: 0 for k in _DROPS}
    for k, out in enumerate(outcomes):
        g = k // n
        if out["closed"] in counts:
            counts[out["closed"]] += 1
        if not start <= g < start + len(prompts):
            continue
        p = pooled[g][0]
        for part in out["samples"]:
            samples.append(
                RolloutSample(
                    group=g - start,
                    text=tokenizer.decode(part["completion_ids"]),
                    row=p.row,
                    env_reward=out["reward"],
                    info={"turns": float(out["turns"]), "new_samples": float(out["forks"])},
                    **part,
                )
            )
    metrics.update(_metrics(outcomes, stats, counts, time.monotonic() - t0))
    return samples, metrics


def start_server(env: Any, name: str, vocab_size: int) -> AgentServer:
    """Rank 0: the endpoint of ``[env]``, bound now (a taken port: ConfigError), for the run."""
    server = AgentServer(
        ServerSettings(
            host=env.host,
            port=env.port,
            api_key=env.bearer_key(),
            max_request_mb=env.max_request_mb,
            model_name=name,
        ),
        vocab_size,
    )
    try:
        server.start()
    except OSError as e:
        raise ConfigError(
            f"env.port: cannot listen on {env.host}:{env.port}: {e.strerror or e}"
        ) from None
    print(
        f"agent endpoint: {server.url}/v1 (a harness claims episodes at {server.url}/rl/episodes; "
        "e.g. python examples/agent_harness.py)",
        flush=True,
    )
    return server
