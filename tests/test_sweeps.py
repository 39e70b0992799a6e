"""Sweeps that scale out through existing engines (conf/hydra/): joblib's parallel jobs, the Optuna
sweeper, and the one-GPU-per-worker pinning, on the tiny model and a real MLflow store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.runs import cli, parent_and_children

from pipeline.paths import REPO

TINY = ("model=tiny", "eval.limit=1", "eval.max_new_tokens=2", "device=cpu", "tracking.system_metrics=false")


def sweep(outputs: Path, sweep_dir: Path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return cli("-m", *args, f"hydra.sweep.dir={sweep_dir}", outputs=outputs, env=env_extra)


def test_a_joblib_sweep_runs_parallel_jobs_each_on_its_own_gpu(outputs, tmp_path):
    """hydra/launcher=parallel: two jobs in joblib workers, nested under a FINISHED parent run. With two
    GPUs listed, each worker pins one (the tag); two jobs that ran at the same time hold different ones."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    p = sweep(
        outputs,
        tmp_path / "mr",
        "hydra/launcher=parallel",
        *TINY,
        "eval.batch_size=1,2",
        "experiment_name=joblib_sweep",
        env_extra={"CUDA_VISIBLE_DEVICES": "0,1"},  # the CPU build of torch ignores it: jobs run on the CPU
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in p.stdout + p.stderr
    parent, children = parent_and_children(outputs, "joblib_sweep")
    assert parent.info.status == "FINISHED" and [c.info.status for c in children] == ["FINISHED"] * 2
    assert [c.data.params["eval.batch_size"] for c in children] == ["1", "2"]
    gpus = [c.data.tags["cuda_visible_devices"] for c in children]
    assert set(gpus) <= {"0", "1"}, gpus
    a, b = (c.info for c in children)
    if a.start_time < b.end_time and b.start_time < a.end_time:  # they overlapped: never one GPU
        assert gpus[0] != gpus[1], gpus
    assert "sweep of 'joblib_sweep': 2 run(s)" in p.stdout


def test_an_optuna_sweep_maximises_the_jobs_tokens_per_s(outputs, tmp_path):
    """hydra/sweeper=optuna_tokens_per_s, two trials: each trial a child run with the params Optuna
    chose from the search space, and the study's best value is the best child's tokens_per_s (the
    objective the hydra main returns)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "opt"
    p = sweep(
        outputs,
        sweep_dir,
        "hydra/sweeper=optuna_tokens_per_s",
        "hydra.sweeper.n_trials=2",
        "+experiment=eagle3",
        "graph=debug",
        "draft.init=random",
        "draft.aux_layer_ids=[1,2,3]",
        "eval.batch_size=8",  # the config's capture-size choices go up to 8
        *TINY,
        "experiment_name=optuna_sweep",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    parent, children = parent_and_children(outputs, "optuna_sweep")
    assert parent.info.status == "FINISHED" and [c.info.status for c in children] == ["FINISHED"] * 2
    for c in children:
        assert 1 <= int(c.data.params["draft.num_steps"]) <= 7
        assert c.data.params["graph.capture_sizes"] in ("[1, 2, 4, 8]", "[8]", "[1, 8]", "[1, 2, 8]")
    result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(children, key=lambda c: c.data.metrics["tokens_per_s"])
    assert result["best_value"] == pytest.approx(best.data.metrics["tokens_per_s"])
    assert result["best_params"]["draft.num_steps"] == int(best.data.params["draft.num_steps"])
    assert (sweep_dir / "compare.csv").is_file()


PIN = """
import sys, time
from pathlib import Path
from pipeline.sweep import pin_one_gpu
try:
    print(pin_one_gpu(Path(sys.argv[1])), flush=True)
except RuntimeError as e:
    print("error:", e, flush=True)
    sys.exit(3)
time.sleep(float(sys.argv[2]))
"""


def test_each_worker_takes_a_gpu_no_live_worker_holds(tmp_path):
    """Two processes pinned at once hold different GPUs; a third finds both held and names
    hydra.launcher.n_jobs; once a holder exits, its GPU is free for the next worker."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5", "PYTHONPATH": str(REPO)}

    def start(hold_s: float) -> subprocess.Popen:
        cmd = [sys.executable, "-c", PIN, str(tmp_path), str(hold_s)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)

    holders = [start(120), start(120)]
    try:
        got = [h.stdout.readline().strip() for h in holders]  # each prints its GPU once it holds the lock
        assert sorted(got) == ["3", "5"], got
        third = start(0)
        out, _ = third.communicate(timeout=120)
        assert third.returncode == 3 and "hydra.launcher.n_jobs" in out and "(3,5)" in out, out
        holders[1].kill()
        holders[1].wait(timeout=60)
        fourth = start(0)
        out, _ = fourth.communicate(timeout=120)
        assert fourth.returncode == 0 and out.strip() == got[1], out
    finally:
        for h in holders:
            h.kill()
            h.wait(timeout=60)
