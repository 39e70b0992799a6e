"""The Hydra run folder's `pipeline.log`: what the run printed, and no folder for a run that never ran.

    with RunLog(folder):     # stdout and stderr also go to folder/pipeline.log, line by line; a progress
        ...                  # bar's redraws (\r) collapse into the bar's last state
    drop_run_folder(folder)  # a dry run or a plan that failed: Hydra's files and the log go, then the
                             # folder and its empty parents; a folder holding anything else stays

Hydra's own log records reach the same file through its FileHandler (both append).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, Optional

LOG_NAME = "pipeline.log"


class _Tee:
    """A text stream that writes through to `stream` and hands each finished line to `sink`."""

    def __init__(self, stream: IO, sink: IO):
        self.stream, self.sink, self.pending = stream, sink, ""

    def write(self, s: str) -> int:
        n = self.stream.write(s)
        *lines, rest = (self.pending + s).split("\n")
        for line in lines:
            self._line(line)
        self.pending = rest[rest.rfind("\r") :] if "\r" in rest else rest  # a bar's last frame is enough
        return n

    def _line(self, line: str) -> None:
        line = line.rstrip("\r").rsplit("\r", 1)[-1].rstrip()  # a bar's redraws: its last state
        if line:
            self.sink.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()
        self.sink.flush()

    def close_line(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = ""

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...: the stream's
        return getattr(self.stream, name)


class RunLog:
    def __init__(self, folder: Optional[Path]):
        self.path = folder / LOG_NAME if folder is not None else None
        self._file: Optional[IO] = None

    def __enter__(self) -> "RunLog":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)
        return self

    def __exit__(self, *exc) -> None:
        if self._file is None:
            return
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee):
                tee.close_line()
        sys.stdout, sys.stderr = self._saved
        self._file.close()
        self._file = None


def drop_run_folder(folder: Optional[Path], stop_at: Path) -> None:
    """Remove what Hydra and RunLog wrote in `folder` (.hydra/*.yaml, pipeline.log), then the folder and
    its parents below `stop_at` while they are empty. Anything else in them is left as it is."""
    if folder is None:
        return
    hydra_dir = folder / ".hydra"
    if hydra_dir.is_dir():
        for f in hydra_dir.iterdir():
            if f.suffix == ".yaml":
                f.unlink()
    (folder / LOG_NAME).unlink(missing_ok=True)
    parents = [d for d in folder.parents if stop_at in d.parents]  # up to stop_at, not past it
    for d in (hydra_dir, folder, *parents):
        try:
            d.rmdir()  # only when empty
        except OSError:
            break
