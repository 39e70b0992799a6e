"""Graph backends: how a program (segments and attention breaks, see engine.model.Step) is captured
and replayed. A backend knows nothing of buckets, padding or slicing: that is the runner's job.

    none       not a backend: the runner is not built, every call is eager
    debug      replays eagerly over the runner's static buffers: the CPU stand-in that exercises the
               runner's padding, slicing and can-run logic, and tells a capture bug from a runner bug
    full       the whole program in one CUDA graph, attention included (over a static kv_len)
    breakable  each run of segments between breaks is one CUDA graph; breaks (attention) run eagerly
               between replays, over the live kv_len; all segments of all buckets share one pool
    piecewise  the same mechanics per token-count bucket; serves prefill and extend

A break writes its outputs into the tensors it produced at capture time (`copy_`), so the captured
segment after it reads them at fixed addresses; outputs whose shape depends on kv_len (the mask)
are read by breaks only and are rebound instead.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from engine.model import Step, run_steps

NEEDS_CUDA = {"full", "breakable", "piecewise"}
DYNAMIC_KV = {"debug", "breakable", "piecewise"}  # attention sees the live kv_len at replay


class Captured:
    """A program bound to one bucket's env; `replay(env)` runs it and leaves the outputs in env."""

    def replay(self, env: dict) -> None:
        raise NotImplementedError


class EagerReplay(Captured):
    def __init__(self, steps: list[Step]):
        self.steps = steps

    def replay(self, env: dict) -> None:
        run_steps(self.steps, env)


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


class FullGraph(Captured):
    def __init__(self, steps: list[Step], env: dict, pool, device: torch.device):
        self.graph = torch.cuda.CUDAGraph()
        with _CaptureStream(device) as stream:
            run_steps(steps, env)  # warm-up
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                run_steps(steps, env)

    def replay(self, env: dict) -> None:
        self.graph.replay()


class SegmentedGraph(Captured):
    """Captured segments with eager breaks between them, replayed in order.

    A break must read exactly the tensors it read at capture time (the captured segment before it
    refreshes them in place), not whatever a later segment bound to the same env key: each break
    keeps a snapshot of the env it saw. What a break writes is copied into the tensors it produced
    at capture time (the captured segment after it reads those addresses); a write whose shape
    changed with the live kv_len (the mask) is read by later breaks only, and is passed on to them.
    """

    def __init__(self, steps: list[Step], env: dict, pool, device: torch.device):
        self.parts: list[tuple[str, object]] = []  # ("graph", CUDAGraph) | ("break", (Step, seen, written))
        with _CaptureStream(device) as stream:
            run_steps(steps, env)  # warm-up
            run: list[Step] = []
            for step in steps + [None]:
                if step is None or step.is_break:
                    if run:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                            run_steps(run, env)
                        self.parts.append(("graph", g))
                        run = []
                    if step is not None:
                        seen = dict(env)
                        step.fn(env)
                        written = {k: v for k, v in env.items() if seen.get(k) is not v and torch.is_tensor(v)}
                        self.parts.append(("break", (step, seen, written)))
                else:
                    run.append(step)

    def replay(self, env: dict) -> None:
        fresh: dict = {}  # this replay's break outputs that could not go into a static tensor
        for kind, part in self.parts:
            if kind == "graph":
                part.replay()
                continue
            step, seen, static = part
            local = {**seen, **fresh, "kv_len": env["kv_len"]}
            step.fn(local)
            for k, t in static.items():
                if local[k].shape == t.shape:
                    t.copy_(local[k])  # the next segment reads the capture-time tensor
                else:
                    fresh[k] = local[k]


def _debug(steps, env, pool, device) -> Captured:
    return EagerReplay(steps)


BACKENDS: dict[str, Callable[[list[Step], dict, Optional[object], torch.device], Captured]] = {
    "debug": _debug,
    "full": FullGraph,
    "breakable": SegmentedGraph,
    "piecewise": SegmentedGraph,
}
POLICIES = ("none", *BACKENDS)
