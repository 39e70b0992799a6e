"""Run a validated plan: each stage gets exactly what it requires and must return what it provides.

The MLflow run opens only after the plan has validated (a bad config leaves no run behind) and is
marked FAILED if any stage raises. Under torchrun the stages run inside the process group
(engine/train/distributed.py) and only rank 0 tracks and prints: the other ranks run with tracking off
and their stdout muted.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from engine.train import distributed
from pipeline.plan import Plan
from pipeline.tracking import Tracker


def execute(plan: Plan) -> dict[str, Any]:
    cfg, env = plan.cfg, plan.env
    torch.manual_seed(cfg.seed)
    tracked = cfg.tracking.enabled and distributed.launch().rank == 0
    tracker = Tracker(cfg, env.outputs_dir, env.device) if tracked else None
    context: dict[str, Any] = {}
    group = distributed.process_group(env.device)
    with group, distributed.quiet_unless_main(), tracker if tracker is not None else contextlib.nullcontext():
        env.tracker = tracker
        for stage in plan.stages:
            t0 = time.perf_counter()
            out = stage.run(cfg, stage.inputs(context), env)
            if set(out) != set(stage.provides):
                raise RuntimeError(f"stage {stage.name!r} returned {sorted(out)}, declared {sorted(stage.provides)}")
            context.update(out)
            if tracker is not None:
                tracker.log_metrics({f"stage_s.{stage.name}": time.perf_counter() - t0})
    return context
