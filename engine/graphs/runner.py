"""The graph runner: buckets, static buffers, padding, slicing, can-run checks and counters for one
phase (target decode / verify / prefill, draft step / extend), over any backend.

    runner(live_inputs, kv_len, mode) -> (outputs, ran)

`live_inputs` are [b, t, ...] tensors. When a bucket (B, T) with B >= b and T >= t exists and the
graph was captured with at least the hidden-state `mode` asked for, the live inputs are copied into
the bucket's static buffers, padding rows and columns are reset to inert values (valid = False: they
write to the cache's dummy slot and never touch a live row), the captured program replays, and the
outputs are sliced back to [b, t] and *cloned*, so the next replay cannot overwrite them. Otherwise
the program runs eagerly on the live inputs and the call counts as a fallback. Either way the caller
gets one dict of outputs and a flag: it never reads a static buffer itself.

Every program records what it was built with (`Step.meta`: the target's aux layer ids, the draft's
embedding storage). A call whose model no longer matches raises: a graph captured before
`configure_aux_capture`, or before the draft shares the target's embedding, is a bug to report, not
a silent wrong answer.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from engine.graphs.backends import BACKENDS, DYNAMIC_KV
from engine.graphs.breakable import HOST_KEYS
from engine.graphs.program import Step, run_steps
from engine.ops import Live


class CaptureHiddenMode(enum.IntEnum):
    """Which hidden states a graph returns (sglang's names). Larger includes smaller."""

    NULL = 0  # logits only
    LAST = 1  # + the hidden state of the last position (draft steps)
    FULL = 2  # + hidden (and aux) states of every position (target verify/prefill for EAGLE drafts)


@dataclass(frozen=True)
class InputSpec:
    tail: tuple[int, ...]  # shape after [batch, seq] (() for tokens/positions/valid)
    dtype: torch.dtype
    pad: float | int | bool | None = 0  # padding rows' value; None: never reset (state nobody reads there)
    per_row: bool = False  # [batch, ...] without a seq dim (logits_index, a round's state)
    state: bool = False  # kept across calls (a round's state): the eager fallback runs over its rows too


M = CaptureHiddenMode
TARGET_OUT = {M.NULL: ("logits",), M.LAST: ("logits", "hidden"), M.FULL: ("logits", "hidden", "aux", "embeds")}


def token_inputs() -> dict[str, InputSpec]:
    """A model forward's per-token inputs; a padding position is invalid (it writes the dummy slot)."""
    return {
        "tokens": InputSpec((), torch.long, 0),
        "positions": InputSpec((), torch.long, 0),
        "valid": InputSpec((), torch.bool, False),
    }


@dataclass
class PhaseStats:
    replays: int = 0
    fallbacks: int = 0
    capture_s: float = 0.0
    graph_mem_mb: float = 0.0
    buckets: list = field(default_factory=list)


def allocate(specs: dict[str, InputSpec], rows: int, device) -> dict[str, Tensor]:
    """Per-row buffers [rows, *tail] for specs (a round's state), at their pad value (0 without one)."""
    return {
        name: torch.full((rows, *s.tail), 0 if s.pad is None else s.pad, dtype=s.dtype, device=device)
        for name, s in specs.items()
    }


class GraphStateError(RuntimeError):
    pass


class GraphRunner:
    def __init__(
        self,
        name: str,
        policy: str,
        build: Callable[[int], list[Step]],
        inputs: dict[str, InputSpec],
        outputs: dict[CaptureHiddenMode, tuple[str, ...]],
        mode: CaptureHiddenMode,
        buckets: list[tuple[int, int]],
        device: torch.device,
        static_kv_len: int,
        current_meta: Callable[[], dict],
        pool=None,
        buffers: Optional[dict[str, Tensor]] = None,
    ):
        self.name, self.policy, self.build, self.inputs = name, policy, build, inputs
        self.outputs, self.mode, self.device = outputs, mode, device
        self.buckets = sorted(set(buckets), key=lambda bt: (bt[0] * bt[1], bt), reverse=True)  # largest first
        self.static_kv_len, self.current_meta, self.pool = static_kv_len, current_meta, pool
        self.dynamic_kv = policy in DYNAMIC_KV
        self.stats = PhaseStats(buckets=list(self.buckets))
        max_b, max_t = max(b for b, _ in self.buckets), max(t for _, t in self.buckets)
        self.max_t = max_t  # a call with `rows` (no positions) takes this many tokens per row
        self.buffers: dict[str, Tensor] = {}
        for k, s in inputs.items():  # another runner's buffer when it is given and covers this one's shapes
            shape = (max_b, *(() if s.per_row else (max_t,)), *s.tail)
            given = (buffers or {}).get(k)
            fits = (
                given is not None
                and given.dtype == s.dtype
                and given.dim() == len(shape)
                and all(g >= n for g, n in zip(given.shape, shape))
            )
            self.buffers[k] = given if fits else torch.full(shape, s.pad, dtype=s.dtype, device=device)
        self.captured: dict[tuple[int, int], tuple[object, dict]] = {}
        self.meta: Optional[dict] = None

    # -- capture -----------------------------------------------------------------------------------
    def _env(self, b: int, t: int) -> dict:
        env = {k: (buf[:b] if self.inputs[k].per_row else buf[:b, :t]) for k, buf in self.buffers.items()}
        env.update({k: Live() for k in HOST_KEYS})  # a replay sets their values: eager calls read them then
        env["kv_len"].value = self.static_kv_len
        return env

    def capture(self) -> "GraphRunner":
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        mem0, t0 = (torch.cuda.memory_allocated(self.device) if cuda else 0), time.perf_counter()
        for b, t in self.buckets:
            self._reset(b, t, 0, 0)
            steps = self.build(b)
            self.meta = steps[0].meta
            env = self._env(b, t)
            self.captured[(b, t)] = (BACKENDS[self.policy](steps, env, self.pool, self.device), env)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.stats.capture_s = time.perf_counter() - t0
        self.stats.graph_mem_mb = ((torch.cuda.memory_allocated(self.device) if cuda else 0) - mem0) / 2**20
        return self

    # -- replay ------------------------------------------------------------------------------------
    def bucket_for(self, b: int, t: int) -> Optional[tuple[int, int]]:
        fits = [bt for bt in self.buckets if bt[0] >= b and bt[1] >= t]
        return min(fits, key=lambda bt: (bt[0] * bt[1], bt)) if fits else None

    def rows_for(self, t: int) -> int:
        """The most rows one replay takes at t tokens a row (0: no bucket holds t)."""
        return max((b for b, bt in self.buckets if bt >= t), default=0)

    def _reset(self, b: int, t: int, live_b: int, live_t: int) -> None:
        """Padding rows [live_b:b] and columns [live_t:t] to inert values (no launch when none)."""
        for k, buf in self.buffers.items():
            pad = self.inputs[k].pad
            if pad is None:
                continue
            if live_b < b:
                buf[live_b:b].fill_(pad)
            if live_t < t and not self.inputs[k].per_row:
                buf[:live_b, live_t:t].fill_(pad)

    def __call__(
        self,
        live: dict[str, Optional[Tensor]],
        kv_len: int,
        mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
        *,
        rows: Optional[int] = None,
        host: Optional[dict] = None,
        on_phase: Optional[Callable[[str], None]] = None,
        clone: bool = True,
    ) -> tuple[dict, bool]:
        """rows: the live batch when `live` has no positions (a round over its state buffers);
        host: per-call values its breaks read (engine.graphs.breakable.HOST_KEYS); on_phase: called where
        each phase begins (phase timing); clone=False: outputs are views of the static buffers, valid
        until the next call (a caller that copies them out at once)."""
        if self.meta is not None and self.meta != {k: v for k, v in self.current_meta().items() if k in self.meta}:
            raise GraphStateError(
                f"graph '{self.name}' was captured with {self.meta}, the model now has {self.current_meta()}: "
                "configure_aux_capture and weight sharing must happen before capture_graphs"
            )
        b, t = live["positions"].shape if "positions" in live else (rows, self.max_t)
        key = self.bucket_for(b, t) if mode <= self.mode else None
        if key is None:
            self.stats.fallbacks += 1
            state = {k: self._view(k, b, t) for k, s in self.inputs.items() if s.state}
            for k, x in live.items():  # given values of state keys go into their rows, as on a replay
                if k in state and x is not None:
                    state[k].copy_(x)
            env = run_steps(self.build(b), {**live, **state, **(host or {}), "kv_len": kv_len}, on_phase)
            return {k: env.get(k) for k in self.outputs[CaptureHiddenMode.FULL]}, False

        captured, env = self.captured[key]
        for k in self.buffers:
            x = live.get(k)
            if x is not None:
                self._view(k, b, t).copy_(x)
        self._reset(key[0], key[1], b, t)
        for k, v in (host or {}).items():
            env[k].value = v
        env["kv_len"].value = kv_len if self.dynamic_kv else self.static_kv_len
        captured.replay(env, on_phase)
        self.stats.replays += 1
        return {k: self._slice(env.get(k), key, b, t, clone) for k in self.outputs[mode]}, True

    def _view(self, k: str, b: int, t: int) -> Tensor:
        buf = self.buffers[k]
        return buf[:b] if self.inputs[k].per_row else buf[:b, :t]

    @staticmethod
    def _slice(x: Optional[Tensor], key: tuple[int, int], b: int, t: int, clone: bool = True) -> Optional[Tensor]:
        if x is None:
            return None
        x = x[:b]
        if x.dim() > 2 and x.shape[1] == key[1] and t < key[1]:
            x = x[:, :t]
        return x.clone() if clone else x  # the next replay overwrites the static output


def default_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... up to and including max_batch (sglang's capture_bs habit, coarser)."""
    sizes, s = [], 1
    while s < max_batch:
        sizes.append(s)
        s *= 2
    return sizes + [max_batch]
