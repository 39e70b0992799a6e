"""Where a round's time goes, without stalling the stream to find out.

A speculative round has one device->host sync it cannot do without: the verify's emitted tokens
(`.tolist()`). Timing the draft by `torch.cuda.synchronize()` around it costs two more a round
(after the proposal and after the draft extend) that the no-draft baseline never pays: the host
cannot enqueue the verify while the draft runs, and the device idles while the host walks the rows.

Here a phase boundary is a mark: a CUDA event recorded on the current stream (a `perf_counter()`
reading on CPU). `span(key, start, end)` queues a phase; `settle()` reads every queued span and must
only be called right after a sync that came after their end marks (the round's own `.tolist()`), so
reading never waits. A span recorded after that sync (the draft extend, which follows it) waits for
the next round's. `totals()` settles what is still queued (a sync at the end of generation, free).

A span is stream time: from the stream reaching one mark to reaching the next, idle gaps included,
which is the phase's share of the wall clock when the device is the bottleneck.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Union

import torch

Mark = Union[float, torch.cuda.Event]


class PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)  # key -> settled seconds
        self._queued: list[tuple[str, Mark, Mark]] = []
        self._free: list[torch.cuda.Event] = []  # events whose spans were read: recorded again

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, key: str, start: Mark, end: Mark) -> None:
        self._queued.append((key, start, end))

    def settle(self, keep: tuple = ()) -> None:
        """Read the queued spans: call only after a sync that followed their end marks. `keep`: marks
        a later span still starts from (not recycled)."""
        read = {}  # id -> event: one span's end is often the next one's start
        for key, start, end in self._queued:
            if self.cuda:
                self.seconds[key] += start.elapsed_time(end) / 1e3  # ms -> s
                read.update({id(start): start, id(end): end})
            else:
                self.seconds[key] += end - start
        held = {id(m) for m in keep}
        self._free += [e for i, e in read.items() if i not in held]
        self._queued.clear()

    def totals(self) -> dict[str, float]:
        """Every span so far, the queued ones included (waits for the last of them)."""
        if self._queued and self.cuda:
            self._queued[-1][2].synchronize()  # marks are recorded in stream order: the last ends last
        self.settle()
        return dict(self.seconds)

    def reset(self) -> None:
        self.totals()  # recycles the queued events
        self.seconds.clear()
