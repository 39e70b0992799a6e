"""`python -m pipeline [+experiment=NAME] [overrides...] [-m]`: compose, plan, validate, run, track.

A bad config is reported as one message naming each bad key, its value and what is valid, with exit
status 2; nothing has been loaded and no MLflow run exists at that point. A sweep checks every job so
before the first runs; a job that fails a check only it can make (its memory on its GPU) marks the
sweep's parent run FAILED, and the sweep stops there. A job returns the eval's
`tokens_per_s` (None for other tasks): the objective a sweeper such as Optuna maximises. What a job
prints also goes to its Hydra run folder's pipeline.log (pipeline/runlog.py); a dry run or a plan that
fails leaves no folder. `--help`: the tool, its groups and experiments (pipeline/help.py).

Ctrl-C and SIGTERM (pipeline/signals.py) end a run or a sweep alike: what finished is kept, the run (a
sweep's parent and its unfinished jobs, in whichever worker) KILLED, one line, exit 130 / 143; while
the command line is checked, with nothing run yet, the same line and exit.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from engine.errors import ConfigError, PlanError
from pipeline.compose_check import (
    compose_problems,
    composed,
    group_origin,
    is_hydras,
    parse_problems,
    sweep_jobs,
)
from pipeline.config import register_configs, to_run_config
from pipeline.paths import PARENT_ENV, outputs_dir, outputs_error
from pipeline.runlog import RunLog, drop_run_folder
from pipeline.signals import Interrupted, deferred, describe, first, install, received, signum_of

log = logging.getLogger("pipeline")
SHOW_CHECKS = 16  # a sweep of this many jobs shows a progress bar while they are checked (about 0.1 s each)


def plan_job(cfg: DictConfig):
    """Compose -> a validated Plan, printed (raises PlanError / ConfigError: nothing ran)."""
    # torch, the stages and the server stack load here: a bad override is reported before any of them
    from engine.train.distributed import launch
    from pipeline.plan import build_plan

    plan = build_plan(to_run_config(cfg), origin=group_origin("graph"))
    plan.env.command = job_overrides()
    if launch().rank == 0:  # under torchrun: one plan printed, not one per process
        print(plan.describe(), flush=True)
    return plan


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable from tests with a composed config."""
    from pipeline.execute import execute

    plan = plan_job(cfg)
    return {} if plan.cfg.dry_run else execute(plan)


def objective(ctx: dict) -> Optional[float]:
    """What a sweeper optimises (hydra/sweeper=optuna_tokens_per_s): the eval's tokens/s, or None."""
    return ctx.get("eval_results", {}).get("metrics", {}).get("tokens_per_s")


def job_folder() -> Optional[Path]:
    """This job's Hydra output folder (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def job_overrides() -> Optional[list[str]]:
    """This job's command-line overrides (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    from pipeline.execute import execute
    from pipeline.store import StoreError

    install()  # this process runs the job: the main one, or a joblib worker
    folder, plan = job_folder(), None
    with RunLog(folder):  # the folder's pipeline.log: the plan, progress lines, the summary
        try:
            if received():  # a worker whose last job was stopped: the sweep is ending, start no other
                raise Interrupted(first())
            plan = plan_job(cfg)
            if plan.cfg.dry_run:  # nothing ran: no run folder
                drop_run_folder(folder, outputs_dir())
                return None
            return objective(execute(plan))
        except (PlanError, ConfigError, StoreError) as e:
            from pipeline.tracking import fail_sweep_parent

            if plan is None:
                drop_run_folder(folder, outputs_dir())
            print(f"error: {e}", file=sys.stderr, flush=True)
            fail_sweep_parent(OmegaConf.select(cfg, "tracking.tracking_uri"), outputs_dir())
            sys.exit(2)
        except KeyboardInterrupt as e:  # the stage said what it kept; the MLflow run is KILLED
            if not os.environ.get(PARENT_ENV):  # a sweep says it once, in the process that launched it
                print(describe(signum_of(e)), file=sys.stderr, flush=True)
            sys.exit(128 + signum_of(e))
        finally:
            plan = None
            release_device_memory()


