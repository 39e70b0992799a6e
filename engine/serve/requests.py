"""What a request is to the engine, the events it gets back and the serve counters: plain types, no
torch, shared by the scheduler (engine process) and the link to the HTTP front (engine/serve/link.py),
so that the front process never imports torch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

FINISH_REASONS = ("stop", "length", "abort", "error")  # abort: cancelled (client gone, shutdown)
_ids = itertools.count()


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    pass


@dataclass
class TokenEvent:
    tokens: list[int]  # new tokens of the request (a stop token included when it ended the request)
    finish_reason: Optional[str] = None  # None: more to come; else one of FINISH_REASONS
    error: Optional[str] = None


@dataclass(eq=False)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[TokenEvent], None]  # called on the engine thread: must not block
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: Optional[int] = None  # None: one drawn from the server's generator at the join
    stop_ids: frozenset[int] = frozenset()
    speculative: bool = True  # False: no draft tokens for this request (plain decoding's output)
    id: int = field(default_factory=lambda: next(_ids))
    # -- the engine's bookkeeping ------------------------------------------------------------------
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # output not yet handed to the sink (stream_interval)
    accepts: list[int] = field(default_factory=list)  # per round: draft tokens accepted
    accepted_tokens: int = 0  # sum(accepts), kept as rounds come (its usage goes out with every event)
    draft_tokens: int = 0  # draft tokens proposed to it, summed over its rounds (0 when not speculative)
    finish_reason: Optional[str] = None
    cancelled: Optional[str] = None  # the finish reason of a cancel: "abort" (client gone), "stop" (a stop string)
    slot: Optional[int] = None
    t_submit: float = 0.0
    t_first: Optional[float] = None
    t_done: Optional[float] = None


@dataclass
class ServeStats:
    """Counters since start; read by /metrics from another thread (plain ints and floats)."""

    submitted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    row_rounds: int = 0  # live rows verified, summed over rounds
    draft_tokens: int = 0  # draft tokens proposed to speculating rows, summed over row rounds
    accepted_tokens: int = 0  # draft tokens accepted, summed over row rounds
    not_speculative: int = 0  # submitted requests that turned speculation off
    accepted_at: list[int] = field(default_factory=list)  # [k]: row rounds whose draft token i was accepted
    drafted_at: list[int] = field(default_factory=list)  # [k]: row rounds that drafted token i (adaptive k: not all)
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # rounds per draft tokens (adaptive k)
    last_k: int = 0  # the last round's draft tokens
    prefills: int = 0  # joint prefills (one per group of requests joining together)
    prefill_s: float = 0.0  # host wall time of the joins (target prefill, first draw, draft prefill, also put off)
    round_s: float = 0.0  # host wall time of the rounds, to their one sync
    emit_s: float = 0.0  # host time handing the rounds' tokens to their requests
    engine_cpu_s: float = 0.0  # CPU time of the engine thread (its loop, from `start` to its end)
    first_submit: Optional[float] = None
    last_finish: Optional[float] = None
    busy_s: float = 0.0  # time with at least one request submitted and not finished, closed intervals
    busy_since: Optional[float] = None  # the open interval's start, while requests are in flight

    def busy_time(self, now: float) -> float:
        """Seconds with a request in flight up to `now` (idle time between requests left out)."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

    @property
    def in_flight(self) -> int:
        return self.submitted - sum(self.finished.values())

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify round and row, bonus included (sglang / vLLM's accept length)."""
        return (self.accepted_tokens + self.row_rounds) / self.row_rounds if self.row_rounds else float("nan")

    def accept_rates(self) -> list[float]:
        """Per draft position: the share of the row rounds that drafted it in which it was accepted."""
        return [a / n if n else float("nan") for a, n in zip(self.accepted_at, self.drafted_at)]
