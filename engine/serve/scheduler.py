"""Continuous batching over a fixed set of slots: requests join and leave a running batch between rounds.

    slots    n = serve.max_batch_size rows of the target's static KV cache, of the draft's and of the
             graphs' buffers; a request holds one slot from its prefill to its last token
    join     the waiting requests (as many as there are free slots and `max_prefill_tokens` padded tokens
             allow) take the lowest free slots, wherever they are. The target prefills their prompts at
             once (`SpecDecoder.prefill(rows=slots)`: the prefill graphs over the graph set's staging rows,
             serve.join_rows prompts a replay where they fit, their KV then copied into the slots); then each run
             of contiguous slots starts (`SpecDecoder.start`: the requests' sampling into the slots' state
             buffers, the first tokens drawn, the draft's prefill over its staging rows, KV into the slots),
             leaving every other row's draft state
    step     one `SpecDecoder.round` over the slots up to the last occupied one: propose -> verify ->
             commit, the same code eval runs; free slots among them ride along as invalid rows (they write
             to the cache's dummy slot and are never read); then finished and cancelled requests leave and
             waiting ones join. With adaptive k (engine/speculative/adaptive_k.py) the round's k follows those rows
    threads  `run()` is the engine loop, on one thread (all torch work). `submit` / `cancel` / `close`
             come from any thread (the link to the HTTP front: engine/serve/link.py) and only touch the
             queue, under a lock. Tokens go back through each request's `sink`, called on the engine
             thread, and `flush` after each pass of the loop hands a pass's events on at once.

The draft keeps per-row state (KV rows, carried hidden state, next proposal) for every slot; a round
replays the smallest bucket that holds its rows (requests take the lowest free slots, so a light load
runs small rounds). Rows above the largest capture size run eagerly, counted as fallbacks.

Sampling is per request (`engine.sampling.RowSettings`, in the round's state buffers): greedy requests
are exactly greedy in any batch; sampled ones use their own temperature and top-p, the draft samples
its proposals from its own q under them and the verify accepts by rejection sampling (lossless). A
request's random numbers come from its seed alone (kernels/sample.py: counter-based, by position), so
a request with a `seed` gets the same output whatever else is in the batch; an unseeded one gets a seed
drawn from the server's generator at its join. A request with `speculative=False` takes no draft token
(accepted = 0 every round): its output is exactly plain decoding's.
Each request counts its verify rounds, draft tokens and accepted ones (its usage), and adaptive k
counts an opted-out row as one a draft buys nothing.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch

from engine.drafts.base import SpecState
from engine.sampling import RowSettings, as_seed, seeds_from
from engine.serve.requests import (  # noqa: F401  (the scheduler's types, importable from here too)
    FINISH_REASONS,
    GenerationRequest,
    QueueFull,
    ServeStats,
    ShuttingDown,
    TokenEvent,
)
from engine.speculative.generate import SpecDecoder, runs

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        decoder: SpecDecoder,
        num_slots: int,
        max_queue: int,
        generator: Optional[torch.Generator] = None,
        max_prefill_tokens: int = 8192,
        stream_interval: int = 1,
    ):
        if num_slots > decoder.batch_size:
            raise ValueError(f"{num_slots} slots, but the decoder's cache holds {decoder.batch_size} rows")
        self.dec, self.n, self.max_queue = decoder, num_slots, max_queue
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens of one joint prefill (one request: any)
        self.stream_interval = stream_interval  # tokens a request gathers before its sink gets them
        self.device, self.k = decoder.device, decoder.k
        self.generator = generator  # draws the seeds of requests without one
        self.cache = decoder.cache.rows(num_slots)
        self.slots: list[Optional[GenerationRequest]] = [None] * num_slots
        self.state = SpecState(
            [[0] for _ in range(num_slots)], [0] * num_slots, [False] * num_slots, list(range(num_slots)), self.device
        )
        self._live_changed = True  # slots left since the last round: their live flags go to the device
        self.stats = ServeStats(accepted_at=[0] * self.k, drafted_at=[0] * self.k)
        self.waiting: deque[GenerationRequest] = deque()
        self._cv = threading.Condition()
        self._closing = self._stop = False
        self._drain = True
        self._thread: Optional[threading.Thread] = None
        self.flush: Callable[[], None] = lambda: None  # after each engine pass: hands on the sinks' events

    # -- any thread ---------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (waiting, prefilling or generating)."""
        with self._cv:
            return self.stats.in_flight

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes requests."""
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; raises QueueFull (max_queue requests already wait beyond the free slots)
        or ShuttingDown."""
        need = len(req.prompt) + req.max_tokens + self.k
        if not req.prompt or need > self.dec.model.max_seq_len:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} + {self.k} "
                f"draft tokens needs {need} KV slots, the cache has {self.dec.model.max_seq_len}"
            )
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            free = self.n - self.running  # waiting requests about to take a free slot do not queue
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(
                    f"{len(self.waiting) - free} requests are waiting for a slot (serve.max_queue={self.max_queue})"
                )
            req.t_submit = time.perf_counter()
            if self.stats.in_flight == 0:
                self.stats.busy_since = req.t_submit
            self.stats.submitted += 1
            self.stats.not_speculative += not req.speculative
            self.stats.prompt_tokens += len(req.prompt)
            if self.stats.first_submit is None:
                self.stats.first_submit = req.t_submit
            self.waiting.append(req)
            self._cv.notify()

    def cancel(self, req: GenerationRequest, reason: str = "abort") -> None:
        """Free the request's slot at the next step: its client is gone ("abort"), or a stop string ended
        it ("stop": counted as a request that stopped, as its client was told)."""
        with self._cv:
            if req.finish_reason is not None or req.cancelled:  # done, or already cancelled: the first reason holds
                return
            req.cancelled = reason
            try:
                self.waiting.remove(req)
            except ValueError:  # running (or being admitted): the engine thread releases it
                self._cv.notify()
                return
            self._finish(req, reason)  # the lock is reentrant

    def recount(self, reason: str, as_reason: str) -> None:
        """Count a finished request as `as_reason`, not `reason`: the front found a stop string in the
        tokens of a request the engine had ended ("length"), and told its client "stop"."""
        with self._cv:
            self.stats.finished[reason] -= 1
            self.stats.finished[as_reason] += 1

    def warm_up(self) -> float:
        """Serve a few throwaway requests on the caller's thread before `start`, so the kernels that
        only the eager paths launch (a join's prefill, the draft's begin, the first draw, greedy and
        sampled, one and several rows joining) compile now and not under the first clients' requests.
        The counters, the queue and adaptive k's estimates are left as they were; returns seconds."""
        if self._thread is not None:
            raise RuntimeError("warm_up runs before start")
        t0, policy = time.perf_counter(), copy.deepcopy(self.dec.adaptive)
        n_max = self.dec.model.max_seq_len
        # prompts of each projection launch rule (kernels/gemv.py): <= 16 rows; up to 64, one 64-row tile or
        # (narrow weights) 16-row tiles 16 or 32 columns wide by row count; several row tiles
        short, mid, long = 5, min(40, n_max // 4), min(100, n_max // 2 + 1)
        narrow = [(min(n, n_max // 2), 0.0) for n in (20, 60)]
        groups = [
            [(short, 0.0)],
            [(mid, 1.0), (short, 0.7)],
            [(mid, 0.0), (short, 1.0), (mid, 0.0)],
            narrow,
            [(long, 0.0)],
            [(long, 0.7)],
        ]
        with torch.inference_mode():
            for group in groups:  # each cut to the slots: one slot still sees a sampled join
                reqs = [
                    GenerationRequest([1 + i % 50 for i in range(n)], 4, lambda e: None, t, 0.9 if t else 1.0, seed=j)
                    for j, (n, t) in enumerate(group[: self.n])
                ]
                self.waiting.extend(reqs)
                while any(r.finish_reason is None for r in reqs):
                    self._admit()
                    if self.running:
                        self._step()
        self.stats = ServeStats(accepted_at=[0] * self.k, drafted_at=[0] * self.k)
        self.dec.clock.reset()  # the phases' stream time, too
        for runner in [*self.dec.runners.values(), self.dec.prefill_runner, *self.dec.draft_prefills.values()]:
            if runner is not None:  # the graphs' replay counters start with the first client too
                runner.stats.replays = runner.stats.fallbacks = 0
        self.dec.adaptive = policy
        return time.perf_counter() - t0

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._thread.start()
        return self

    def abort(self) -> None:
        """Stop taking requests and abort the running and waiting ones after the current round; returns at
        once (a signal handler's or the event loop's way to stop now: `close` joins the engine thread)."""
        with self._cv:
            self._closing = self._stop = True
            self._drain = False
            self._cv.notify_all()

    def close(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop taking requests; drain=True finishes the running and waiting ones first (up to
        `timeout` seconds, then aborts them), drain=False aborts them now."""
        with self._cv:
            self._closing = self._stop = True
            self._drain = drain
            self._cv.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                self._drain = False
                self._cv.notify_all()
            self._thread.join(30)

    # -- the engine thread --------------------------------------------------------------------------
    def run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._loop()
        finally:
            self.stats.engine_cpu_s += time.thread_time() - cpu0

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self.waiting or self.running or self._stop):
                        self._cv.wait()
                    if self._stop and (not self._drain or not (self.waiting or self.running)):
                        break
                try:
                    self._retire_cancelled()
                    self._admit()
                    if self.running:
                        self._step()
                except Exception as e:  # a bug, or out of memory: fail what runs, keep serving
                    log.exception("engine step failed")
                    for i, req in enumerate(self.slots):
                        if req is not None:
                            self._release(i, req, "error", str(e))
                self.flush()
            with self._cv:
                left = list(self.waiting)
                self.waiting.clear()
            for req in left:
                self._finish(req, "abort")
            for i, req in enumerate(self.slots):
                if req is not None:
                    self._release(i, req, "abort")
            self.flush()

    def _retire_cancelled(self) -> None:
        for i, req in enumerate(self.slots):
            if req is not None and req.cancelled:
                self._release(i, req, req.cancelled)

    def _admit(self) -> None:
        """Fill free slots from the queue: waiting requests, as many as there are free slots (the lowest
        first, wherever they are) and the prefill token budget allows, prefill together."""
        while True:
            free = [i for i, r in enumerate(self.slots) if r is None]
            if not free:
                return
            batch: list[GenerationRequest] = []
            with self._cv:
                while self.waiting and len(batch) < len(free):
                    req = self.waiting[0]
                    width = max([len(r.prompt) for r in batch] + [len(req.prompt)])
                    if batch and width * (len(batch) + 1) > self.max_prefill_tokens:
                        break
                    self.waiting.popleft()
                    if req.cancelled:
                        self._finish(req, req.cancelled)
                    else:
                        batch.append(req)
            if not batch:
                if not self.waiting:
                    return
                continue
            try:
                self._join(batch, free[: len(batch)])
            except Exception as e:  # these requests' prefill failed: they alone fail, their rows stay free
                log.exception("prefill failed")
                for req, i in zip(batch, free):
                    if self.slots[i] is req:
                        self._release(i, req, "error", str(e))
                    elif req.finish_reason is None:
                        self.state.history[i], self.state.lengths[i], self.state.live[i] = [0], 0, False
                        self._live_changed = True
                        self._finish(req, "error", str(e))

    def _join(self, reqs: list[GenerationRequest], slots: list[int]) -> None:
        """Prefill `reqs` into `slots` (ascending; the target's prefill at once, then each run of
        contiguous slots starts: settings, first token, the draft's prefill), and emit their first tokens."""
        t0, st, clock = time.perf_counter(), self.state, self.dec.clock
        marks = [clock.mark()]
        pre = self.dec.prefill([r.prompt for r in reqs], None, slots)
        marks.append(clock.mark())
        unseeded = [r.seed is None and r.temperature > 0 for r in reqs]  # greedy rows draw nothing
        drawn = iter(seeds_from(self.generator, sum(unseeded)))
        seeds = [next(drawn) if u else as_seed(r.seed or 0) for r, u in zip(reqs, unseeded)]
        for req, i in zip(reqs, slots):
            st.history[i], st.lengths[i], st.live[i] = list(req.prompt), len(req.prompt), True
        first, j = [], 0
        for i, n in runs(slots):  # [n] first tokens of slots i..i+n-1 (on the device)
            part = reqs[j : j + n]
            settings = RowSettings(
                [r.temperature for r in part], [r.top_p for r in part], seeds[j : j + n], [r.speculative for r in part]
            )
            first.append(self.dec.start(st, pre.part(j, j + n), settings, rows=slice(i, i + n)))
            j += n
        marks.append(clock.mark())
        toks = torch.cat(first).tolist()  # the join's one sync
        clock.span("join_target", marks[0], marks[1])  # stream time: the target's prefill
        clock.span("join_draft", marks[1], marks[2])  # the first draws and the draft's prefills
        clock.settle()
        for req, i, tok in zip(reqs, slots, toks):
            st.history[i].append(tok)
            self.slots[i], req.slot = req, i
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefills += 1
        now = time.perf_counter()
        for req, i, tok in zip(reqs, slots, toks):
            self._emit(i, req, [tok], now)

    def _round_rows(self) -> int:
        """Rows a round spans: up to the last occupied slot (requests take the lowest free slots, so
        under a light load a round is small; with adaptive k, its k follows)."""
        return max(i for i, r in enumerate(self.slots) if r is not None) + 1

    def _step(self) -> None:
        t0, stats = time.perf_counter(), self.stats
        if self._live_changed:
            self.dec.push_live(self.state)
            self._live_changed = False
        rows = self._round_rows()
        r = self.dec.round(self.state, rows=rows)
        stats.rounds += 1
        t1 = time.perf_counter()
        stats.round_s += t1 - t0 - r.put_off_s
        stats.prefill_s += r.put_off_s  # a put-off draft prefill is the join's
        stats.rounds_by_k[r.k] = stats.rounds_by_k.get(r.k, 0) + 1
        stats.last_k = r.k
        speculated, kept = 0, [0] * (r.k + 1)  # rows that took the round's k drafts; rows by drafts accepted
        for i, req in enumerate(self.slots[:rows]):
            if req is None:
                continue
            a = r.accepted[i]
            req.accepts.append(a)
            req.accepted_tokens += a
            kept[a] += 1
            if req.speculative:
                req.draft_tokens += r.k
                speculated += 1
            if req.cancelled:
                self._release(i, req, req.cancelled)
            else:
                self._emit(i, req, r.emitted[i], r.time)
        stats.row_rounds += sum(kept)
        stats.draft_tokens += speculated * r.k
        beyond = sum(kept[1:])  # rows that accepted more than p drafts
        for p in range(r.k):  # position p: drafted in every speculating row, kept in rows that accepted more
            stats.drafted_at[p] += speculated
            stats.accepted_at[p] += beyond
            stats.accepted_tokens += beyond
            beyond -= kept[p + 1]
        stats.emit_s += time.perf_counter() - t1

    def _emit(self, i: int, req: GenerationRequest, tokens: list[int], now: float) -> None:
        """Hand a slot's new tokens to its request, cut at a stop token or max_tokens: the first at once,
        then every `stream_interval` tokens, the rest with the finish."""
        out, finish = tokens, None
        if len(req.output) + len(tokens) >= req.max_tokens or not req.stop_ids.isdisjoint(tokens):
            out = []  # the end is among these tokens: cut there
            for tok in tokens:
                out.append(tok)
                if tok in req.stop_ids:
                    finish = "stop"
                    break
                if len(req.output) + len(out) >= req.max_tokens:
                    finish = "length"
                    break
        first = not req.output
        req.output += out
        req.unsent += out
        req.t_first = req.t_first or now
        self.stats.generated_tokens += len(out)
        if finish is not None:
            self._release(i, req, finish)
        elif first or len(req.unsent) >= self.stream_interval:
            req.sink(TokenEvent(req.unsent))
            req.unsent = []

    def _release(
        self,
        i: int,
        req: GenerationRequest,
        reason: str,
        error: Optional[str] = None,
    ) -> None:
        st = self.state
        self.slots[i] = None
        st.history[i], st.lengths[i], st.live[i] = [0], 0, False
        self._live_changed = True
        tokens, req.unsent = req.unsent, []
        self._finish(req, reason, error, tokens)

    def _finish(
        self, req: GenerationRequest, reason: str, error: Optional[str] = None, tokens: Optional[list[int]] = None
    ) -> None:
        with self._cv:  # cancel() finishes waiting requests from another thread
            req.finish_reason, req.t_done = reason, time.perf_counter()
            self.stats.finished[reason] += 1
            self.stats.last_finish = req.t_done
            if self.stats.in_flight == 0 and self.stats.busy_since is not None:
                self.stats.busy_s += req.t_done - self.stats.busy_since
                self.stats.busy_since = None
        req.sink(TokenEvent(tokens or [], reason, error))
