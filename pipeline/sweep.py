"""Hydra sweeps (`python -m pipeline -m ...`): a parent MLflow run, a summary of the jobs, a GPU per worker.

Hydra calls `on_multirun_start` once before the jobs: we open a parent run in the sweep's experiment
(tagged with the sweep's overrides) and hand its id to the jobs through SPECPIPE_PARENT_RUN_ID (the
environment, so joblib workers and submitit jobs inherit it); each job's Tracker tags its run
`mlflow.parentRunId` (and `sweep.job`, its number), so the MLflow UI nests the jobs under the sweep.
`on_multirun_end` prints a summary of the child runs (the table of `python -m pipeline.compare`),
writes it as compare.csv / compare.md / compare.png to the sweep's folder, logs those on the parent
run and closes it FINISHED; a job that fails marks the parent FAILED itself (Hydra stops the sweep
there and does not call on_multirun_end). Any launcher and sweeper works (basic, joblib, submitit,
Optuna): the callbacks run in the process that launches the jobs.

One GPU per parallel job (`hydra/launcher=joblib`): `on_job_start` runs in the joblib worker, before
the job touches CUDA; the worker takes the first GPU whose lock file it can flock (one per visible
GPU, per host and user, in the temp folder) and sets CUDA_VISIBLE_DEVICES to it for the rest of its
life (a reused worker keeps its GPU: CUDA reads the variable once per process). With
`hydra.launcher.n_jobs` <= the GPUs, concurrent jobs never share one; the locks die with the workers.
The GPUs are CUDA_VISIBLE_DEVICES's list when the sweep sets it, else NVML's count (nvidia-ml-py);
one GPU or none: nothing to do.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.paths import PARENT_ENV
from pipeline.signals import deferred, forward_to_workers
from pipeline.store import owner_tags, reap_dead_runs

_PINNED: Optional[tuple[str, IO]] = None  # this process's GPU and its held lock file
ACTIVE: list["SweepParentRun"] = []  # the sweep this process launches (between its start and its end)


def visible_gpus() -> list[str]:
    """The GPU ids a job may take, without initialising CUDA (which would fix the visible set)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, or no driver: no GPUs to share out
        return []


def pin_one_gpu(lock_dir: Optional[Path] = None) -> Optional[str]:
    """Set CUDA_VISIBLE_DEVICES to one GPU no other worker holds -> its id (None: fewer than 2 GPUs,
    or CUDA already initialised here). Raises when every GPU is held (more parallel jobs than GPUs)."""
    global _PINNED
    if _PINNED is not None:
        return _PINNED[0]
    import torch

    gpus = visible_gpus()
    if len(gpus) < 2 or torch.cuda.is_initialized():
        return None
    lock_dir = lock_dir or Path(tempfile.gettempdir()) / f"specpipe-gpus-{os.getuid()}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    for gpu in gpus:
        f = open(lock_dir / f"gpu-{gpu}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        _PINNED = (gpu, f)
        return gpu
    raise RuntimeError(
        f"hydra.launcher.n_jobs: every GPU ({','.join(gpus)}) is held by another job's worker "
        f"(locks in {lock_dir}); set hydra.launcher.n_jobs <= {len(gpus)}"
    )


def sweep_summary(client, parent_id: str, experiment_id: str, folder: Optional[Path]) -> Optional[str]:
    """The child runs of a sweep side by side -> the printed text (None: no child run); with `folder`,
    compare.csv / .md / .png written there and logged on the parent run."""
    from pipeline.compare import Comparison

    runs = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    if not runs:
        return None
    runs.sort(key=lambda r: (int(r.data.tags.get("sweep.job", "0")), r.info.start_time))
    name = client.get_experiment(experiment_id).name
    cmp = Comparison.from_runs(f"sweep of {name!r}", runs, [name] * len(runs))  # labelled by the swept values
    text = cmp.text()
    if folder is not None:
        paths = cmp.write(folder)
        for p in paths:
            client.log_artifact(parent_id, str(p))
        text += f"\nsummary: {', '.join(p.name for p in paths)} in {folder} (and on the parent run)"
    return text


class SweepParentRun(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        from pipeline.config import to_run_config
        from pipeline.paths import outputs_dir
        from pipeline.tracking import Tracker

        cfg = to_run_config(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
        if not cfg.tracking.enabled:
            return
        overrides = " ".join(config.hydra.overrides.task)
        try:  # Hydra turns a callback's exception into a warning: a sweep without its parent run stops here
            tracker = Tracker(cfg, outputs_dir(), device=None)
            client: MlflowClient = tracker.client
            reap_dead_runs(client)
            self.experiment_id = tracker.experiment_id(cfg.experiment_name)
            with deferred():
                run = client.create_run(
                    self.experiment_id,
                    run_name=f"sweep: {overrides}"[:250],
                    tags={"sweep.overrides": overrides, **owner_tags()},
                )
                os.environ[PARENT_ENV] = run.info.run_id
                self.client, self.run_id = client, run.info.run_id
        except Exception as e:
            print(
                f"error: the sweep's parent MLflow run could not be created: {type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2) from None
        ACTIVE.append(self)
        if str(OmegaConf.select(config, "hydra.launcher._target_") or "").endswith("JoblibLauncher"):
            forward_to_workers(lambda: not self.running_children())  # before joblib tears the workers down
        print(f"[mlflow] sweep parent run {run.info.run_id} ({overrides})", flush=True)

    def running_children(self) -> list:
        return self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}' and attributes.status = 'RUNNING'",
        )

    def stopped(self) -> int:
        """A signal stopped the sweep: its parent run and every child still RUNNING (a job cut down in a
        worker before it could say so) marked KILLED -> how many children."""
        children = self.running_children()
        for r in children:
            self.client.set_terminated(r.info.run_id, status="KILLED")
        self.client.set_terminated(self.run_id, status="KILLED")
        return len(children)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_id = getattr(self, "run_id", None)
        os.environ.pop(PARENT_ENV, None)
        if not run_id:
            return
        ACTIVE.remove(self)
        try:
            folder = OmegaConf.select(config, "hydra.sweep.dir")
            text = sweep_summary(self.client, run_id, self.experiment_id, Path(folder) if folder else None)
            print(text or f"[mlflow] sweep parent run {run_id}: no job logged a run", flush=True)
        except Exception as e:  # the jobs' runs are in the store whatever the summary does
            print(f"[mlflow] sweep summary failed: {type(e).__name__}: {e}", flush=True)
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, status="FINISHED")


class GpuPerWorker(Callback):
    """Under the joblib launcher, pins each worker process to its own GPU (module docstring)."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if str(OmegaConf.select(config, "hydra.launcher._target_") or "").endswith("JoblibLauncher"):
            gpu = pin_one_gpu()
            if gpu is not None:
                print(f"[sweep] job {config.hydra.job.num} on GPU {gpu} (worker pid {os.getpid()})", flush=True)
