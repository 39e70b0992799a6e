"""MLflow tracking: one experiment per experiment name, one run per job, nothing left RUNNING.

The store defaults to SQLite under outputs/ (`sqlite:///<repo>/outputs/mlflow.db`) with artifacts in
`outputs/mlartifacts/<experiment>`. Everything goes through an explicit `MlflowClient` (no global
fluent state), so tests can point a tracker at a temporary store.

    with Tracker(cfg, outputs) as t:     # creates the run; params = flattened config; tags = git, device, torch
        t.log_metrics({...}); t.log_text(text, "results.jsonl")
    # leaving the block: FINISHED, or FAILED when an exception escapes (the exception propagates)
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.config import RunConfig, flatten, to_yaml
from pipeline.paths import PARENT_ENV, REPO
from stages.base import device_name

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value


def default_tracking_uri(outputs: Path) -> str:
    return f"sqlite:///{outputs / 'mlflow.db'}"


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:  # not a checkout (e.g. a copied tree)
            return os.environ.get("SPECPIPE_GIT_SHA", "unknown")
        sha = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fail_sweep_parent(tracking_uri: Optional[str], outputs: Path) -> None:
    """A sweep's job failed before a run of its own began (a plan error): the sweep stops there, so its
    parent run is FAILED rather than left RUNNING. A no-op outside a sweep."""
    run_id = os.environ.get(PARENT_ENV)
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=tracking_uri or default_tracking_uri(outputs)).set_terminated(run_id, status="FAILED")


class Tracker:
    def __init__(self, cfg: RunConfig, outputs: Path, device: torch.device):
        from mlflow.tracking import MlflowClient

        t = cfg.tracking
        outputs.mkdir(parents=True, exist_ok=True)
        self.uri = t.tracking_uri or default_tracking_uri(outputs)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.cfg, self.device = cfg, device
        self.artifact_root = Path(t.artifact_root or outputs / "mlartifacts")
        self.run_id: Optional[str] = None

    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = (self.artifact_root / name).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def __enter__(self) -> "Tracker":
        from mlflow.entities import RunTag

        cfg = self.cfg
        run = self.client.create_run(self.experiment_id(cfg.experiment_name), run_name=cfg.tracking.run_name)
        self.run_id = run.info.run_id
        try:
            params = flatten(cfg)
            keys = list(params)
            for i in range(0, len(keys), 100):
                self.log_params({k: params[k] for k in keys[i : i + 100]})
            tags = {"git_sha": git_sha(), "device": device_name(self.device), "torch_version": torch.__version__}
            if os.environ.get(PARENT_ENV):  # a job of a Hydra sweep: nest under the sweep's run
                tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self.log_text(to_yaml(cfg), "config.yaml")
        except BaseException:
            self.client.set_terminated(self.run_id, status="FAILED")
            raise
        print(f"[mlflow] run {self.run_id} in experiment {cfg.experiment_name!r} ({self.uri})", flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "FINISHED" if exc_type is None else "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
        if exc_type and os.environ.get(PARENT_ENV):  # the sweep stops here: its parent run ends so too
            self.client.set_terminated(os.environ[PARENT_ENV], status=status)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()])

    def log_metrics(self, metrics: dict[str, Any], step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / artifact_file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(self.run_id, str(path), None if parent == "." else parent)
