"""Running the pipeline as a user does (a composed config, the CLI in a subprocess) and reading what
its runs left in the MLflow store."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from pipeline.paths import REPO


def cli(
    *args: str, outputs: Path, module: str = "pipeline", timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m <module> *args` from the repository, as a user types it, writing under `outputs`
    (SPECPIPE_OUTPUTS; `env`: more variables); its exit code and output to assert on."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "SPECPIPE_OUTPUTS": str(outputs), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def benchmark_module(name: str):
    """benchmarks/<name>.py imported by path (the folder is no package and stays off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def parent_and_children(outputs: Path, experiment: str):
    """A sweep's MLflow runs in the store under `outputs`: (its one parent, its children in job order);
    every run of the experiment is one of them, and every child names that parent."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if "sweep.overrides" in r.data.tags]
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.data.tags["sweep.job"])
    assert len(runs) == 1 + len(children)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    return parent, children


def compose_cfg(*overrides: str) -> DictConfig:
    # initialize_config_dir, as the pipeline composes: `initialize(config_path=...)` walks the caller's stack
    # (inspect.stack reads the source of every pytest frame), 0.4 s a call under pytest
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return compose(config_name="config", overrides=list(overrides))


def client(outputs: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")


def runs_of(outputs: Path, experiment: str):
    c = client(outputs)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id])


def download_text(outputs: Path, run_id: str, name: str) -> str:
    return Path(client(outputs).download_artifacts(run_id, name, str(outputs / "dl"))).read_text()


def metric_history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
