"""The MLflow store: created or upgraded once under a lock, repaired when a run died inside, dead runs reaped.

    open_store(uri) -> MlflowClient   a SQLite store is created / upgraded by one process at a time
                                      (flock on `<db>.lock`), however many runs start together
    store_problem(uri) -> str | None  plan time: why runs cannot use the store (opens nothing)
    owner_tags()                      tags naming this process (host, pid, its start time) on every run
    reap_dead_runs(client)            RUNNING runs whose process on this host is gone -> KILLED

Invariants. A store that a killed process left half-created (no run in it) is created afresh; before an
existing store is upgraded it is copied to `<db>.upgrading`, which is removed once the upgrade is done,
so an upgrade cut short is rolled back from that copy at the next open and tried again; a store that
cannot be opened for another reason is one StoreError naming the file and the way out. A run whose
process was SIGKILLed (or lost with its machine) stays RUNNING until the next run on this host finds
its process gone and marks it KILLED, with one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sqlite3
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlparse

SQLITE_MAGIC = b"SQLite format 3\x00"
SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")
PROBE_TIMEOUT_S = 5.0  # an http(s) tracking server that does not answer in this long is named at plan time


class StoreError(RuntimeError):
    """The store cannot be used; the message names the file and what to do."""


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a `sqlite:///path` URI (None: another kind of store, or in-memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]  # four slashes: absolute; three: from the cwd
    return None if path in ("", ":memory:") else Path(path).absolute()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `<path>.lock`, held by one process of any number waiting for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _count(db: Path, table: str) -> int:
    """Rows of `table` (0 when the table does not exist)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
        try:
            return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


def _revision(db: Path) -> Optional[str]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
        try:
            row = c.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError:
            return None
    return row[0] if row else None


def _not_sqlite(db: Path) -> Optional[str]:
    if not db.exists() or db.stat().st_size == 0:
        return None
    with open(db, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            return f"{db} is not an SQLite database"
    return None


def _used(db: Path) -> bool:
    """Whether the store holds anything of a user's: a run, or an experiment beyond MLflow's Default."""
    return _count(db, "runs") > 0 or _count(db, "experiments") > 1


def _fix(db: Path) -> str:
    return (
        f"move {db} aside (runs then start a new store), or back it up and run `mlflow db upgrade sqlite:///{db}`; "
        "tracking=off runs without a store"
    )


def _forget(db: Path) -> None:
    """Drop what this process keeps of `db` (MLflow caches a store and an engine per URI): the file is
    about to be replaced or upgraded, and they would go on with the old one."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service.registry import TrackingStoreRegistry

    TrackingStoreRegistry._get_store_with_resolved_uri.cache_clear()
    for uri in [u for u in SqlAlchemyStore._engine_map if sqlite_path(u) == db]:
        SqlAlchemyStore._engine_map.pop(uri).dispose()


def open_store(uri: str):
    """An MlflowClient on `uri` whose store exists at MLflow's schema; raises StoreError."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(uri)
    if db is None:  # a server or another database: MLflow's own handling
        return MlflowClient(tracking_uri=uri)

    backup = Path(f"{db}.upgrading")
    with locked(db):
        if (bad := _not_sqlite(db)) is not None:
            raise StoreError(f"tracking store: {bad}; {_fix(db)}")
        if backup.exists():  # an upgrade was cut short: back to the store as it was, and upgrade again
            _forget(db)
            os.replace(backup, db)
            print(f"[mlflow] {db}: an interrupted upgrade rolled back from {backup.name}", flush=True)
        if db.exists() and _revision(db) != _head_revision():
            _forget(db)
            if not _used(db):  # left half-created by a process that died: nothing in it to lose
                for f in (db, Path(f"{db}-journal"), Path(f"{db}-wal"), Path(f"{db}-shm")):
                    f.unlink(missing_ok=True)
                print(f"[mlflow] {db}: a half-created store (no run in it) created afresh", flush=True)
            else:  # an older MLflow's store: upgraded below, from a copy kept until that is done
                with contextlib.closing(sqlite3.connect(db)) as src, contextlib.closing(sqlite3.connect(backup)) as dst:
                    src.backup(dst)
        try:
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)  # the store is built (tables created or upgraded) here
        except Exception as e:
            if backup.exists():
                _forget(db)
                os.replace(backup, db)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise StoreError(
                f"tracking store {db} (schema revision {_revision(db)}) cannot be opened: {first}; {_fix(db)}"
            ) from None
        backup.unlink(missing_ok=True)
    return client


def _head_revision() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision  # what MLflow's own check compares with

    return _get_latest_schema_revision()


def store_problem(uri: str) -> Optional[str]:
    """Why runs could not log to `uri` (None: they can, as far as can be told without opening it): a scheme
    MLflow has no store for, a folder (MLflow's file store) it refuses, a SQLite file that is not a
    database, an http(s) server that does not answer."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

    scheme = urlparse(uri).scheme
    if scheme and scheme not in SCHEMES:  # no scheme: a local folder
        return f"no MLflow store for the scheme {scheme!r} (valid: {', '.join(SCHEMES)})"
    if scheme in ("", "file") and not MLFLOW_ALLOW_FILE_STORE.get():
        return "a folder: MLflow's file store, which it refuses (MLFLOW_ALLOW_FILE_STORE=true allows it)"
    if (db := sqlite_path(uri)) is not None:
        return _not_sqlite(db)
    if scheme == "sqlite":
        return "a SQLite URI takes three slashes and a path: sqlite:///<path>"
    if scheme in ("http", "https"):
        import httpx

        try:
            httpx.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as e:
            return f"no tracking server answers there within {PROBE_TIMEOUT_S:g} s ({type(e).__name__})"
    return None


# ------------------------------------------------------------------------------------------ owners
HOST, PID, STARTED = "specpipe.host", "specpipe.pid", "specpipe.pid_start"


def _started(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), None when it does not exist: with the
    pid, it names one process (a pid is reused; the pair is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_tags() -> dict[str, str]:
    pid = os.getpid()
    return {HOST: socket.gethostname(), PID: str(pid), STARTED: _started(pid) or ""}


def _gone(tags: dict[str, str]) -> bool:
    try:
        pid = int(tags[PID])
    except (KeyError, ValueError):
        return False
    if Path("/proc/self/stat").exists():
        return _started(pid) != tags.get(STARTED)
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def reap_dead_runs(client) -> list[str]:
    """Mark KILLED the RUNNING runs of this host whose process is gone -> their ids (one line says so).
    Best effort: a store that cannot be searched is said in a line, and the run goes on."""
    try:
        experiments = [e.experiment_id for e in client.search_experiments()]
        running = f"attributes.status = 'RUNNING' and tags.`{HOST}` = '{socket.gethostname()}'"
        runs = client.search_runs(experiments, filter_string=running) if experiments else []
        dead = [r.info.run_id for r in runs if _gone(r.data.tags)]
        for run_id in dead:
            client.set_terminated(run_id, status="KILLED")
    except Exception as e:
        print(f"[mlflow] runs left RUNNING by dead processes not checked ({type(e).__name__}: {e})", flush=True)
        return []
    if dead:
        print(
            f"[mlflow] {len(dead)} run(s) left RUNNING by a process that is gone marked KILLED: {', '.join(dead)}",
            flush=True,
        )
    return dead
