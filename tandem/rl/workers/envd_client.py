"""The trainer's side of ``tandem-envd`` (envd.py): the environment and reward pools' interface
over TCP, to one or more envd services.

`RemoteEnvPool` has `EnvPool`'s API (submit / poll / close) and `RemoteRewardPool` has
`RewardPool.score`, so the rollout takes either (``env.workers`` / ``reward.workers``). Both
sit on `Links`, which owns the connections and the requests in flight:

* every request carries an id (this client, then the episode step's ticket or the reward
  shard), so a server that sees an id again answers it from what it ran, never twice;
* a server whose connection breaks (``kill -9``, a lost pod) has its requests sent again to
  the least loaded live one, which has never seen them: each runs to one answer, and a late
  duplicate answer is dropped here, so every episode step and every item is scored once;
* a dead server is dialled again every ``RETRY_S``; with none reachable for
  ``lost_timeout_s`` the waiting requests end as crashes (one line names the addresses).

Connections prove the shared token first (`multiprocessing.connection`'s HMAC challenge, both
ways) and only then exchange pickles: the token is what makes a pickle trusted.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from tandem.rl.workers.env_pool import EnvOutcome

__all__ = [
    "Links",
    "RemoteEnvPool",
    "RemoteRewardPool",
    "env_pool",
    "envd_token",
    "open_link",
    "reward_pool",
]

TOKEN_VAR = "TANDEM_ENVD_TOKEN"
RETRY_S = 2.0
CONNECT_TIMEOUT_S = 10.0


def envd_token() -> bytes:
    """The shared token from $TANDEM_ENVD_TOKEN (ValueError when unset or empty)."""
    token = os.environ.get(TOKEN_VAR, "")
    if not token:
        raise ValueError(f"{TOKEN_VAR} is not set: tandem-envd and its clients share a token")
    return token.encode()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def open_link(address: str, token: bytes, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """A connection to the envd at ``address`` that has proved ``token`` both ways
    (OSError or AuthenticationError otherwise)."""
    sock = socket.create_connection(split_address(address), timeout=timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, token)
        deliver_challenge(conn, token)
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass
class _Server:
    address: str
    conn: Connection | None = None
    inflight: set[str] = field(default_factory=set)  # request ids sent here, unanswered
    next_try: float = 0.0


class Links:
    """Connections to the envd services and the requests in flight on them (module doc)."""

    def __init__(self, addresses: Sequence[str], token: bytes, lost_timeout_s: float = 120.0):
        if not addresses:
            raise ValueError("Links: no envd address")
        self.token, self.lost_timeout_s = token, lost_timeout_s
        self.client = uuid.uuid4().hex[:12]
        self.servers = [_Server(a) for a in addresses]
        self.requests: dict[str, tuple[str, bytes]] = {}  # id -> (kind, payload), unanswered
        self.queue: deque[str] = deque()  # ids to (re)send
        self.losses = 0  # connections lost with requests in flight
        self._alone_since: float | None = None
        deadline = time.monotonic() + lost_timeout_s
        while not self.live() and time.monotonic() < deadline:  # pods may start after us
            self._dial()
            if not self.live():
                time.sleep(0.2)
        if not self.live():
            raise ConnectionError(f"no tandem-envd reachable at {', '.join(addresses)}")

    def live(self) -> list[_Server]:
        return [s for s in self.servers if s.conn is not None]

    def _dial(self) -> None:
        now = time.monotonic()
        for s in self.servers:
            if s.conn is None and now >= s.next_try:
                try:
                    s.conn = open_link(s.address, self.token)
                except (OSError, EOFError):  # AuthenticationError is a ProcessError: raised
                    s.next_try = now + RETRY_S

    def _lose(self, s: _Server) -> None:
        """``s`` broke: its requests go back to the front of the queue."""
        if s.conn is not None:
            s.conn.close()
        s.conn, s.next_try = None, time.monotonic() + RETRY_S
        if s.inflight:
            self.losses += 1
        self.queue.extendleft(sorted(s.inflight, reverse=True))
        s.inflight.clear()

    def send(self, kind: str, key: str, payload: bytes) -> str:
        """Queue a request; returns its id."""
        rid = f"{self.client}:{key}"
        self.requests[rid] = (kind, payload)
        self.queue.append(rid)
        self.flush()
        return rid

    def flush(self) -> None:
        """Send what is queued, each to the live server with the fewest requests in flight."""
        self._dial()
        while self.queue:
            live = self.live()
            if not live:
                return
            s = min(live, key=lambda v: len(v.inflight))
            rid = self.queue[0]
            kind, payload = self.requests[rid]
            try:
                s.conn.send_bytes(pickle.dumps((kind, rid, payload)))  # type: ignore[union-attr]
            except (OSError, ValueError):
                self._lose(s)
                continue
            self.queue.popleft()
            s.inflight.add(rid)

    def receive(self, timeout: float | None) -> list[tuple[str, tuple[Any, ...]]]:
        """Answers that came within ``timeout`` (None: until one does): (id, body) each, every
        id once; requests of broken connections are sent again. Raises ConnectionError when no
        server has been reachable for ``lost_timeout_s``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.flush()
            live = self.live()
            now = time.monotonic()
            if live:
                self._alone_since = None
            elif self._alone_since is None:
                self._alone_since = now
            elif now - self._alone_since > self.lost_timeout_s:
                raise ConnectionError(
                    "no tandem-envd reachable at "
                    f"{', '.join(s.address for s in self.servers)} for {self.lost_timeout_s:g} s"
                )
            left = RETRY_S if deadline is None else max(0.0, min(RETRY_S, deadline - now))
            out = self._read([s for s in live], left) if live else []
            if not live and left:
                time.sleep(min(left, 0.2))
            if out or (deadline is not None and time.monotonic() >= deadline):
                return out

    def _read(self, live: list[_Server], wait_s: float) -> list[tuple[str, tuple[Any, ...]]]:
        out = []
        by_conn = {s.conn: s for s in live}
        for conn in wait(list(by_conn), wait_s):
            s = by_conn[conn]  # type: ignore[index]
            try:
                while conn.poll():  # type: ignore[union-attr]
                    rid, body = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                    s.inflight.discard(rid)
                    if self.requests.pop(rid, None) is not None:  # else: answered already
                        out.append((rid, body))
            except (EOFError, OSError):
                self._lose(s)
        return out

    @property
    def pending(self) -> int:
        return len(self.requests)

    def close(self) -> None:
        for s in self.servers:
            if s.conn is not None:
                s.conn.close()
                s.conn = None


