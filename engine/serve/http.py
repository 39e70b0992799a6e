"""uvicorn around the OpenAI app (engine/serve/openai_server.py), with the scheduler's lifetime tied to it.

Stopping (`OpenAIServer`): the first Ctrl-C or SIGTERM drains: the listener stays open, new requests
get a 503 with Retry-After (engine/serve/protocol.py; /health answers 503 "draining", /metrics still
answers), in-flight ones finish and the log counts them down; when none is left (or
serve.drain_timeout_s passed) uvicorn shuts down. A second Ctrl-C aborts the in-flight requests (a
streaming client gets an error event and `[DONE]`, a waiting one a 503) and stops within
ABORT_GRACE_S, with no traceback.

Connections (engine/serve/guard.py): at most as many as the file-descriptor limit allows (raised to its
hard limit), each request head within a deadline; the event loop's errors are logged at a bounded rate.

The GIL: the engine thread releases it in every graph replay and sync, and the event loop (streaming
chunks, parsing requests) then holds it for up to Python's switch interval, 5 ms, while the device waits
for the next launch. While serving, the interval is SWITCH_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Callable, Optional

import uvicorn

from engine.serve.guard import GuardedH11, RateLimitedErrors, raise_fd_limit
from engine.serve.openai_server import OpenAIApp

ABORT_GRACE_S = 2.0  # after a stop-now abort: time for handlers to write their error before uvicorn closes
SWITCH_INTERVAL_S = 1e-4  # the GIL's switch interval while serving (Python's default: 5 ms)


class _Server(uvicorn.Server):
    """uvicorn's server, stopping in two steps. Its own first signal would close the listener at once
    (new clients refused) and its second cancel the ASGI tasks (tracebacks): here a signal only counts
    (`stops`) and the event loop's tick, every 0.1 s, does the rest (`OpenAIServer._tick`)."""

    sigint = False  # a Ctrl-C, not a SIGTERM, stopped it
    stops = 0  # 1: drain, 2: stop now
    tick: Optional[Callable[[], bool]] = None  # the draining step: True when uvicorn may shut down

    def handle_exit(self, sig: int, frame) -> None:
        self.sigint = self.sigint or sig == signal.SIGINT
        self.stops += 1  # not re-raised after the shutdown: the stage ends normally and logs its run

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(RateLimitedErrors())
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.stops > 0 and self.tick is not None and self.tick()


class OpenAIServer:
    """uvicorn around `OpenAIApp`, with the scheduler's lifetime tied to it.

    run() blocks: starts the engine thread, serves until Ctrl-C / SIGTERM (or `shutdown()` from another
    thread), drains (new requests 503, in-flight ones finish, up to drain_timeout_s; a second Ctrl-C
    aborts them), then stops uvicorn and the engine. In the main thread a Ctrl-C ends run() normally."""

    def __init__(self, api: OpenAIApp, host: str, port: int, drain_timeout_s: float, log_level: str = "warning"):
        self.api, self.scheduler, self.drain_timeout_s = api, api.scheduler, drain_timeout_s
        protocol = type(  # this server's bounds and counter (engine/serve/guard.py)
            "Protocol",
            (GuardedH11,),
            {
                "max_connections": raise_fd_limit(),
                "refused": staticmethod(lambda status: api.metrics.rejected.labels(str(status)).inc()),
            },
        )
        config = uvicorn.Config(
            api.app,
            host=host,
            port=port,
            http=protocol,
            log_config=None,
            log_level=log_level,
            timeout_graceful_shutdown=ABORT_GRACE_S,  # the drain ran before: only connections closing remain
            lifespan="off",
            access_log=False,
        )
        self.server = _Server(config)
        self.server.tick = self._tick
        self.interrupted = False  # stopped by Ctrl-C
        self.aborted = 0  # requests aborted by a stop-now (a second Ctrl-C, or the drain timeout)
        self.http_cpu_s = 0.0  # CPU time of the thread that ran the event loop, set when run() returns
        self._drain_deadline: Optional[float] = None
        self._abort_at: Optional[float] = None
        self._left: Optional[int] = None

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def _tick(self) -> bool:
        """On the event loop, every 0.1 s once a stop was asked: drain, count down, abort on a second
        stop or at the deadline. True: nothing in flight (or the abort's grace is over), shut down."""
        now, left = time.monotonic(), self.scheduler.in_flight
        if self._drain_deadline is None:
            self.api.draining = True
            self._drain_deadline = now + self.drain_timeout_s
            print(
                f"[serve] draining: {left} request{'s' if left != 1 else ''} in flight, new ones get 503 "
                f"(up to serve.drain_timeout_s={self.drain_timeout_s:g}; Ctrl-C again stops now)",
                flush=True,
            )
        elif left != self._left:
            print(f"[serve] draining: {left} left", flush=True)
        self._left = left
        if left == 0:
            return True
        if self._abort_at is None and (self.server.stops > 1 or now >= self._drain_deadline):
            self._abort_at, self.aborted = now, left
            why = "Ctrl-C again" if self.server.stops > 1 else "serve.drain_timeout_s passed"
            print(f"[serve] {why}: aborting {left} in-flight request{'s' if left != 1 else ''}", flush=True)
            self.scheduler.abort()
        return self._abort_at is not None and now - self._abort_at >= ABORT_GRACE_S

    def run(self) -> None:
        switch, cpu0 = sys.getswitchinterval(), time.thread_time()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.scheduler.start()
        try:
            self.server.run()  # returns after the drain and uvicorn's shutdown
            self.interrupted = self.server.sigint
        except KeyboardInterrupt:  # a Ctrl-C before uvicorn installed its handlers
            self.interrupted = True
        except SystemExit:  # uvicorn exits when it cannot start (the address is taken, ...)
            if self.server.started:
                raise
            c = self.server.config
            raise RuntimeError(
                f"the server could not start on {c.host}:{c.port} (uvicorn's log above says why; "
                "serve.port=0 picks a free port)"
            ) from None
        finally:
            self.scheduler.close(drain=True, timeout=self.drain_timeout_s)
            sys.setswitchinterval(switch)
            self.http_cpu_s = time.thread_time() - cpu0  # the event loop's thread: HTTP, tokens to text, SSE

    def wait_ready(self, timeout: float = 60.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.server.started:
                return True
            time.sleep(0.02)
        return False

    def shutdown(self, now: bool = False) -> None:
        """From any thread: what Ctrl-C does (now=True: what a second one does)."""
        self.server.stops = max(self.server.stops + 1, 2 if now else 1)
