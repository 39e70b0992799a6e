"""The engine process and the HTTP front process, joined by one duplex pipe (`multiprocessing.Pipe`).

The engine is the pipeline's own process (the model, the scheduler's engine thread); the front is a
child (uvicorn, the OpenAI app, tokenizing and detokenizing: engine/serve/http.py). They share no GIL,
so the front's HTTP work never holds up a round's launches. Messages are tuples:

    front -> engine   ("submit", rid, Submission)   ("cancel", rid, reason)   ("abort",)   ("snapshot", ask)
                      ("recount", reason, "stop")   a stop string in a request the engine ended as reason
    engine -> front   ("submitted", rid, None | (refusal, message))   ("snapshot", ask, EngineSnapshot)
                      ("events", [(rid, tokens, finish_reason, error, counts), ...])   one message per
                      engine pass (a TokenEvent's fields as plain values: they pickle several times faster)
                      ("stop", now)   what Ctrl-C does (now: a second one)
    front lifecycle   ("ready", port)   ("failed", message)   ("done", FrontResult)

Invariants: a submit is answered once; an accepted rid then gets events ending in one with a
finish_reason, each with the request's `counts` so far (its usage); a front that goes away aborts what
it submitted, and an engine that goes away fails what the front waits on.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Callable, Optional

from engine.serve.requests import GenerationRequest, QueueFull, ServeStats, ShuttingDown, TokenEvent

if TYPE_CHECKING:  # the front process imports this module: no torch there
    from engine.serve.scheduler import Scheduler

REFUSALS = {"queue_full": QueueFull, "shutting_down": ShuttingDown, "invalid": ValueError}


@dataclass(frozen=True)
class Submission:
    """A request as the front hands it over: `GenerationRequest`'s fields the engine needs."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop_ids: frozenset[int]
    speculative: bool


@dataclass
class EngineSnapshot:
    """What /health and /metrics read: the scheduler's counters and load at one moment."""

    stats: ServeStats
    running: int
    queue_depth: int
    slots: int
    alive: bool
    graphs: dict[str, tuple[int, int]] = field(default_factory=dict)  # phase -> (replays, fallbacks)


@dataclass(frozen=True)
class FrontResult:
    interrupted: bool  # stopped by Ctrl-C (not SIGTERM, nor `shutdown()`)
    aborted: int  # requests aborted by a stop-now
    cpu_s: float  # the front process's CPU time: HTTP, tokens to text, SSE


def wire_event(rid: int, ev: TokenEvent, n: tuple[int, int, int]) -> tuple:
    """A request's event as an "events" message carries it: (rid, tokens, finish_reason, error, counts)."""
    return rid, ev.tokens, ev.finish_reason, ev.error, n


def counts(req: GenerationRequest) -> tuple[int, int, int]:
    """(verify rounds, draft tokens proposed, draft tokens accepted) of a request so far."""
    return len(req.accepts), req.draft_tokens, req.accepted_tokens


def speculation(rounds: int, draft_tokens: int, accepted: int) -> dict:
    """A request's speculation figures (its `counts`): verify rounds (after the prefill's first token),
    draft tokens proposed to it and accepted, tokens per round (bonus included) and draft tokens per
    round; the last two null before any round."""
    return {
        "verify_rounds": rounds,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accept_length": (accepted + rounds) / rounds if rounds else None,
        "mean_k": draft_tokens / rounds if rounds else None,
    }


