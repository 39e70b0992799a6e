"""Where runs write: `<repo>/outputs` unless SPECPIPE_OUTPUTS names another directory."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARENT_ENV = "SPECPIPE_PARENT_RUN_ID"  # set for the jobs of a Hydra sweep: the parent MLflow run


def outputs_dir() -> Path:
    return Path(os.environ.get("SPECPIPE_OUTPUTS", REPO / "outputs")).expanduser().resolve()
