"""What bounds the endpoint's sockets: a connection cap and a log that cannot flood.

aiohttp closes a connection that sends no request for ``keepalive_timeout`` seconds (set
from `ServerSettings.idle_timeout_s`, from the moment it opens), but it accepts any number
of them: about 250 idle connections, no key needed, used up a 256-descriptor limit, after
which every accept, file open and socket in the process failed and each failure printed a
traceback (19,207 in 15 s from tandem-serve). `ConnectionCap` answers a connection past
the cap with a 503 and closes it at once, so the descriptors in use stay bounded;
`QuietLog` prints one line per ``every_s`` seconds for the event loop's errors (asyncio
already waits 1 s after a failed accept) and for the server's own 500s, and counts the rest.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from typing import Any

_BUSY = json.dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "unavailable",
            "param": None,
            "code": 503,
        }
    }
).encode()


class _Busy(asyncio.Protocol):
    """A connection over the cap: one 503 and closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: "
            + str(len(_BUSY)).encode()
            + b"\r\n\r\n"
            + _BUSY
        )
        transport.close()


class ConnectionCap:
    """A protocol factory over aiohttp's ``Server``: at most ``limit`` connections open."""

    def __init__(self, server: Any, limit: int) -> None:
        self.server, self.limit = server, limit
        self.refused = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.server.connections) >= self.limit:
            self.refused += 1
            return _Busy()
        return self.server()


class QuietLog:
    """At most one report per ``every_s`` seconds; the ones left out are counted and said
    with the next."""

    def __init__(self, every_s: float = 10.0, name: str = "tandem-http") -> None:
        self.every_s, self.name = every_s, name
        self._last = -float("inf")
        self.dropped = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.dropped += 1
            return False
        self._last = now
        return True

    def line(self, msg: str) -> None:
        if self.allow():
            more, self.dropped = self.dropped, 0
            extra = f" ({more} more since, not shown)" if more else ""
            print(f"[{self.name}] {msg}{extra}", file=sys.stderr, flush=True)

    def traceback(self) -> None:
        """The current exception's traceback, at most once per ``every_s``."""
        if self.allow():
            traceback.print_exc(file=sys.stderr)

    def loop_errors(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An event loop exception handler: one line, no traceback (a failed accept under a
        descriptor limit repeats every second)."""
        exc = context.get("exception")
        what = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self.line(f"{context.get('message', 'event loop error')}{what}")
