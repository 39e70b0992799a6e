"""MLflow tracking: one experiment per experiment name, one run per job, nothing left RUNNING.

The store defaults to SQLite under outputs/ (`sqlite:///<repo>/outputs/mlflow.db`) with artifacts in
`outputs/mlartifacts/<experiment>`. Everything goes through an explicit `MlflowClient` (no global
fluent state), so tests can point a tracker at a temporary store.

    with Tracker(cfg, outputs) as t:     # creates the run; params = flattened config; tags = git, device, torch
        t.log_metrics({...}); t.log_text(text, "results.jsonl"); t.log_figures(metrics)
    # leaving the block: FINISHED, or FAILED when an exception escapes (the exception propagates)

System metrics (`tracking.system_metrics`, on by default where psutil imports): MLflow's own
`SystemMetricsMonitor` samples CPU, memory, disk, network (and GPUs through nvidia-ml-py) on a thread
every `tracking.system_metrics_interval_s` as `system/*` metrics; leaving the block takes one last
sample, so a run shorter than the interval still has its row.

The store is opened through pipeline/store.py (created or upgraded under a lock, runs of dead processes
reaped); each run is created with tags naming its process, and between its creation and the tracker
holding its id no signal can land (pipeline/signals.py): a stopped run always ends KILLED.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import torch

from engine.errors import ConfigError, check_values, raised
from pipeline.config import flatten, to_yaml
from pipeline.paths import PARENT_ENV, REPO, outputs_problem
from pipeline.signals import deferred
from pipeline.store import StoreError, open_store, owner_tags, reap_dead_runs, store_problem
from schema import RunConfig
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


def psutil_present() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def system_metrics_on(t) -> bool:
    """`tracking.system_metrics`: null follows psutil; true without psutil is a config error."""
    interval = t.system_metrics_interval_s
    check_values([("tracking.system_metrics_interval_s", interval, interval > 0, "> 0 (seconds)")])
    check_values(
        [
            (
                "tracking.system_metrics",
                t.system_metrics,
                not t.system_metrics or psutil_present(),
                "false or null (or pip install psutil)",
                "psutil is not installed",
            )
        ]
    )
    return psutil_present() if t.system_metrics is None else t.system_metrics


def tracking_errors(cfg: RunConfig, outputs: Path) -> list[ConfigError]:
    """Plan time: a store runs cannot log to (a URI MLflow has no store for, a file that is not a
    database, a server that does not answer), an artifact root that cannot be written, bad system
    metrics settings. Nothing is created."""
    t = cfg.tracking
    if not t.enabled:
        return []
    errors = raised(system_metrics_on, t)
    uri = t.tracking_uri or default_tracking_uri(outputs)
    if (problem := store_problem(uri)) is not None:
        errors.append(
            ConfigError("tracking.tracking_uri", uri, problem, "sqlite:///<path>, http(s)://<server>, or tracking=off")
        )
    root = t.artifact_root
    if root and urlparse(root).scheme in ("", "file") and (bad := outputs_problem(Path(urlparse(root).path))):
        errors.append(ConfigError("tracking.artifact_root", root, f"the folder {bad}", "a writable directory"))
    return errors


def redacted(cfg: RunConfig) -> RunConfig:
    """`cfg` with its secrets (serve.api_key) masked: what MLflow may keep."""
    if cfg.serve.api_key is None:
        return cfg
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, api_key="***"))


def sweep_job_tags() -> dict[str, str]:
    """A sweep job's number and overrides (from Hydra's job config, set in whatever process runs the job)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return {}
        job = HydraConfig.get().job
        return {"sweep.job": str(job.num), "sweep.job_overrides": " ".join(HydraConfig.get().overrides.task)[:5000]}
    except Exception:  # not under Hydra's job runner (tests composing configs)
        return {}


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
        t = cfg.tracking
        outputs.mkdir(parents=True, exist_ok=True)
        self.uri = t.tracking_uri or default_tracking_uri(outputs)
        self.client = open_store(self.uri)
        self.cfg, self.device = cfg, device
        self.artifact_root = Path(t.artifact_root or outputs / "mlartifacts")
        self.run_id: Optional[str] = None
        self.system_metrics = system_metrics_on(t)
        self._monitor = None

    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None and exp.lifecycle_stage == "deleted":  # MLflow refuses runs in it, and keeps the name
            raise StoreError(
                f"the experiment {name!r} (id {exp.experiment_id}) is deleted in {self.uri}: restore it "
                f"(MLFLOW_TRACKING_URI={self.uri} mlflow experiments restore --experiment-id {exp.experiment_id}) "
                "or run under another experiment_name"
            )
        if exp is not None:
            return exp.experiment_id
        location = (self.artifact_root / name).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def __enter__(self) -> "Tracker":
        from mlflow.entities import RunTag

        cfg = self.cfg
        reap_dead_runs(self.client)
        experiment = self.experiment_id(cfg.experiment_name)
        with deferred():  # a signal lands before or after this, never between the run and its id
            run = self.client.create_run(experiment, run_name=cfg.tracking.run_name, tags=owner_tags())
            self.run_id = run.info.run_id
        try:
            params = flatten(redacted(cfg))
            keys = list(params)
            for i in range(0, len(keys), 100):
                self.log_params({k: params[k] for k in keys[i : i + 100]})
            tags = {"git_sha": git_sha(), "device": device_name(self.device), "torch_version": torch.__version__}
            if os.environ.get(PARENT_ENV):  # a job of a Hydra sweep: nest under the sweep's run
                tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
                tags.update(sweep_job_tags())
            if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:  # which GPU a parallel sweep job got
                tags["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self.log_text(to_yaml(redacted(cfg)), "config.yaml")
            if self.system_metrics:
                self._start_system_metrics()
        except BaseException as e:
            self.client.set_terminated(self.run_id, status="KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
        print(f"[mlflow] run {self.run_id} in experiment {cfg.experiment_name!r} ({self.uri})", flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "FINISHED" if exc_type is None else "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        with deferred():  # a first signal now is raised once the run is marked (FINISHED: the work was done)
            self._stop_system_metrics()
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

    @property
    def artifact_dir(self) -> str:
        """Where this run's artifacts are (a local path for the file store, else the URI)."""
        from urllib.parse import unquote, urlparse

        uri = self.client.get_run(self.run_id).info.artifact_uri
        parsed = urlparse(uri)
        return unquote(parsed.path) if parsed.scheme == "file" else uri

    def log_figures(self, metrics: dict[str, float]) -> list[str]:
        """The run's figures (pipeline.figures: those its metrics have data for) as PNG artifacts under
        `figures/` -> their artifact paths."""
        from pipeline.figures import write_run_figures

        with tempfile.TemporaryDirectory() as d:
            paths = write_run_figures(metrics, Path(d), self.figure_title(metrics))
            for p in paths:
                self.client.log_artifact(self.run_id, str(p), "figures")
        return [f"figures/{p.name}" for p in paths]

    def figure_title(self, metrics: dict[str, float]) -> str:
        """`run gaudy-gull-550 (eagle3) | mt_bench x4 | cpu (x86_64) | 2026-11-27 01:05`: what a figure shows."""
        import time

        e = self.cfg.eval
        dataset = Path(e.dataset).parent.name if e.dataset.endswith(".jsonl") else e.dataset  # a file: its folder
        run = self.client.get_run(self.run_id).info.run_name
        prompts = f" x{int(metrics['num_prompts'])}" if "num_prompts" in metrics else ""
        when = time.strftime("%Y-%m-%d %H:%M")
        return f"run {run} ({self.cfg.experiment_name}) | {dataset}{prompts} | {device_name(self.device)} | {when}"

    def _start_system_metrics(self) -> None:
        import logging

        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not two INFO lines a run

        self._monitor = SystemMetricsMonitor(
            self.run_id, sampling_interval=self.cfg.tracking.system_metrics_interval_s, tracking_uri=self.uri
        )
        self._monitor.start()

    def _stop_system_metrics(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        monitor.finish()  # joins the sampling thread
        try:  # one last sample, so a run shorter than the interval still has its system metrics
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as e:  # never fail a finished run over its system metrics
            print(f"[mlflow] system metrics: last sample not logged ({e})", flush=True)
