"""Programs: a forward (or a whole speculative round) as a list of steps over one env dict.

A `Step` reads and writes named tensors in `env`. Graph backends (engine/graphs/backends.py) capture
runs of steps as CUDA graphs; a step marked `is_break` runs eagerly between them (attention over a
live kv_len, a host hook), and a change of `phase` starts a new graph, so each
phase of a round (draft, verify, extend) is its own replay that a clock can time.

    run_steps(steps, env)            eager, in order
    run_steps(steps, env, on_phase)  the same, calling on_phase(name) where a phase begins
    scoped(prefix, steps)            a sub-program (the target's verify, a draft step) whose keys live
                                     under `prefix` in the round's env, so programs that use the same
                                     names (tokens, q, attn, logits, ...) compose without clashing
    merge_runs(steps)                consecutive non-break steps of one phase as one step (fewer
                                     Python calls per eager round; a capture sees the same kernels)

Host values (`HOST_KEYS`: the live kv_len, the host's mirror of the batch) are not tensors: a replay
refreshes them from the call, and a scoped program sees the round's kv_len plus its own offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from engine.graphs.breakable import HOST_KEYS, eager_env, phase, phases


@dataclass
class Step:
    """One piece of a program: a capturable segment, or a break that runs eagerly between captured
    segments. `fn(env)` reads and writes named tensors in `env`."""

    name: str
    fn: Callable[[dict], None]
    is_break: bool = False
    meta: dict = field(default_factory=dict)
    phase: str = ""
    host: bool = False  # reads or writes host state (a Python hook): a break under every policy


def chain(*fns: Callable[[dict], None]) -> Callable[[dict], None]:
    def run(env: dict) -> None:
        for f in fns:
            f(env)

    return run


def run_steps(steps: list[Step], env: dict, on_phase: Optional[Callable[[str], None]] = None) -> dict:
    """Eagerly, or under a breakable capture (engine/graphs/breakable.py): a break runs eagerly between
    the captured graphs, and a change of phase begins a new graph."""
    with phases(on_phase):
        current = None
        for s in steps:
            if s.phase != current:
                current = s.phase
                phase(current)
            if s.is_break:
                eager_env(s.fn, env)
            else:
                s.fn(env)
    return env


def with_phase(steps: list[Step], phase: str) -> list[Step]:
    return [replace(s, phase=phase) for s in steps]


def scoped(prefix: str, steps: list[Step], kv_offset: int = 0) -> list[Step]:
    """`steps` run on the keys of env under `prefix` (written there by a binding step before them);
    host keys come from the round's env, kv_len plus `kv_offset`."""
    n = len(prefix)

    def wrap(fn: Callable[[dict], None]) -> Callable[[dict], None]:
        def run(env: dict) -> None:
            local = {k[n:]: v for k, v in env.items() if k.startswith(prefix)}
            for key in HOST_KEYS:
                if key in env:
                    local[key] = env[key]
            if "kv_len" in env:
                local["kv_len"] = env["kv_len"] + kv_offset
            fn(local)
            for k, v in local.items():
                if k not in HOST_KEYS:
                    env[prefix + k] = v

        return run

    return [replace(s, name=prefix + s.name, fn=wrap(s.fn)) for s in steps]


def merge_runs(steps: list[Step]) -> list[Step]:
    """Consecutive steps of one phase with no break among them, as one step (their names joined)."""
    out: list[Step] = []
    for s in steps:
        prev = out[-1] if out else None
        if prev is not None and not prev.is_break and not s.is_break and prev.phase == s.phase:
            out[-1] = replace(prev, name=f"{prev.name}+{s.name}", fn=chain(prev.fn, s.fn), meta={**prev.meta, **s.meta})
        else:
            out.append(s)
    return out
