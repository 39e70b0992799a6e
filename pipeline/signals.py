"""Stopping: SIGINT (Ctrl-C) and SIGTERM (docker stop, Kubernetes, SLURM, `timeout`) end a run the same way.

    install()              in each process that runs jobs (the main one, a joblib worker)
    with deferred(): ...   a first signal arriving inside is raised when the block ends
    exit 128 + signum      130 for SIGINT, 143 for SIGTERM; describe(signum): the one line that says so

The first signal raises `Interrupted`, a KeyboardInterrupt, so every cleanup written for Ctrl-C runs:
the eval keeps its finished prompts, the tracker marks the run (and a sweep's parent) KILLED. A second
signal is not raised: the cleanup cannot be cut short and leave a run RUNNING; it prints one line, and a
third exits at once (the next run on the store marks what it left KILLED: pipeline/store.py). The server
(engine/serve/http.py) installs its own handlers while it serves: the first signal drains it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WORDS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


SAME_STOP_S = 0.5  # a repeat this soon is the same stop (sent to the process group and forwarded to it)

_received: list[int] = []  # signals since install(), in order (repeats within SAME_STOP_S left out)
_last = 0.0
_defer = 0  # depth of deferred() blocks
_pending: Optional[int] = None  # a first signal that arrived inside deferred()
_forward: Optional[Callable[[], bool]] = None  # a joblib sweep's launcher: True once its workers' jobs ended
FORWARD_WAIT_S = 60.0  # how long a launcher waits for its workers' jobs to end after a signal


def _children() -> list[int]:
    """This process's child processes (Linux /proc)."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                out.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return out


def _handle(signum: int, frame) -> None:
    global _pending, _last
    now = time.monotonic()
    if _received and now - _last < SAME_STOP_S:
        return
    _received.append(signum)
    _last = now
    if len(_received) == 1:
        if _forward is not None:  # the workers end their jobs as any run ends, then joblib's wait is cut
            for pid in _children():
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
            deadline = now + FORWARD_WAIT_S
            while not _forward() and time.monotonic() < deadline:
                time.sleep(0.2)
        if _defer:
            _pending = signum
            return
        raise Interrupted(signum)
    if len(_received) == 2:
        print(
            f"\n[stop] {WORDS[signum]} again: still marking the run KILLED and keeping its results "
            "(a third one exits at once)",
            file=sys.stderr,
            flush=True,
        )
        return
    print(f"[stop] {WORDS[signum]} a third time: exiting now", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def install() -> None:
    """SIGINT and SIGTERM raise `Interrupted` (the first one; see the module docstring). Only the main
    thread can set handlers; elsewhere (a test's thread, an embedding) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not _handle:
            signal.signal(s, _handle)


def forward_to_workers(ended: Callable[[], bool]) -> None:
    """This process launches jobs in worker processes (joblib): a first signal goes on to them and is
    raised here once `ended()` (or after FORWARD_WAIT_S), so each job ends the way a run ends (results
    kept, KILLED) before joblib tears its worker down."""
    global _forward
    _forward = ended


def received() -> bool:
    return bool(_received)


def first() -> int:
    """The signal that stops this process (SIGINT when none was received: a KeyboardInterrupt of Python's own)."""
    return _received[0] if _received else signal.SIGINT


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block a first signal may not cut in two (a run created and its id kept): raised at its end."""
    global _defer, _pending
    _defer += 1
    try:
        yield
    finally:
        _defer -= 1
        if _defer == 0 and _pending is not None:
            signum, _pending = _pending, None
            raise Interrupted(signum)


def signum_of(e: BaseException) -> int:
    return getattr(e, "signum", first())


def describe(signum: int) -> str:
    """`interrupted (Ctrl-C)` / `terminated (SIGTERM)`: the last line of a stopped run."""
    return f"{'interrupted' if signum == signal.SIGINT else 'terminated'} ({WORDS.get(signum, signum)})"
