"""Where runs write: `<repo>/outputs` unless SPECPIPE_OUTPUTS names another directory."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARENT_ENV = "SPECPIPE_PARENT_RUN_ID"  # set for the jobs of a Hydra sweep: the parent MLflow run


def outputs_dir() -> Path:
    return Path(os.environ.get("SPECPIPE_OUTPUTS", REPO / "outputs")).expanduser().resolve()


def outputs_problem(path: Path) -> str | None:
    """Why runs cannot write under `path` (None: they can): a file in the way, or a folder (or its
    nearest existing parent) this process may not write to (a read-only mount)."""
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing} is read-only for this user)"
    return None
