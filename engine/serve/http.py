"""The server's two processes: the engine (this one: the model, the scheduler's thread) and the HTTP front
(a spawned child: uvicorn around the OpenAI app of engine/serve/openai_server.py), joined by the pipe of
engine/serve/link.py. They share no GIL: the front's parsing, chat templates, detokenizing and socket
writes never hold up a round's launches (in one process they cost the engine 20-30% of its tokens/s).

Stopping (`OpenAIServer`): the first Ctrl-C or SIGTERM drains: the listener stays open, new requests
get a 503 with Retry-After (engine/serve/protocol.py; /health answers 503 "draining", /metrics still
answers), in-flight ones finish and the log counts them down; when none is left (or
serve.drain_timeout_s passed) uvicorn shuts down. A second Ctrl-C aborts the in-flight requests (a
streaming client gets an error event and `[DONE]`, a waiting one a 503) and stops within
ABORT_GRACE_S, with no traceback. Signals reach the engine process (a terminal's Ctrl-C, a SIGTERM to
its pid), which forwards them to the front: the front sits in its own process group and runs the drain.
A front that dies stops the engine's requests; an engine that dies stops the front.

The GIL: the engine process has the engine thread and the link's (engine/serve/link.py), which answers
the front's messages; while serving, the switch interval is SWITCH_INTERVAL_S so that a submit waits on
the engine thread's GIL for at most that long (Python's 5 ms would delay a request's start).

Connections (engine/serve/guard.py): at most as many as the file-descriptor limit allows (raised to its
hard limit), each request head within a deadline; the event loop's errors are logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable, Iterator, Optional

import uvicorn

from engine.serve import guard
from engine.serve.guard import GuardedH11, RateLimitedErrors, raise_fd_limit
from engine.serve.link import EngineLink, FrontResult, RemoteEngine
from engine.serve.openai_server import OpenAIApp
from engine.serve.protocol import ApiLimits
from engine.tokenizer import Tokenizer

ABORT_GRACE_S = 2.0  # after a stop-now abort: time for handlers to write their error before uvicorn closes
FRONT_EXIT_S = 10.0  # how long the engine waits for the front process to exit once it said it is done
SWITCH_INTERVAL_S = 1e-4  # the engine process's GIL switch interval while serving (Python's default: 5 ms)


@dataclass(frozen=True)
class FrontSpec:
    """What the front process is built from (pickled into it)."""

    tokenizer: Tokenizer
    limits: ApiLimits
    api_key: Optional[str]
    loopback: bool
    host: str
    port: int
    drain_timeout_s: float
    log_level: str = "warning"
    # engine/serve/guard.py's bounds as this process has them (the front's module starts afresh)
    max_connections: int = field(default_factory=lambda: guard.MAX_CONNECTIONS)
    head_timeout_s: float = field(default_factory=lambda: guard.HEAD_TIMEOUT_S)


class _Server(uvicorn.Server):
    """uvicorn's server, stopping in two steps. Its own first signal would close the listener at once
    (new clients refused) and its second cancel the ASGI tasks (tracebacks): here a signal only counts
    (`stops`) and the event loop's tick, every 0.1 s, does the rest (`_Front._tick`)."""

    sigint = False  # a Ctrl-C, not a SIGTERM, stopped it
    stops = 0  # 1: drain, 2: stop now
    tick: Optional[Callable[[], bool]] = None  # the draining step: True when uvicorn may shut down
    on_loop: Callable[[asyncio.AbstractEventLoop], None] = staticmethod(lambda loop: None)
    on_started: Callable[[], None] = staticmethod(lambda: None)

    def handle_exit(self, sig: int, frame) -> None:
        self.sigint = self.sigint or sig == signal.SIGINT
        self.stops += 1

    async def serve(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(RateLimitedErrors())
        self.on_loop(loop)
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.stops > 0 and self.tick is not None and self.tick()


# ------------------------------------------------------------------------------------------ the front
class _Front:
    """The front process: uvicorn around `OpenAIApp`, over the engine's end of the pipe."""

    def __init__(self, conn: Connection, spec: FrontSpec):
        self.conn, self.spec = conn, spec
        guard.MAX_CONNECTIONS, guard.HEAD_TIMEOUT_S = spec.max_connections, spec.head_timeout_s
        self.engine = RemoteEngine(conn)
        getattr(spec.tokenizer, "byte_pieces", None)  # a byte-level tokenizer's table, before the first stream
        self.api = OpenAIApp(self.engine, spec.tokenizer, spec.limits, api_key=spec.api_key, loopback=spec.loopback)
        metrics = self.api.metrics
        protocol = type(  # this server's bounds and counter (engine/serve/guard.py)
            "Protocol",
            (GuardedH11,),
            {
                "max_connections": raise_fd_limit(),
                "refused": staticmethod(lambda status: metrics.rejected.labels(str(status)).inc()),
            },
        )
        config = uvicorn.Config(
            self.api.app,
            host=spec.host,
            port=spec.port,
            http=protocol,
            log_config=None,
            log_level=spec.log_level,
            timeout_graceful_shutdown=ABORT_GRACE_S,  # the drain ran before: only connections closing remain
            lifespan="off",
            access_log=False,
        )
        self.server = _Server(config)
        self.server.tick = self._tick
        self.server.on_loop = self.engine.attach
        self.server.on_started = lambda: self.engine.send(("ready", self.server.servers[0].sockets[0].getsockname()[1]))
        self.engine.on_stop = self._stop
        self.aborted = 0  # requests aborted by a stop-now (a second Ctrl-C, or the drain timeout)
        self.cpu0 = time.process_time()  # the process's imports and setup are not serving
        self._drain_deadline: Optional[float] = None
        self._abort_at: Optional[float] = None
        self._left: Optional[int] = None

    def _stop(self, now: bool) -> None:
        """What a signal does (now: a second one): the engine's `shutdown`, or the engine gone."""
        self.server.stops = max(self.server.stops + 1, 2 if now else 1)

    def _tick(self) -> bool:
        """On the event loop, every 0.1 s once a stop was asked: drain, count down, abort on a second
        stop or at the deadline. True: nothing in flight (or the abort's grace is over), shut down."""
        now, left = time.monotonic(), self.engine.in_flight
        if self._drain_deadline is None:
            self.api.draining = True
            self._drain_deadline = now + self.spec.drain_timeout_s
            print(
                f"[serve] draining: {left} request{'s' if left != 1 else ''} in flight, new ones get 503 "
                f"(up to serve.drain_timeout_s={self.spec.drain_timeout_s:g}; Ctrl-C again stops now)",
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
            self.engine.abort()
        return self._abort_at is not None and now - self._abort_at >= ABORT_GRACE_S

    def run(self) -> None:
        try:
            self.server.run()  # returns after the drain and uvicorn's shutdown
        except KeyboardInterrupt:  # a Ctrl-C before uvicorn installed its handlers
            self.server.sigint = True
        except SystemExit:  # uvicorn exits when it cannot start (the address is taken, ...)
            if self.server.started:
                raise
            c = self.server.config
            self.engine.send(("failed", f"the server could not start on {c.host}:{c.port}"))
            return
        self.engine.send(("done", FrontResult(self.server.sigint, self.aborted, time.process_time() - self.cpu0)))


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What is alive on entry (the imports, the model's and the app's objects) in the collector's permanent
    generation while serving: its full passes, paid by whichever thread allocates, no longer walk a
    startup's millions of objects (sglang's `freeze_gc` and vLLM's after warm-up do the same). Unfrozen on
    exit, so that the interpreter's shutdown collects it as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def front_main(conn: Connection, spec: FrontSpec) -> None:
    """The front process's entry point (spawned)."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the engine only, which forwards it once
    logging.basicConfig(format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")  # as Hydra's, to stderr
    front = _Front(conn, spec)
    with frozen_heap():
        front.run()
    conn.close()


# ------------------------------------------------------------------------------------------ the engine
class OpenAIServer:
    """The engine's side of a server: the scheduler's thread here, the HTTP front in a child process.

    run() blocks: starts the engine thread and the front, serves the front's requests until it stops
    (Ctrl-C / SIGTERM, forwarded to it, or `shutdown()` from another thread), then stops the engine
    (draining what is left). In the main thread a Ctrl-C ends run() normally."""

    def __init__(self, spec: FrontSpec, scheduler, graphs=None):
        self.spec, self.scheduler, self.graphs = spec, scheduler, graphs
        self.drain_timeout_s = spec.drain_timeout_s
        self.interrupted = False  # stopped by Ctrl-C
        self.aborted = 0  # requests aborted by a stop-now (a second Ctrl-C, or the drain timeout)
        self.http_cpu_s = 0.0  # CPU time of the front process, set when run() returns
        self.link: Optional[EngineLink] = None
        self.front: Optional[multiprocessing.process.BaseProcess] = None
        self._settled = threading.Event()  # the front listens, or it will not (failed, stopped)

    @property
    def port(self) -> int:
        return self.link.port

    def _forward_signals(self) -> Callable[[], None]:
        """In the main thread: Ctrl-C and SIGTERM go on to the front (it drains). -> undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def forward(sig: int, frame) -> None:
            if self.front is not None and self.front.pid is not None and self.front.is_alive():
                os.kill(self.front.pid, sig)

        before = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, h) for sig, h in before.items()]

    def run(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # the engine's CUDA context and threads stay here
        here, there = ctx.Pipe()
        self.link = EngineLink(here, self.scheduler, self.graphs)
        self.front = ctx.Process(target=front_main, args=(there, self.spec), name="specpipe-front", daemon=True)
        undo, switch = self._forward_signals(), sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the link's thread answers a submit within this
        with frozen_heap():  # the model, graphs and warm-up stay; rounds then collect only what they make
            self.scheduler.start()
            try:
                self.front.start()
                there.close()
                self.link.pump(on_ready=lambda port: self._settled.set())
            finally:
                self._settled.set()
                undo()
                sys.setswitchinterval(switch)
                self.scheduler.close(drain=True, timeout=self.drain_timeout_s)
                self.front.join(FRONT_EXIT_S)
                if self.front.is_alive():
                    self.front.kill()
                here.close()
        if self.link.failed is not None:
            raise RuntimeError(f"{self.link.failed} (uvicorn's log above says why; serve.port=0 picks a free port)")
        result = self.link.result or FrontResult(False, 0, 0.0)  # None: the front died
        self.interrupted, self.aborted, self.http_cpu_s = result.interrupted, result.aborted, result.cpu_s

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """True once the front listens (`port`); False after `timeout`, or at once if it never will."""
        return self._settled.wait(timeout) and self.link.port is not None

    def shutdown(self, now: bool = False) -> None:
        """From any thread: what Ctrl-C does (now=True: what a second one does)."""
        if self.link is not None:
            self.link.send(("stop", now))
