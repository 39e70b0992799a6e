"""Programs: what a graph runner captures and replays, as named steps over an env dict of its buffers.

    Step(name, fn, is_break, meta, phase)   fn(env) reads and writes tensors in env; `meta` (the first
                                            step's) is what the runner checks the models against
    run_steps(steps, env, on_phase)         eagerly, or under a capture (engine/graphs/breakable.py): a
                                            break step runs eagerly between captured graphs, a new
                                            phase begins a new graph; on_phase(name) where one begins

A step's own eager marks (`@eager`, e.g. the attention) split it further under a breakable capture.
Host values in env (`HOST_KEYS`: the live kv_len, a `Live` box under a runner) are never captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.graphs.breakable import eager_env, phase, phases


@dataclass
class Step:
    """One piece of a program: fn(env) captured, or with `is_break` run eagerly between captures."""

    name: str
    fn: Callable[[dict], None]
    is_break: bool = False
    meta: dict = field(default_factory=dict)
    phase: str = ""


def run_steps(steps: list[Step], env: dict, on_phase: Optional[Callable[[str], None]] = None) -> dict:
    with phases(on_phase):
        current = ""
        for s in steps:
            if s.phase != current:
                current = s.phase
                phase(current)
            if s.is_break:
                eager_env(s.fn, env)
            else:
                s.fn(env)
    return env
