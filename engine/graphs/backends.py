"""Graph backends: how a program (steps and breaks, see engine/program.py) is captured and replayed.
A backend knows nothing of buckets, padding or slicing: that is the runner's job.

    none       not a backend: the runner is not built, every call is eager
    debug      replays eagerly over the runner's static buffers: the CPU stand-in that exercises the
               runner's padding, slicing and can-run logic, and tells a capture bug from a runner bug
    full       every step captured (attention over a static kv_len): one CUDA graph per phase
    breakable  each run of steps between breaks is one CUDA graph; breaks (SDPA attention over the
               live kv_len, a host hook) run eagerly between replays; all graphs
               of all buckets share one pool
    piecewise  the same mechanics per token-count bucket; serves prefill

A program with no break (the Triton attention reads each row's live length on the device) is one
graph per phase under full and breakable alike. A break writes its outputs into the tensors it
produced at capture time (`copy_`), so the captured segment after it reads them at fixed addresses;
outputs whose shape depends on kv_len (the mask) are read by breaks only and are rebound instead.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from engine.program import HOST_KEYS, Step, run_steps

NEEDS_CUDA = {"full", "breakable", "piecewise"}
DYNAMIC_KV = {"debug", "breakable", "piecewise"}  # attention sees the live kv_len at replay


class Captured:
    """A program bound to one bucket's env; `replay(env)` runs it and leaves the outputs in env,
    calling `on_phase(name)` where each phase of the program begins (phase timing)."""

    def replay(self, env: dict, on_phase: Optional[Callable[[str], None]] = None) -> None:
        raise NotImplementedError


class EagerReplay(Captured):
    def __init__(self, steps: list[Step]):
        self.steps = steps

    def replay(self, env: dict, on_phase=None) -> None:
        run_steps(self.steps, env, on_phase)


class _CaptureStream:
    """Warm-up and capture on one side stream: cuBLAS sets up its workspace for a stream on first use,
    which must not happen inside a capture, so the stream that captures is the one that warmed up.
    Python's GC is off meanwhile: a collection during a capture can run the finalizer of an old graph
    or tensor on this thread (a free or graph destroy), which invalidates the capture."""

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


class PhasedGraph(Captured):
    """Captured segments with eager breaks between them, replayed in order; a new phase starts a new
    graph. With `capture_breaks` (policy full) breaks are captured too: one graph per phase.

    A break must read exactly the tensors it read at capture time (the captured segment before it
    refreshes them in place), not whatever a later segment bound to the same env key: each break
    keeps a snapshot of the env it saw, with the call's host values (HOST_KEYS) refreshed. What a
    break writes is copied into the tensors it produced at capture time (the captured segment after
    it reads those addresses); a write whose shape changed with the live kv_len (the mask) is read by
    later breaks only, and is passed on to them.
    """

    def __init__(self, steps: list[Step], env: dict, pool, device: torch.device, capture_breaks: bool = False):
        # ("graph", phase, CUDAGraph) | ("break", phase, (Step, seen, written))
        self.parts: list[tuple[str, str, object]] = []
        with _CaptureStream(device) as stream:
            run_steps(steps, env)  # warm-up
            run: list[Step] = []
            for step in steps + [None]:
                eager = step is not None and step.is_break and not capture_breaks
                if run and (step is None or eager or step.phase != run[0].phase):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        run_steps(run, env)
                    self.parts.append(("graph", run[0].phase, g))
                    run = []
                if step is None:
                    break
                if eager:
                    seen = dict(env)
                    step.fn(env)
                    written = {k: v for k, v in env.items() if seen.get(k) is not v and torch.is_tensor(v)}
                    self.parts.append(("break", step.phase, (step, seen, written)))
                else:
                    run.append(step)

    def replay(self, env: dict, on_phase=None) -> None:
        fresh: dict = {}  # this replay's break outputs that could not go into a static tensor
        host = {k: env[k] for k in HOST_KEYS if k in env}
        phase = None
        for kind, part_phase, part in self.parts:
            if on_phase is not None and part_phase != phase:
                phase = part_phase
                on_phase(phase)
            if kind == "graph":
                part.replay()
                continue
            step, seen, static = part
            local = {**seen, **fresh, **host}
            step.fn(local)
            for k, t in static.items():
                if local[k].shape == t.shape:
                    t.copy_(local[k])  # the next segment reads the capture-time tensor
                else:
                    fresh[k] = local[k]


def _debug(steps, env, pool, device) -> Captured:
    return EagerReplay(steps)


def _full(steps, env, pool, device) -> Captured:
    return PhasedGraph(steps, env, pool, device, capture_breaks=True)


BACKENDS: dict[str, Callable[[list[Step], dict, Optional[object], torch.device], Captured]] = {
    "debug": _debug,
    "full": _full,
    "breakable": PhasedGraph,
    "piecewise": PhasedGraph,
}
POLICIES = ("none", *BACKENDS)
