"""The HTTP side: an aiohttp server in a thread of the generation group's leader.

Routes (docs/serving.md): ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``
and ``POST /v1/completions`` (streaming or not), the same two under a session
(``/v1/sessions/<id>/...``, so a client's ``base_url`` names the episode; or the
``X-Session-Id`` header), and for training ``POST /rl/episodes`` (claim the next
episode), ``POST /rl/set_reward`` and ``POST /rl/abort``.

aiohttp: one well-kept package for the server (and the streaming responses) with no
framework around it; it runs its own event loop in this thread, so the trainer's main
thread keeps the generator. Handlers parse and validate (`protocol`), hand the request to
the `ServingEngine` and await its events; a client that goes away cancels its handler
(``handler_cancellation``) or fails its next write, and the engine is told to free the
session's sequence. Every error is a JSON body with a 4xx status (5xx only for the
server's own faults); nothing a client sends reaches the generator loop unchecked.

Safety: the server binds where it is told (loopback by default); `ServerSettings.check`
refuses any other address without a bearer key, and with a key every route but
``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tandem.rl.core.configlib import is_loopback
from tandem.rl.core.reward_range import reward_problem
from tandem.rl.generator.serve.limits import ConnectionCap, QuietLog
from tandem.rl.generator.serve.protocol import (
    BadRequest,
    chunk,
    error_body,
    parse_chat,
    parse_completion,
    response,
)


@dataclass
class ServerSettings:
    """Where the endpoint listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (`AgentServer.port` says which)
    api_key: str | None = None  # bearer key; required when host is not a loopback address
    max_request_mb: float = 4.0  # larger request bodies get 413
    model_name: str = "tandem"  # the id /v1/models lists (requests may name any model)
    max_connections: int = 128  # open at once; one more gets 503 and is closed (limits.py)
    idle_timeout_s: float = 30.0  # a connection with no request in flight this long is closed

    def check(self) -> str | None:
        """Why these settings are unsafe or invalid (None: fine)."""
        if not 0 <= self.port < 65536:
            return f"port: must be in [0, 65536), got {self.port}"
        if self.max_request_mb <= 0:
            return f"max_request_mb: must be > 0, got {self.max_request_mb}"
        if self.max_connections < 1:
            return f"max_connections: must be >= 1, got {self.max_connections}"
        if not self.idle_timeout_s > 0:
            return f"idle_timeout_s: must be > 0, got {self.idle_timeout_s}"
        if not self.api_key and not is_loopback(self.host):
            return (
                f"host: {self.host!r} is not a loopback address; serving there needs a bearer key "
                "(set the api_key or TANDEM_API_KEY)"
            )
        return None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class AgentServer:
    """The endpoint. ``engine`` (a `ServingEngine`) is set while a generator serves and None
    between rollouts (generation requests then get 503); ``board`` (training) hands out the
    step's episodes."""

    def __init__(self, settings: ServerSettings, vocab_size: int) -> None:
        self.settings, self.vocab = settings, vocab_size
        self.engine: Any = None
        self.board: Any = None
        self.finished = False  # training over: /rl/episodes says done
        self.port = settings.port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.quiet = QuietLog()
        self.cap: ConnectionCap | None = None

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> AgentServer:
        """Bind and serve in a daemon thread; OSError (e.g. the port is taken) is raised here."""
        ready, failed = threading.Event(), []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.set_exception_handler(self.quiet.loop_errors)
            runner = web.AppRunner(
                self._app(),
                handle_signals=False,
                handler_cancellation=True,
                access_log=None,
                keepalive_timeout=self.settings.idle_timeout_s,
            )
            try:
                loop.run_until_complete(runner.setup())
                self.cap = ConnectionCap(runner.server, self.settings.max_connections)
                server = loop.run_until_complete(
                    loop.create_server(
                        self.cap, self.settings.host, self.settings.port, reuse_address=True
                    )
                )
                self.port = server.sockets[0].getsockname()[1]
            except OSError as e:
                failed.append(e)
                ready.set()
                return
            self._loop = loop
            ready.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="tandem-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    def stop(self, grace_s: float = 0.0) -> None:
        """Say "done" to harnesses for ``grace_s`` seconds, then stop serving."""
        self.finished = True
        if grace_s > 0:
            time.sleep(grace_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._loop = None

    # ---- the app ------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(
            client_max_size=int(self.settings.max_request_mb * (1 << 20)),
            middlewares=[self._errors],
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/sessions/{sid}/models", self._models)
        for base in ("/v1", "/v1/sessions/{sid}"):
            app.router.add_post(base + "/chat/completions", self._chat)
            app.router.add_post(base + "/completions", self._completion)
        app.router.add_post("/rl/episodes", self._episodes)
        app.router.add_post("/rl/set_reward", self._set_reward)
        app.router.add_post("/rl/abort", self._abort)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.settings.api_key
        try:
            if key and request.path != "/health":
                # bytes that are not UTF-8 arrive as surrogates: compared, never a 500
                got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(got, f"Bearer {key}".encode()):
                    raise BadRequest(
                        "a valid bearer key is required (Authorization: Bearer <key>)",
                        401,
                        kind="authentication_error",
                    )
            return await handler(request)
        except BadRequest as e:
            return web.json_response(error_body(str(e), e.status, e.param, e.kind), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response(error_body(e.reason or "error", e.status), status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001  (the server's own fault: 500, the run goes on)
            self.quiet.traceback()  # at most one per 10 s: a fault that repeats cannot flood
            return web.json_response(
                error_body(
                    f"internal error: {type(e).__name__}: {e}"[:300], 500, kind="server_error"
                ),
                status=500,
            )

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}"[:300]) from None
        except RecursionError:  # e.g. [[[[...]]]] 100,000 deep
            raise BadRequest("the body is JSON nested too deeply") from None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "serving": self.engine is not None, "done": self.finished}
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tandem",
                    }
                ],
            }
        )

    # ---- generation ---------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=True)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=False)

    def _call(self, msg: tuple) -> asyncio.Queue:
        """Submit ``msg`` with an emit callback appended; return the queue of its events."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:  # runs in the engine's thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
            except RuntimeError:  # the server's loop has stopped
                pass

        engine = self.engine
        if engine is None or not engine.submit((*msg, emit)):
            raise BadRequest("no rollout is running; retry later", 503, kind="unavailable")
        return q

    async def _turn(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._json(request)
        req = parse_chat(body, self.vocab) if chat else parse_completion(body, self.vocab)
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id")
        ephemeral = sid is None
        sid = sid or f"req-{uuid.uuid4().hex}"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = req.model or self.settings.model_name
        q = self._call(("turn", sid, ephemeral, req))
        resp: web.StreamResponse | None = None
        try:
            kind, payload = await q.get()
            if kind == "error":
                raise payload
            if not req.stream:
                return web.json_response(response(req, rid, model, payload))
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            first = True
            while kind != "done":
                if kind == "error":
                    await resp.write(_sse(error_body(str(payload), payload.status)))
                    break
                await resp.write(_sse(chunk(req, rid, model, payload, first=first)))
                first = False
                kind, payload = await q.get()
            if kind == "done":
                if req.include_usage:
                    await resp.write(
                        _sse(
                            chunk(
                                req,
                                rid,
                                model,
                                None,
                                usage=(len(payload.prompt_token_ids), len(payload.token_ids)),
                            )
                        )
                    )
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            engine = self.engine
            if engine is not None:
                engine.submit(("cancel", sid, None))  # frees the sequence
            raise

    # ---- training: episodes, rewards, aborts --------------------------------------------
    async def _episodes(self, request: web.Request) -> web.Response:
        """Claim the next episode of the running rollout: ``{"episode": {...}}``, or
        ``{"episode": null, "done": bool}`` when none is waiting (done: the training ended)."""
        board = self.board
        task = board.claim() if board is not None and not self.finished else None
        if task is None:
            return web.json_response({"episode": None, "done": self.finished})
        return web.json_response(
            {
                "episode": {
                    "session_id": task.id,
                    "base_url": f"{self.url}/v1/sessions/{task.id}",
                    "row": task.row,
                },
                "done": False,
            }
        )

    async def _control(self, request: web.Request, kind: str) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("session_id"), str):
            raise BadRequest('the body needs "session_id" (a string)', param="session_id")
        msg: tuple = (kind, body["session_id"])
        if kind == "reward":
            r, turn = body.get("reward"), body.get("turn")
            why = reward_problem(r)
            if why is not None:
                raise BadRequest(f"reward: {why}"[:200], param="reward")
            if turn is not None and (
                isinstance(turn, bool) or not isinstance(turn, int) or turn < 0
            ):
                raise BadRequest(f"turn: must be an integer >= 0, got {turn!r}"[:200], param="turn")
            msg += (float(r), turn)
        kind, payload = await self._call(msg).get()
        if kind == "error":
            raise payload
        return web.json_response(payload)

    async def _set_reward(self, request: web.Request) -> web.Response:
        return await self._control(request, "reward")

    async def _abort(self, request: web.Request) -> web.Response:
        return await self._control(request, "abort")
