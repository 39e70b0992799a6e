"""Breakable graphs: a plain callable captured as CUDA graphs, split where it calls a function marked `eager`.

    @eager            under a splitting capture a call ends the current graph, runs eagerly and is recorded;
                      the next graph begins after it. Replay alternates graphs and recorded calls; a call
                      reads host values as they are at replay (engine.ops.Live: the live kv_len), and its
                      tensor result is copied into the tensor it returned at capture (the next graph reads
                      that address). Outside a capture, or inside `captured()`, it is a plain call.
    eager_env(fn, env)  the same for a program step over an env dict (engine/graphs/program.py): it re-reads
                      the env it saw at capture, with the replay's host keys, and writes back what it wrote
    phase(name)       a phase boundary: a new graph begins; replay (and an eager run) calls on_phase(name)
    Capture(pool, device, split)   records parts while a callable runs; `replay(env, on_phase)` runs them

One capture at a time, on the capturing thread; all graphs of a run share one memory pool (the caller's).
sglang's breakable CUDA graph (model_executor/breakable_cuda_graph/) is the model.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from typing import Callable, Optional

import torch

HOST_KEYS = ("kv_len", "state")  # an env's per-call host values; never captured

_active: Optional["Capture"] = None  # the capture in progress
_on_phase: Optional[Callable[[str], None]] = None  # an eager run's phase callback


def eager(fn: Callable, host: bool = False) -> Callable:
    """Mark `fn` as a call that must run eagerly between the captured graphs of a breakable graph.
    host=True (a hook that reads host state): eager inside `captured()` too."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        c = _active
        if c is None or not (c.splitting or host and c.split and c.graph is not None):
            return fn(*args, **kwargs)
        return c.record(fn, args, kwargs)

    return call


def eager_env(fn: Callable[[dict], None], env: dict) -> None:
    """A program step `fn(env)` that must run eagerly (see the module docstring)."""
    c = _active
    if c is None or not c.splitting:
        fn(env)
    else:
        c.record_env(fn, env)


def phase(name: str) -> None:
    """Where a phase (draft, verify, extend) begins: a new graph under a capture; on_phase in an eager run."""
    if _active is not None:
        if _active.graph is not None:  # (inside a recorded eager call: no graph to end)
            _active.new_phase(name)
    elif _on_phase is not None:
        _on_phase(name)


class phases:
    """`with phases(on_phase):` an eager run whose phase() marks call on_phase(name)."""

    def __init__(self, on_phase: Optional[Callable[[str], None]]):
        self.on_phase = on_phase

    def __enter__(self):
        global _on_phase
        self.saved, _on_phase = _on_phase, self.on_phase

    def __exit__(self, *exc):
        global _on_phase
        _on_phase = self.saved


class captured:
    """`with captured():` eager marks inside are captured (a side whose graph policy needs no break)."""

    def __enter__(self):
        self.saved = _active.splitting if _active is not None else None
        if _active is not None:
            _active.splitting = False

    def __exit__(self, *exc):
        if _active is not None:
            _active.splitting = self.saved


def _copy_into(static, fresh):
    """A recorded call's result at replay into the tensors it returned at capture (same structure)."""
    if torch.is_tensor(static):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh):
            _copy_into(s, f)


class _CaptureStream:
    """Warm-up and capture on one side stream (cuBLAS sets its workspace up on a stream's first use,
    which must not happen inside a capture); Python's GC is off meanwhile (a collection could free an
    old graph or tensor on this thread during the capture, which invalidates it)."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def __enter__(self) -> torch.cuda.Stream:
        gc.collect()
        self._gc_was_on = gc.isenabled()
        gc.disable()
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self.stream

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self._gc_was_on:
            gc.enable()


class Capture:
    """`Capture(pool, device, split).run(fn)`: warm fn() up, then capture it; `replay(env, on_phase)`.

    parts: ("graph", phase, CUDAGraph) | ("call", phase, (fn, args, kwargs, out))
           | ("env", phase, (fn, seen, written)). split=False (policy full): eager marks are captured
    too, so a program is one graph per phase.
    """

    def __init__(self, pool, device: torch.device, split: bool = True, dry: bool = False):
        self.pool, self.device, self.split, self.dry = pool, device, split, dry
        self.parts: list[tuple[str, str, object]] = []
        self.splitting, self.phase, self.graph = split, "", None

    def run(self, fn: Callable[[], None]) -> "Capture":
        """dry: fn() runs once, eagerly, and only the split is recorded (graph parts hold None): how a
        program splits, on any device (tests, inspection)."""
        global _active
        with contextlib.nullcontext() if self.dry else _CaptureStream(self.device):
            if not self.dry:
                fn()  # warm-up, eagerly
            _active = self
            try:
                self._begin()
                fn()
                self._end()
            finally:
                _active = None
        return self

    # -- capture -------------------------------------------------------------------------------------
    def _begin(self) -> None:
        self.graph = "dry" if self.dry else torch.cuda.CUDAGraph()
        if not self.dry:
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _end(self) -> None:
        if not self.dry:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")  # a break after a break
                self.graph.capture_end()
        self.parts.append(("graph", self.phase, None if self.dry else self.graph))
        self.graph = None

    def _eagerly(self, run: Callable[[], object]) -> object:
        self._end()
        saved, self.splitting = self.splitting, False  # marks nested in an eager call are plain calls
        try:
            return run()
        finally:
            self.splitting = saved
            self._begin()

    def record(self, fn, args, kwargs):
        out = self._eagerly(lambda: fn(*args, **kwargs))
        self.parts.append(("call", self.phase, (fn, args, kwargs, out)))
        return out

    def record_env(self, fn, env: dict) -> None:
        seen = dict(env)
        self._eagerly(lambda: fn(env))
        written = {k: v for k, v in env.items() if seen.get(k) is not v and torch.is_tensor(v)}
        self.parts.append(("env", self.phase, (fn, seen, written)))

    def new_phase(self, name: str) -> None:
        if name != self.phase and not self.parts and not self.phase:  # the program opens with a phase
            self.phase = name
        elif name != self.phase:
            self._end()
            self.phase = name
            self._begin()

    # -- replay --------------------------------------------------------------------------------------
    def replay(self, env: Optional[dict] = None, on_phase: Optional[Callable[[str], None]] = None) -> None:
        """env: the replay's host keys (HOST_KEYS) for env steps; on_phase: called where a phase begins."""
        host = {k: env[k] for k in HOST_KEYS if env is not None and k in env}
        fresh: dict = {}  # env steps' outputs whose shape changed with the live kv_len: read by later breaks only
        current = None
        for kind, name, part in self.parts:
            if on_phase is not None and name != current:
                current = name
                on_phase(name)
            if kind == "graph":
                part.replay()
            elif kind == "call":
                fn, args, kwargs, out = part
                _copy_into(out, fn(*args, **kwargs))
            else:
                fn, seen, written = part
                local = {**seen, **fresh, **host}
                fn(local)
                for k, t in written.items():
                    if local[k].shape == t.shape:
                        t.copy_(local[k])  # the next graph reads the capture-time tensor
                    else:
                        fresh[k] = local[k]