def release_device_memory() -> None:
    """The job's tensors and graph pools back to the driver: a sequential sweep runs every job in this
    process, and an 8B target's next job would not fit beside the last one's cached blocks."""
    import gc

    import torch

    gc.collect()  # graphs, caches and heads held in reference cycles, with their private pools
    if torch.cuda.is_initialized():
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps 32 MiB per stream it ran on (each capture's)
        torch.cuda.empty_cache()


def plan_problems(overrides: Optional[list[str]], check_memory: bool = True) -> list:
    """What the plan finds wrong in the config `overrides` compose to (beside composition errors);
    check_memory: whether the run's memory estimate is checked against this process's device."""
    if overrides is None:
        return []
    from pipeline.plan import build_plan

    try:
        build_plan(to_run_config(composed(tuple(overrides))), check_memory=check_memory)
    except PlanError as e:
        return e.errors
    except ConfigError as e:
        return [e]
    return []


def run_problems(overrides: list[str]) -> list[ConfigError]:
    """A single run's composition errors, and then what the plan finds in the overrides that compose (with
    none, the run plans itself). A signal meanwhile waits for the end, as in a sweep's checks."""
    with deferred():
        problems, good = compose_problems([o for o in overrides if not is_hydras(o)])
        return problems + plan_problems(good) if problems else []


def sweep_problems(overrides: list[str]) -> list[ConfigError]:
    """Every job of a sweep checked as its single run would be, before the first one runs: each distinct
    problem once. The memory a job needs is checked in the job, on the GPU its worker takes."""
    if unparsed := parse_problems(overrides):
        return list(unparsed.values())
    from tqdm.auto import tqdm

    found: dict[str, ConfigError] = {}
    jobs = sweep_jobs(overrides)
    for job in tqdm(jobs, desc="checking the sweep's jobs", unit="job", leave=False, disable=len(jobs) < SHOW_CHECKS):
        with deferred():  # a signal ends the check between jobs: inside, it cuts OmegaConf's config in two
            problems, good = compose_problems(job)  # (whose error then hides the signal)
            for p in problems + plan_problems(good, check_memory=False):
                found.setdefault(str(p), p)
    return list(found.values())


def folder_problems(overrides: list[str]) -> list[ConfigError]:
    """Hydra's run or sweep folder, set on the command line, where runs cannot write (it is created here,
    as the run would: checked last, when nothing else is wrong)."""
    from pipeline.paths import outputs_problem

    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and "${" not in value and (bad := outputs_problem(Path(value))):
            out.append(ConfigError(key, value, f"the folder {bad}", "a writable directory"))
    return out


def check_command_line(args: list[str]) -> None:
    """Before Hydra makes a folder or starts a job: the outputs folder, then a single run's or every job of
    a sweep's config; what is wrong is printed, exit 2 (Hydra's other flags: Hydra's own handling)."""
    if (bad := outputs_error(outputs_dir())) is not None:  # before Hydra makes its run directory in it
        print(f"error: {PlanError([bad])}", file=sys.stderr, flush=True)
        sys.exit(2)
    register_configs()  # the run schema and each draft's (imports torch and the drafts: after --help)
    flags, overrides = {a for a in args if a.startswith("-")}, [a for a in args if not a.startswith("-")]
    if flags <= {"-m", "--multirun"}:
        if problems := (sweep_problems if flags else run_problems)(overrides) or folder_problems(overrides):
            print(f"error: {PlanError(problems)}", file=sys.stderr, flush=True)
            sys.exit(2)


def stop_sweep(signum: int) -> None:
    """A signal stopped a sweep (in this process, or in the job it ran): the parent run and its unfinished
    jobs KILLED, one line, exit 128 + signum."""
    from pipeline.sweep import ACTIVE

    (sweep,) = ACTIVE
    n = sweep.stopped()
    print(
        f"{describe(signum)}: sweep parent run {sweep.run_id} KILLED"
        + (f", and {n} job run(s) its workers left RUNNING" if n else ""),
        file=sys.stderr,
        flush=True,
    )
    sys.exit(128 + signum)


if __name__ == "__main__":
    if "--help" in sys.argv or "-h" in sys.argv:  # ours: the tool, its groups and experiments (Hydra's: --hydra-help)
        from pipeline.help import help_text

        print(help_text())
        sys.exit(0)
    install()  # a signal while the command line is checked (a sweep's jobs: seconds) ends it as it ends a run
    try:
        check_command_line(sys.argv[1:])
    except KeyboardInterrupt as e:
        print(f"{describe(signum_of(e))}: nothing ran", file=sys.stderr, flush=True)
        sys.exit(128 + signum_of(e))
    from pipeline.sweep import ACTIVE

    try:
        main()
    except BaseException as e:  # a sweep stopped: here, or in its job (sys.exit), or in joblib's wait
        if ACTIVE and (isinstance(e, KeyboardInterrupt) or received()):
            stop_sweep(signum_of(e))
        raise