# ------------------------------------------------------------------------------------------ engine side
class EngineLink:
    """The engine process's end: `pump()` (on the caller's thread) takes the front's messages until it
    is done; token events gather in `put` (engine thread, or the pump's for a cancelled waiting request)
    and leave in one message per engine pass (`flush`, the scheduler's hook)."""

    def __init__(self, conn: Connection, scheduler: Scheduler, graphs=None):
        self.conn, self.scheduler, self.graphs = conn, scheduler, graphs
        self.requests: dict[int, GenerationRequest] = {}  # rid -> the running request (pump and engine)
        self.events: list[tuple] = []
        self.lock = threading.Lock()  # events, and the pipe's writes
        self.port: Optional[int] = None  # the front's, once it listens
        self.failed: Optional[str] = None
        self.result: Optional[FrontResult] = None
        scheduler.flush = self.flush

    def send(self, msg: tuple) -> None:
        with self.lock:
            self._write(msg)

    def _write(self, msg: tuple) -> None:  # under self.lock
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):  # the front is gone: pump() sees EOF
            pass

    def put(self, rid: int, ev: TokenEvent) -> None:
        req = self.requests.pop(rid) if ev.finish_reason is not None else self.requests[rid]
        with self.lock:
            self.events.append(wire_event(rid, ev, counts(req)))

    def flush(self) -> None:
        with self.lock:
            if not self.events:
                return
            batch, self.events = self.events, []
            self._write(("events", batch))

    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        graphs = {p: (ps.replays, ps.fallbacks) for p, ps in self.graphs.stats().items()} if self.graphs else {}
        return EngineSnapshot(copy.deepcopy(s.stats), s.running, s.queue_depth, s.n, s.alive, graphs)

    def _submit(self, rid: int, sub: Submission) -> None:
        req = GenerationRequest(
            sub.prompt,
            sub.max_tokens,
            lambda ev: self.put(rid, ev),
            sub.temperature,
            sub.top_p,
            sub.seed,
            sub.stop_ids,
            sub.speculative,
        )
        self.requests[rid] = req
        refusal = None
        try:
            self.scheduler.submit(req)
        except (QueueFull, ShuttingDown, ValueError) as e:
            self.requests.pop(rid, None)
            refusal = (next(k for k, cls in REFUSALS.items() if isinstance(e, cls)), str(e))
        self.send(("submitted", rid, refusal))

    def pump(self, on_ready: Callable[[int], None] = lambda port: None) -> None:
        """Serve the front's messages until it is done or gone; then abort what it left running."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "submit":
                self._submit(msg[1], msg[2])
            elif kind == "cancel" and (req := self.requests.get(msg[1])) is not None:
                self.scheduler.cancel(req, msg[2])
            elif kind == "recount":
                self.scheduler.recount(msg[1], msg[2])
            elif kind == "abort":
                self.scheduler.abort()
            elif kind == "snapshot":
                self.send(("snapshot", msg[1], self.snapshot()))
            elif kind == "ready":
                self.port = msg[1]
                on_ready(self.port)
            elif kind == "failed":
                self.failed = msg[1]
                break
            elif kind == "done":
                self.result = msg[1]
                break
            self.flush()  # a cancelled waiting request finished here
        for req in list(self.requests.values()):
            self.scheduler.cancel(req)


# ------------------------------------------------------------------------------------------ front side
class RemoteEngine:
    """The front process's end, on its event loop: submit / cancel / abort and snapshots, with the
    engine's events put into each request's queue as they arrive (one wake-up per engine pass)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.queues: dict[int, asyncio.Queue] = {}  # rid -> the request's events
        self.waiting: dict[int, asyncio.Future] = {}  # asks and submits not answered yet
        self.stopping: set[int] = set()  # cancelled for a stop string, their last event not here yet
        self.alive = True  # the engine is there
        self.on_stop: Callable[[bool], None] = lambda now: None
        self._ids = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.conn.fileno(), self._readable)

    @property
    def in_flight(self) -> int:
        return len(self.queues)

    def _ask(self, msg_head: str, *args) -> tuple[int, asyncio.Future]:
        self._ids += 1
        fut = self._loop.create_future()
        self.waiting[self._ids] = fut
        self.send((msg_head, self._ids, *args))
        return self._ids, fut

    async def submit(self, sub: Submission) -> tuple[int, asyncio.Queue]:
        """Queue a request on the engine: (rid, its events' queue); raises QueueFull or ShuttingDown."""
        if not self.alive:
            raise ShuttingDown("the engine stopped")
        rid, fut = self._ask("submit", sub)
        queue = self.queues[rid] = asyncio.Queue()  # its events may come before the answer, the last too
        try:
            refusal = await fut
        except BaseException:
            self.queues.pop(rid, None)
            raise
        if refusal is not None:
            self.queues.pop(rid, None)
            raise REFUSALS[refusal[0]](refusal[1])
        return rid, queue

    def cancel(self, rid: int, reason: str = "abort") -> None:
        if rid in self.queues:
            self.send(("cancel", rid, reason))

    def stop(self, rid: int, ended: Optional[str]) -> None:
        """A stop string ended request rid, and its client is told "stop": cancel it as such. Where the
        engine ended it as "length" first (`ended`, its last event's reason, or its cancel crossing
        that event), it is counted again as "stop"."""
        if rid in self.queues:
            self.stopping.add(rid)
            self.send(("cancel", rid, "stop"))
        elif ended == "length":
            self.send(("recount", ended, "stop"))

    def abort(self) -> None:
        self.send(("abort",))

    async def snapshot(self) -> EngineSnapshot:
        return await self._ask("snapshot")[1]

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._gone()

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self._gone()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "events":
            for rid, tokens, finish, error, n in msg[1]:
                if (q := self.queues.get(rid)) is not None:
                    q.put_nowait((TokenEvent(tokens, finish, error), n))
                    if finish is not None:
                        del self.queues[rid]
                        if rid in self.stopping:
                            self.stopping.discard(rid)
                            self.stop(rid, finish)
        elif kind in ("submitted", "snapshot"):
            if (fut := self.waiting.pop(msg[1], None)) is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "stop":
            self.on_stop(msg[1])

    def _gone(self) -> None:
        """The engine went away: fail what waits on it, and stop."""
        if not self.alive:
            return
        self.alive = False
        if self._loop is not None:
            self._loop.remove_reader(self.conn.fileno())
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ShuttingDown("the engine stopped"))
        self.waiting.clear()
        for q in self.queues.values():
            q.put_nowait((TokenEvent([], "error", "the engine stopped"), (0, 0, 0)))
        self.queues.clear()
        self.stopping.clear()
        self.on_stop(True)
