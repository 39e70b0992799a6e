"""What stands between the network and the OpenAI app: who may call, how much they may send, how many.

    Guard(app, limits, count)     ASGI middleware, outermost: the Host header on a loopback server
                                  (DNS rebinding), the API key (Bearer, every path but /health), the body
                                  size (Content-Length, and the bytes of a chunked body as they arrive),
                                  each refused in OpenAI's error shape and counted (`count(status)`)
    GuardedH11                    uvicorn's h11 protocol with a connection cap (a connection beyond it gets
                                  a 503 with Retry-After and is closed: its file descriptor back) and a
                                  deadline for each request head (idle and slowly-sent heads are closed)
    RateLimitedErrors             the event loop's exception handler: one line per kind every LOG_EVERY_S
    raise_fd_limit() -> int       the soft RLIMIT_NOFILE raised to the hard one -> the connections to allow

Limits: a body at most `max_body_bytes` (from the context: every legitimate request fits), request heads
within HEAD_TIMEOUT_S, at most `max_connections` open connections. None of these reads a body whole before
deciding; nothing here touches the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.protocol import RETRY_AFTER_S, ApiError

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = (
    10.0  # a request head (line and headers) must arrive within this long of the connection or the last response
)
LOG_EVERY_S = 10.0  # one log line per kind of event-loop error in this long, with the count of the others
FD_RESERVE = 128  # descriptors kept for the process itself (weights, logs, MLflow, the engine)
MAX_CONNECTIONS = 4096  # at most, whatever the descriptor limit allows
OPEN_PATHS = ("/health",)  # answered without the API key: a load balancer's probe
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
BYTES_PER_TOKEN = 64  # a body budget per context token: any text of that many tokens, JSON-escaped, fits
MIN_BODY_BYTES = 1 << 20


def body_limit(max_seq_len: int) -> int:
    """The largest request body a server with this context accepts (1 MiB at least)."""
    return max(MIN_BODY_BYTES, BYTES_PER_TOKEN * max_seq_len)


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """`[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    if header.startswith("["):
        return header[1 : header.find("]")]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class GuardLimits:
    api_key: Optional[str]  # None: no authentication
    loopback: bool  # the server listens on loopback only: requests must name a loopback host
    max_body_bytes: int


class BodyTooLarge(HTTPException):
    """Raised inside the app while it reads the body: FastAPI passes an HTTPException on (and would turn
    any other error into a 400); the app's handler answers it in OpenAI's shape."""

    def __init__(self, limit: int, seen: int):
        super().__init__(
            413, f"the request body (more than {seen} bytes) is beyond this server's limit of {limit} bytes"
        )


class Guard:
    """ASGI middleware (see the module docstring); plain ASGI so that streams and disconnects pass through."""

    def __init__(self, app, limits: GuardLimits, count: Callable[[int], None]):
        self.app, self.limits, self.count = app, limits, count

    async def _refuse(self, scope, receive, send, err: ApiError, close: bool = False) -> None:
        self.count(err.status)
        response = err.response()
        if err.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        if close:
            response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        lim = self.limits
        if lim.loopback and "host" in headers and _host_name(headers["host"]) not in LOOPBACK_NAMES:
            err = ApiError(
                400,
                f"Host {headers['host']!r} is not this server's: it listens on loopback "
                "(serve.host=0.0.0.0 and serve.api_key serve other hosts)",
                code="invalid_host",
            )
            await self._refuse(scope, receive, send, err)
            return
        if lim.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), lim.api_key.encode()):
                why = "no API key given" if not given else "the API key is not valid"
                err = ApiError(401, f"{why} (Authorization: Bearer <serve.api_key>)", code="invalid_api_key")
                await self._refuse(scope, receive, send, err)
                return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > lim.max_body_bytes):
            await self._refuse(scope, receive, send, self._too_large(declared), close=True)
            return
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > lim.max_body_bytes:
                    raise BodyTooLarge(lim.max_body_bytes, seen)
            return message

        await self.app(scope, bounded_receive, send)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body ({size} bytes) is beyond this server's limit of {self.limits.max_body_bytes} bytes",
            code="request_too_large",
        )


# ------------------------------------------------------------------------------------------ connections
def _busy_response() -> bytes:
    body = json.dumps(
        ApiError(
            503, "too many open connections; retry later", code="too_many_connections", type_="server_error"
        ).body()
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, bounded: `max_connections` open at once, each request head within
    HEAD_TIMEOUT_S (uvicorn times out only the idle time after a response). Set the class attributes
    before uvicorn builds connections (OpenAIServer does)."""

    max_connections = MAX_CONNECTIONS
    refused: Callable[[int], None] = staticmethod(lambda status: None)  # counts a refused connection
    _head_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:
            type(self).refused(503)
            transport.write(_busy_response())
            transport.close()
            self.transport = None
            return
        super().connection_made(transport)
        self._await_head()

    def _await_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport is not None and not self.transport.is_closing() and self._between_requests():
            self.transport.close()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # refused in connection_made
            return
        if self._between_requests():
            self._await_head()
        super().data_received(data)
        if not self._between_requests() and self._head_timer is not None:  # a head arrived: its request runs
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc) -> None:
        if self.transport is None:
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()


class RateLimitedErrors:
    """An event loop's exception handler that logs each kind of error (its message) once every
    LOG_EVERY_S, with how many were left out: thousands of `accept()` failures a second (descriptors
    exhausted) are one line, not a log that fills the disk."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def __call__(self, loop, context: dict) -> None:
        kind = context.get("message", "error")
        now = time.monotonic()
        if now - self.last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return
        self.last[kind] = now
        skipped = self.skipped.pop(kind, 0)
        exc = context.get("exception")
        log.error(
            "%s%s%s",
            kind,
            f": {type(exc).__name__}: {exc}" if exc is not None else "",
            f" (and {skipped} more in the last {LOG_EVERY_S:g} s)" if skipped else "",
        )


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to the hard one -> the connections to allow."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(16, min(MAX_CONNECTIONS, soft - FD_RESERVE))
