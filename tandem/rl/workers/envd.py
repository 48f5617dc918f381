"""``tandem-envd``: the environment pool and the reward pool as a TCP service, so environments,
tool calls and verifiers run on CPU machines beside the accelerators.

    TANDEM_ENVD_TOKEN=... tandem-envd --host 0.0.0.0 --port 7000 --workers 16

Trainers reach it through ``env.workers`` / ``reward.workers`` (envd_client.py). It runs the
same code as local workers: environment steps in an `EnvPool` (its sandbox, timeouts and crash
handling), reward calls in a `RewardPool` (its memory cap and timeouts), one pool per setting
the trainers send. A connection must prove the shared token before anything is read (an HMAC
challenge both ways; a connection that does not is closed and logged); requests then carry an
id, and an id seen again is answered from the result kept for it (``KEEP`` of them) or joins
the run in progress: a retried request runs once. The first line on stdout is
``tandem-envd listening on HOST:PORT`` (``--port 0`` picks a free port). SIGTERM or SIGINT
stops it: the pools' workers are stopped, the requests in flight are lost to their clients,
which send them to another envd. Exit 2: no token, or the address cannot be bound.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import queue
import signal
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
)
from typing import Any

from tandem.rl.workers.env_pool import EnvPool
from tandem.rl.workers.envd_client import envd_token

__all__ = ["EnvdServer", "main"]

KEEP = 100_000  # answers kept for retried requests


def _say(line: str) -> None:
    print(f"tandem-envd: {line}", file=sys.stderr, flush=True)


class EnvdServer:
    """The service; `serve_forever` runs it in the calling thread (see the module docstring)."""

    def __init__(self, host: str, port: int, token: bytes, workers: int = 4) -> None:
        self.token, self.workers = token, workers
        self.sock = socket.create_server((host, port))
        host_bound, port_bound = self.sock.getsockname()[:2]
        self.address = f"{host_bound}:{port_bound}"
        self._lock = threading.Lock()  # answers, waiters, sends
        self._answers: OrderedDict[str, bytes] = OrderedDict()
        self._waiters: dict[str, list[Connection]] = {}
        self._env_inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._reward_inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._env_pools: dict[float, EnvPool] = {}
        self._reward_pools: dict[str, Any] = {}
        self.runs = {"env": 0, "reward": 0}  # requests run (not answered from memory)
        self._stop = threading.Event()

    # ---- connections --------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        sock.setblocking(True)  # a stalled handshake holds only its own thread
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.token)
            answer_challenge(conn, self.token)
        except (AuthenticationError, EOFError, OSError) as e:
            _say(f"refused a connection from {peer[0]}:{peer[1]}: no valid token ({e or 'closed'})")
            conn.close()
            return
        try:
            while not self._stop.is_set():
                kind, rid, payload = pickle.loads(conn.recv_bytes())
                self._take(conn, kind, rid, payload)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _take(self, conn: Connection, kind: str, rid: str, payload: bytes) -> None:
        with self._lock:
            if rid in self._answers:  # a retry: the answer it already has
                self._send(conn, self._answers[rid])
                return
            if rid in self._waiters:  # a retry of one still running: answered when it ends
                self._waiters[rid].append(conn)
                return
            self._waiters[rid] = [conn]
        (self._env_inbox if kind == "env" else self._reward_inbox).put((rid, payload))

    def _send(self, conn: Connection, data: bytes) -> None:
        try:
            conn.send_bytes(data)
        except (OSError, ValueError):  # that client is gone; another asks again
            pass

    def _finish(self, rid: str, body: tuple[Any, ...]) -> None:
        data = pickle.dumps((rid, body))
        with self._lock:
            self._answers[rid] = data
            while len(self._answers) > KEEP:
                self._answers.popitem(last=False)
            for conn in self._waiters.pop(rid, []):
                self._send(conn, data)

    # ---- environment steps ---------------------------------------------------------------
    def _env_loop(self) -> None:
        """Owns the EnvPools: submits new steps, hands back finished ones."""
        tickets: dict[tuple[float, int], str] = {}
        while not self._stop.is_set():
            try:
                rid, payload = self._env_inbox.get(timeout=0.02 if tickets else 0.2)
                self._submit_step(rid, payload, tickets)
                continue  # take everything queued before polling
            except queue.Empty:
                pass
            for limit, pool in self._env_pools.items():
                for o in pool.poll(0.0):
                    rid = tickets.pop((limit, o.ticket))
                    self._finish(rid, (o.status, o.value, o.error, o.seconds))

    def _submit_step(self, rid: str, payload: bytes, tickets: dict[tuple[float, int], str]) -> None:
        try:
            fn, args, limit = pickle.loads(payload)
        except Exception as e:  # e.g. the environment's module is not in this image
            self._finish(
                rid, ("error", None, f"cannot load the step: {type(e).__name__}: {e}", 0.0)
            )
            return
        pool = self._env_pools.get(limit)
        if pool is None:
            pool = self._env_pools[limit] = EnvPool(self.workers, step_timeout_s=limit)
            _say(f"environment pool of {self.workers} workers, step timeout {limit:g} s")
        self.runs["env"] += 1
        tickets[(limit, pool.submit(fn, *args))] = rid

    # ---- rewards -------------------------------------------------------------------------
    def _reward_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rid, payload = self._reward_inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                settings, names_and_weights, completions, samples = pickle.loads(payload)
                pool = self._reward_pool(settings, [n for n, _ in names_and_weights])
                self.runs["reward"] += 1
                body: tuple[Any, str] = (pool.score(names_and_weights, completions, samples), "")
            except Exception as e:
                body = (None, f"{type(e).__name__}: {e}")
            self._finish(rid, body)

    def _reward_pool(self, settings: dict[str, Any], names: list[str]) -> Any:
        from tandem.rl.workers.reward_pool import RewardPool

        key = repr(sorted(settings.items()))
        if key not in self._reward_pools:
            for mod in settings["modules"]:
                importlib.import_module(mod)
            self._reward_pools[key] = RewardPool(
                settings["num_workers"],
                settings["timeout_s"],
                rewards=names,
                reward_kwargs=settings["reward_kwargs"],
                memory_mb=settings["memory_mb"],
            )
        return self._reward_pools[key]

    # ---- life ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        threading.Thread(target=self._accept_loop, daemon=True).start()
        threading.Thread(target=self._reward_loop, daemon=True).start()
        try:
            self._env_loop()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for pool in [*self._env_pools.values(), *self._reward_pools.values()]:
            pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-envd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every one)")
    ap.add_argument("--port", type=int, default=7000, help="0: a free port")
    ap.add_argument("--workers", type=int, default=4, help="processes of each environment pool")
    args = ap.parse_args(argv)
    try:
        token = envd_token()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers: must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        server = EnvdServer(args.host, args.port, token, args.workers)
    except OSError as e:
        print(
            f"error: --host/--port: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr
        )
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    print(f"tandem-envd listening on {server.address}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