class RemoteEnvPool:
    """`EnvPool`'s interface (tandem/rl/workers/env_pool.py) on envd services: steps run in the
    services' own `EnvPool` workers, with their timeouts and crash handling."""

    def __init__(
        self, addresses: Sequence[str], token: bytes, *, step_timeout_s: float = 300.0
    ) -> None:
        self.links = Links(addresses, token)
        self.step_timeout_s = step_timeout_s
        self.counts = {"crashes": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        self._tickets: dict[str, int] = {}  # request id -> ticket
        self._sent: dict[int, float] = {}
        self._done: list[EnvOutcome] = []
        self._next_ticket = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        try:
            payload = pickle.dumps((fn, args, self.step_timeout_s))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            self.counts["errors"] += 1
            why = f"task cannot be pickled: {type(e).__name__}: {e}"
            self._done.append(EnvOutcome(ticket, "error", None, why))
            return ticket
        self._tickets[self.links.send("env", f"e{ticket}", payload)] = ticket
        self._sent[ticket] = time.monotonic()
        return ticket

    @property
    def submitted(self) -> int:
        return self._next_ticket

    @property
    def num_pending(self) -> int:
        return len(self._tickets) + len(self._done)

    def wait_ready(self, timeout_s: float = 0.0) -> None:
        """Connected at construction; nothing more to wait for."""

    def poll(self, timeout: float | None = 0.0) -> list[EnvOutcome]:
        """Finished steps, as `EnvPool.poll`."""
        if not self._done and self._tickets:
            try:
                answers = self.links.receive(timeout)
            except ConnectionError as e:
                answers = [(rid, ("crash", None, str(e), 0.0)) for rid in list(self._tickets)]
                self.links.requests.clear()
            for rid, (status, value, error, seconds) in answers:
                ticket = self._tickets.pop(rid)
                if status != "ok":
                    self.counts[
                        {"error": "errors", "timeout": "timeouts"}.get(status, "crashes")
                    ] += 1
                self._done.append(EnvOutcome(ticket, status, value, error, seconds))
        self.counts["restarts"] = self.links.losses
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        self.links.close()

    def __enter__(self) -> RemoteEnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteRewardPool:
    """`RewardPool.score` on envd services: each batch is cut into one contiguous shard per live
    service, scored there by a `RewardPool` of these settings, and joined in order."""

    def __init__(
        self,
        addresses: Sequence[str],
        token: bytes,
        *,
        num_workers: int,
        timeout_s: float,
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        memory_mb: int | None = None,
    ) -> None:
        from tandem.rl.rewards.registry import registered_modules

        self.links = Links(addresses, token)
        self.settings = {
            "num_workers": num_workers,
            "timeout_s": timeout_s,
            "reward_kwargs": {k: dict(v) for k, v in (reward_kwargs or {}).items()},
            "memory_mb": memory_mb,
            "modules": registered_modules(),
        }
        self._batches = 0

    def score(
        self,
        fn_names_and_weights: Sequence[tuple[str, float]],
        completions: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
    ) -> Any:
        """The same `RewardResult` as `RewardPool.score` of the whole batch."""
        from tandem.rl.workers.reward_pool import RewardResult

        n, parts = len(completions), max(1, len(self.links.live()))
        bounds = [(n * k // parts, n * (k + 1) // parts) for k in range(parts)]
        self._batches += 1
        ids = [
            self.links.send(
                "reward",
                f"r{self._batches}.{k}",
                pickle.dumps(
                    (self.settings, list(fn_names_and_weights), completions[a:b], samples[a:b])
                ),
            )
            for k, (a, b) in enumerate(bounds)
        ]
        got: dict[str, RewardResult] = {}
        while len(got) < len(ids):
            for rid, (result, error) in self.links.receive(None):
                if result is None:
                    raise RuntimeError(f"tandem-envd could not score: {error}")
                got[rid] = result
        return join_results([got[rid] for rid in ids], fn_names_and_weights)

    def close(self) -> None:
        self.links.close()

    def __enter__(self) -> RemoteRewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join_results(parts: list[Any], fn_names_and_weights: Sequence[tuple[str, float]]) -> Any:
    """Shards' `RewardResult`s as one, items in shard order, the total summed as `score` does."""
    from tandem.rl.workers.reward_pool import RewardResult

    names = [name for name, _ in fn_names_and_weights]
    out = RewardResult(
        scores={name: [v for p in parts for v in p.scores[name]] for name in names},
        total=[],
        weights={name: float(w) for name, w in fn_names_and_weights},
        errors={name: sum(p.errors[name] for p in parts) for name in names},
        timeouts={name: sum(p.timeouts[name] for p in parts) for name in names},
        crashes={name: sum(p.crashes[name] for p in parts) for name in names},
    )
    for p in parts:
        for name, msg in p.error_examples.items():
            out.error_examples.setdefault(name, msg)
    out.total = [v for p in parts for v in p.total]
    return out


def reward_pool(reward: Any) -> Any:
    """The reward pool of a [reward] section: on its ``workers`` services, else local processes
    (none without reward functions)."""
    if reward.workers and reward.functions:
        return RemoteRewardPool(
            reward.workers,
            envd_token(),
            num_workers=reward.num_workers,
            timeout_s=reward.timeout_s,
            reward_kwargs=reward.kwargs,
            memory_mb=reward.memory_mb or None,
        )
    from tandem.rl.workers.reward_pool import RewardPool

    return RewardPool(
        reward.num_workers if reward.functions else 0,
        reward.timeout_s,
        rewards=reward.functions,
        reward_kwargs=reward.kwargs,
        memory_mb=reward.memory_mb or None,
    )


def env_pool(env: Any) -> Any:
    """The environment pool of an [env] section: on its ``workers`` services, else local."""
    if env.workers:
        return RemoteEnvPool(env.workers, envd_token(), step_timeout_s=env.step_timeout_s)
    from tandem.rl.workers.env_pool import EnvPool

    return EnvPool(env.num_workers, step_timeout_s=env.step_timeout_s)
