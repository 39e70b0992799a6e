"""Where runs write: `<repo>/outputs` unless SPECPIPE_OUTPUTS names another directory."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import ConfigError
from schema import REPO  # noqa: F401  (the repository root)

PARENT_ENV = "SPECPIPE_PARENT_RUN_ID"  # set for the jobs of a Hydra sweep: the parent MLflow run


def outputs_dir() -> Path:
    return Path(os.environ.get("SPECPIPE_OUTPUTS", REPO / "outputs")).expanduser().resolve()


def outputs_problem(path: Path) -> str | None:
    """Why runs cannot write under `path` (None: they can): a file in the way (the folder itself or a
    parent), or a folder (or its nearest existing parent) this process may not write to (a read-only
    mount). A folder that does not exist yet is created here, as every run would."""
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"is below a file ({existing})"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing} is read-only for this user)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # what the permission bits do not say (root under /proc, a full or odd mount)
        return f"cannot be created ({e.strerror})"
    return None


def outputs_error(outputs: Path) -> ConfigError | None:
    """The error for an outputs folder runs cannot write to (weights cache, MLflow store, Hydra's run
    directories, training outputs), or None."""
    if os.environ.get("SPECPIPE_OUTPUTS", "unset").strip() == "":  # Hydra would write under /runs
        return ConfigError("SPECPIPE_OUTPUTS", "", "set but empty", "a directory, or unset for <repo>/outputs")
    if (problem := outputs_problem(outputs)) is None:
        return None
    return ConfigError(
        "SPECPIPE_OUTPUTS",
        str(outputs),
        f"the outputs folder {problem}",
        "a writable directory (set SPECPIPE_OUTPUTS to one)",
    )
