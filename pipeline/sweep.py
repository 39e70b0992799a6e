"""A parent MLflow run per Hydra sweep (`python -m pipeline -m ...`).

Hydra calls `on_multirun_start` once before the jobs: we open a parent run in the sweep's experiment
(tagged with the sweep's overrides) and hand its id to the jobs through SPECPIPE_PARENT_RUN_ID; each
job's Tracker tags its run `mlflow.parentRunId`, so the MLflow UI nests the jobs under the sweep.
`on_multirun_end` closes the parent FINISHED; a job that fails marks it FAILED itself (Hydra stops the
sweep there and does not call on_multirun_end).
"""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.paths import PARENT_ENV


class SweepParentRun(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        from pipeline.config import to_run_config
        from pipeline.paths import outputs_dir
        from pipeline.tracking import Tracker

        cfg = to_run_config(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
        if not cfg.tracking.enabled:
            return
        tracker = Tracker(cfg, outputs_dir(), device=None)
        client: MlflowClient = tracker.client
        overrides = " ".join(config.hydra.overrides.task)
        run = client.create_run(
            tracker.experiment_id(cfg.experiment_name),
            run_name=f"sweep: {overrides}"[:250],
            tags={"sweep.overrides": overrides},
        )
        os.environ[PARENT_ENV] = run.info.run_id
        self.client, self.run_id = client, run.info.run_id
        print(f"[mlflow] sweep parent run {run.info.run_id} ({overrides})", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_id = getattr(self, "run_id", None)
        if run_id and self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, status="FINISHED")
        os.environ.pop(PARENT_ENV, None)
