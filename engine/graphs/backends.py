"""Graph backends: how a program (engine/graphs/program.py) is captured and replayed. A backend knows nothing
of buckets, padding or slicing: that is the runner's job.

    none       not a backend: the runner is not built, every call is eager
    debug      replays eagerly over the runner's static buffers: the CPU stand-in that exercises the
               runner's padding, slicing and can-run logic, and tells a capture bug from a runner bug
    full       everything captured (attention over a static kv_len): one CUDA graph per phase
    breakable  split at the eager marks (engine/graphs/breakable.py: SDPA attention over the live
               kv_len, a host hook): captured graphs with eager calls between them, in one pool
    piecewise  the same mechanics per token-count bucket; serves prefill

A program with no break (the Triton attention reads each row's live length on the device) is one
graph per phase under full and breakable alike.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.graphs.breakable import Capture
from engine.graphs.program import Step, run_steps

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


class Graphs(Captured):
    """The program captured over `env` (split at its eager marks unless `split` is off)."""

    def __init__(self, steps: list[Step], env: dict, pool, device: torch.device, split: bool = True):
        self.capture = Capture(pool, device, split).run(lambda: run_steps(steps, env))

    def replay(self, env: dict, on_phase=None) -> None:
        self.capture.replay(env, on_phase)


def _debug(steps, env, pool, device) -> Captured:
    return EagerReplay(steps)


def _full(steps, env, pool, device) -> Captured:
    return Graphs(steps, env, pool, device, split=False)


BACKENDS: dict[str, Callable[[list[Step], dict, Optional[object], torch.device], Captured]] = {
    "debug": _debug,
    "full": _full,
    "breakable": Graphs,
    "piecewise": Graphs,
}
POLICIES = ("none", *BACKENDS)
