"""The MLflow store under concurrency and kills, and how runs and sweeps end on signals (real processes,
real signals, a real SQLite store).

Store: runs and sweeps started together on a fresh store all succeed, each in its own Hydra folder; a
store left half-created is created afresh, one whose upgrade fails is restored and named in one error, an
upgrade cut short is rolled back; a sweep whose parent run cannot be created fails; a run SIGKILLed
mid-eval is marked KILLED by the next run, with a line.

Signals: a second Ctrl-C during the cleanup and a SIGTERM end a run as one Ctrl-C does (results kept,
KILLED, one line, exit 130 / 143); Ctrl-C on a joblib sweep ends it with every run KILLED or FINISHED.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import cli, compose_cfg
from mlflow.tracking import MlflowClient

from pipeline.config import to_run_config
from pipeline.paths import REPO
from pipeline.store import StoreError, _head_revision, open_store
from pipeline.tracking import Tracker

TINY = ("model=tiny", "device=cpu", "tracking.system_metrics=false")
QUICK = (*TINY, "eval.limit=1", "eval.max_new_tokens=2")
LONG = (*TINY, "eval.max_new_tokens=48")  # 164 prompts: about 25 s of eval to land a signal in


def client(outputs: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")


def runs(outputs: Path, experiment: str) -> list:
    c = client(outputs)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id])


def start(outputs: Path, *args: str, group: bool = False) -> subprocess.Popen:
    """`python -m pipeline *args` as a shell starts it (SIGINT at its default; `group`: its own process
    group, as a terminal's Ctrl-C reaches a sweep's launcher and its workers together)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=REPO,
        env={**os.environ, "SPECPIPE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(p: subprocess.Popen, pattern: str, stream: str = "stdout", timeout: float = 180) -> str:
    """Read `p`'s stream until `pattern` shows in its tail -> what was read."""
    fd, seen, t0 = getattr(p, stream).fileno(), "", time.monotonic()
    while not re.search(pattern, seen[-600:]):
        assert time.monotonic() - t0 < timeout, seen[-2000:]
        chunk = os.read(fd, 65536).decode(errors="replace")
        assert chunk, f"ended before {pattern!r}: {seen[-2000:]}"
        seen += chunk
    return seen


def finished_prompt(p: subprocess.Popen) -> str:
    return wait_for(p, r"eval: [^\r\n]*?\b[1-9]\d*/\d+", "stderr")


# ------------------------------------------------------------------------------------------ store
@pytest.mark.fresh_store
def test_runs_and_sweeps_started_together_on_a_fresh_store_all_succeed(outputs):
    """Two runs and two sweeps at once on an outputs folder with no store: every process exits 0, every
    run and parent FINISHED (the store is created once, under its lock), each run its own Hydra folder."""
    procs = [start(outputs, *QUICK, "experiment_name=together") for _ in range(2)]
    procs += [start(outputs, "-m", *QUICK, "eval.batch_size=1", "experiment_name=together_sweep") for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    single = runs(outputs, "together")
    assert len(single) == 2 and {r.info.status for r in single} == {"FINISHED"}
    swept = runs(outputs, "together_sweep")
    parents = [r for r in swept if "sweep.overrides" in r.data.tags]
    assert len(parents) == 2 and len(swept) == 4 and {r.info.status for r in swept} == {"FINISHED"}
    assert len(list(outputs.glob("runs/*/*/.hydra"))) == 2  # runs started in the same second: apart
    assert len(list(outputs.glob("multirun/*/*/compare.md"))) == 2


def _set_revision(db: Path, rev: str) -> None:
    with sqlite3.connect(db) as c:
        c.execute("UPDATE alembic_version SET version_num = ?", (rev,))


def test_a_half_created_store_is_created_afresh_and_a_used_one_is_named(outputs, capsys):
    db = outputs / "mlflow.db"
    uri = f"sqlite:///{db}"
    _set_revision(db, "451aebb31d03")  # an early revision: what a process killed mid-creation leaves
    open_store(uri).search_experiments()
    assert "a half-created store (no run in it) created afresh" in capsys.readouterr().out

    c = open_store(uri)
    run_id = c.create_run(c.create_experiment("kept")).info.run_id
    _set_revision(db, "451aebb31d03")  # a store with a run whose upgrade cannot go through
    with pytest.raises(StoreError) as e:
        open_store(uri)
    assert f"tracking store {db} (schema revision 451aebb31d03) cannot be opened" in str(e.value)
    assert f"move {db} aside" in str(e.value) and "mlflow db upgrade" in str(e.value)
    with sqlite3.connect(db) as c:  # as it was: the copy taken before the upgrade put back
        assert c.execute("SELECT version_num FROM alembic_version").fetchall() == [("451aebb31d03",)]
        assert c.execute("SELECT run_uuid FROM runs").fetchall() == [(run_id,)]
    assert not Path(f"{db}.upgrading").exists()

    # an upgrade cut short (SIGKILL): the copy taken before it is put back, and the store opens
    _set_revision(db, _head_revision())
    Path(f"{db}.upgrading").write_bytes(db.read_bytes())
    db.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)  # half-written
    assert open_store(uri).get_run(run_id).info.run_id == run_id
    assert "an interrupted upgrade rolled back" in capsys.readouterr().out


@pytest.mark.fresh_store
def test_a_sweep_over_a_store_that_is_not_a_database_stops_before_its_jobs(outputs, tmp_path):
    (outputs / "mlflow.db").write_text("not a database")
    p = cli("-m", *QUICK, "eval.batch_size=1,2", f"hydra.sweep.dir={tmp_path}/mr", outputs=outputs, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "- tracking.tracking_uri='sqlite:///" in p.stderr and "is not an SQLite database" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "mr").exists()


def test_a_run_or_sweep_into_a_deleted_experiment_says_how_to_restore_it(outputs, tmp_path):
    """The experiment was deleted (in the MLflow UI; MLflow keeps its name): a run, or a sweep's parent
    run, is refused before any load, one line naming the experiment and the restore command, exit 2."""
    c = client(outputs)
    gone = c.create_experiment("deleted")
    c.delete_experiment(gone)
    for sweep in ((), ("-m", "eval.batch_size=1,2", f"hydra.sweep.dir={tmp_path}/mr")):
        p = cli(*sweep, *QUICK, "experiment_name=deleted", outputs=outputs, timeout=300)
        assert p.returncode == 2, p.stderr[-2000:]
        said = f"the experiment 'deleted' (id {gone}) is deleted in sqlite:///"
        assert said in p.stderr and f"mlflow experiments restore --experiment-id {gone})" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and "[load]" not in p.stdout
    assert "sweep's parent MLflow run could not be created: StoreError" in p.stderr


def test_a_run_killed_with_sigkill_is_marked_killed_by_the_next_run(outputs, capsys):
    p = start(outputs, *LONG, "experiment_name=sigkill")
    run_id = re.search(r"\[mlflow\] run (\w+)", wait_for(p, r"\[mlflow\] run \w+ ")).group(1)
    p.kill()
    p.wait(30)
    assert client(outputs).get_run(run_id).info.status == "RUNNING"
    cfg = to_run_config(compose_cfg(*QUICK, "experiment_name=next"))
    with Tracker(cfg, outputs, torch.device("cpu")):
        pass
    assert client(outputs).get_run(run_id).info.status == "KILLED"
    assert f"1 run(s) left RUNNING by a process that is gone marked KILLED: {run_id}" in capsys.readouterr().out
    with Tracker(cfg, outputs, torch.device("cpu")):  # a live run of this process is left alone
        assert "marked KILLED" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ signals
def test_a_signal_while_a_sweeps_jobs_are_checked_ends_it_in_one_line(outputs, tmp_path):
    """Checking 399 jobs takes tens of seconds: Ctrl-C or SIGTERM meanwhile ends the command as it ends a
    run, one line, exit 130 / 143, no job launched (Python's KeyboardInterrupt traceback before)."""
    sweep = ("-m", *QUICK, "eval.max_new_tokens=range(1,400)", f"hydra.sweep.dir={tmp_path}/mr")
    procs = {sig: start(outputs, *sweep) for sig in (signal.SIGINT, signal.SIGTERM)}
    time.sleep(6)  # past the imports (about 1 s), well inside the checks
    for sig, p in procs.items():
        p.send_signal(sig)
    for sig, p in procs.items():
        out, err = p.communicate(timeout=60)
        word = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "terminated (SIGTERM)"
        assert p.returncode == 128 + sig and err.endswith(f"{word}: nothing ran\n"), err[-2000:]
        assert "checking the sweep's jobs" in err and "Traceback" not in err  # its progress bar
        assert "Launching" not in out
    assert not (tmp_path / "mr").exists()


def test_a_second_ctrl_c_and_a_sigterm_end_an_eval_as_one_ctrl_c_does(outputs):
    """One process gets Ctrl-C, then Ctrl-C again while it cleans up (after it kept its results, before
    its run is marked); the other SIGTERM (docker stop, `timeout`). Both: results kept, KILLED, one line,
    no traceback, exit 130 and 143."""
    twice = start(outputs, *LONG, "experiment_name=ctrlc_twice")
    term = start(outputs, *LONG, "experiment_name=sigterm")
    seen = {}
    for p in (twice, term):
        seen[p.pid] = finished_prompt(p)
    term.send_signal(signal.SIGTERM)
    twice.send_signal(signal.SIGINT)
    wait_for(twice, r"\[eval\] interrupted during the eval pass")
    twice.send_signal(signal.SIGINT)  # in the cleanup: the run is not marked yet
    for p, experiment, rc, line in (
        (twice, "ctrlc_twice", 130, "interrupted (Ctrl-C)"),
        (term, "sigterm", 143, "terminated (SIGTERM)"),
    ):
        out, err = p.communicate(timeout=120)
        err = seen[p.pid] + err
        assert p.returncode == rc, err[-2000:]
        assert line in err and "Traceback" not in err, err[-2000:]
        (r,) = runs(outputs, experiment)
        assert r.info.status == "KILLED", (experiment, r.info.status)
        kept = Path(r.info.artifact_uri.removeprefix("file://")) / "results.jsonl"
        assert kept.is_file() and all(json.loads(x)["output"] is not None for x in kept.read_text().splitlines())


def test_ctrl_c_on_a_joblib_sweep_kills_every_unfinished_run_and_exits_130(outputs, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    p = start(
        outputs,
        "-m",
        "hydra/launcher=parallel",
        *LONG,
        "eval.batch_size=1,2,3,4",
        "experiment_name=joblib_ctrlc",
        f"hydra.sweep.dir={tmp_path}/mr",
        group=True,
    )
    head = finished_prompt(p)
    os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher and its workers
    out, err = p.communicate(timeout=180)
    err = head + err
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.search(r"interrupted \(Ctrl-C\): sweep parent run \w+ KILLED", err), err[-3000:]
    every = runs(outputs, "joblib_ctrlc")
    assert {r.info.status for r in every} <= {"KILLED", "FINISHED"}, [r.info.status for r in every]
    (parent,) = [r for r in every if "sweep.overrides" in r.data.tags]
    assert parent.info.status == "KILLED" and len(every) >= 2
    assert "[eval] interrupted during the eval pass" in out
