"""Timings a person can trust: paired passes, each ratio with its spread, and a word on the host.

An eval with a baseline times both passes batch by batch on the same prompts (engine-agnostic: the
caller alternates which pass goes first), so load that comes and goes hits both. Per batch j:

    speedup_j   = (draft tokens_j / draft s_j) / (baseline tokens_j / baseline s_j)
    unit_cost_j = (draft s_j / draft rounds_j) / (baseline s_j / baseline steps_j)

`speedup_j` varies with the prompts (their acceptance); `unit_cost_j`, a round's cost in decode steps, does
not on a quiet host, so its spread is the noise. `HostLoad` measures the CPU time other processes took on
the cores this process may run on while the passes ran. `noise_warning` turns both into one line; `fmt_range`
prints a figure to the digits its spread supports.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional

WIDE_SPREAD = 0.25  # unit costs varying by more than this (max / min - 1) across batches: a noisy measurement
LOADED_CORES = 0.5  # other processes using more than half a core of ours on average: a loaded host


@dataclass
class BatchTiming:
    """One batch of one pass: generated tokens, generation seconds, rounds (decode steps without a draft)."""

    tokens: int
    seconds: float
    rounds: int


def per_batch_speedups(base: list[BatchTiming], draft: list[BatchTiming]) -> list[float]:
    return [(d.tokens / d.seconds) / (b.tokens / b.seconds) for b, d in zip(base, draft) if b.tokens and d.tokens]


def unit_cost_spread(base: list[BatchTiming], draft: list[BatchTiming]) -> float:
    """max / min - 1 of a draft round's cost in baseline steps across batches (nan below two batches)."""
    costs = [(d.seconds / d.rounds) / (b.seconds / b.rounds) for b, d in zip(base, draft) if b.rounds and d.rounds]
    return max(costs) / min(costs) - 1 if len(costs) >= 2 else float("nan")


def _busy_and_own() -> Optional[tuple[float, float, int]]:
    """(CPU seconds all processes spent on our cores, CPU seconds this process spent, our core count)."""
    try:
        import psutil
    except ImportError:
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    per_cpu = psutil.cpu_times(percpu=True)
    mine = [per_cpu[i] for i in cores if i < len(per_cpu)] if cores else per_cpu
    busy = sum(sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq")) for t in mine)
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system, len(mine)


class HostLoad:
    """`with HostLoad() as h: ...` -> `h.other_cores`: the mean number of our cores that other processes
    kept busy meanwhile (nan without psutil), and `h.cores`."""

    def __enter__(self) -> "HostLoad":
        self._t0, self._start = time.perf_counter(), _busy_and_own()
        self.other_cores, self.cores = float("nan"), os.cpu_count() or 1
        return self

    def __exit__(self, *exc) -> None:
        end, wall = _busy_and_own(), time.perf_counter() - self._t0
        if self._start is None or end is None or wall <= 0:
            return
        busy, own = end[0] - self._start[0], end[1] - self._start[1]
        self.other_cores, self.cores = round(max(busy - own, 0.0) / wall, 2), end[2]


def decimals_for(spread: float) -> int:
    """Decimals that show a ratio to its first uncertain digit (1..3)."""
    if not spread > 0 or math.isnan(spread):
        return 2
    return min(3, max(1, -math.floor(math.log10(spread))))


def fmt_range(value: float, values: list[float]) -> str:
    """`0.96 (per batch 0.95-0.97, 4 batches)`: the figure to the digits its spread supports."""
    if len(values) < 2:
        return f"{value:.2f} (one batch: no spread)"
    lo, hi = min(values), max(values)
    d = decimals_for((hi - lo) / 2)
    return f"{value:.{d}f} (per batch {lo:.{d}f}-{hi:.{d}f}, {len(values)} batches)"


def noise_warning(
    speedups: list[float], cost_spread: float, other_cores: float, cores: int, cpu: bool, threads: int
) -> Optional[str]:
    """One line when the timings should not be trusted as they are, else None."""
    why = []
    if cost_spread > WIDE_SPREAD:
        why.append(
            f"a round's cost varied {cost_spread:.0%} between batches (per-batch speedup "
            f"{min(speedups):.2f}-{max(speedups):.2f})"
        )
    if cpu and other_cores > LOADED_CORES:
        why.append(f"other processes kept {other_cores:.1f} of this host's {cores} CPU cores busy")
    if not why:
        return None
    if not cpu:
        fix = "rerun on a quiet GPU"
    elif threads > 1:
        fix = f"rerun with OMP_NUM_THREADS=1 (torch used {threads} threads) on a shared CPU, or on a GPU"
    else:
        fix = "rerun on a quieter host, or on a GPU"
    return f"WARNING: noisy timings: {'; '.join(why)}; {fix}"
