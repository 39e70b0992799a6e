"""`python -m pipeline.compare --experiment NAME[,NAME...] [--out DIR]`: runs side by side, from MLflow.

One column per run (newest first within each experiment, experiments in the order given), labelled by
what sets it apart (its experiment, then the values of the keys that differ among that experiment's runs:
a sweep's swept keys), rows for the params whose values differ between the runs, then the key metrics.
Params every run shares follow on short lines, one per group; long values (paths) are shortened and the
columns split into tables that fit the terminal. Runs that measured different work (another dataset,
limit, output length, sampling, target or device) get one WARNING line naming the keys.

`--out DIR` also writes the comparison as files:

    compare.csv   one row per run: label, experiment, run_id, run_name, status, git_sha, device, the
                  params that differ, the metrics
    compare.md    the printed table as Markdown (rows: fields; columns: runs)
    compare.png   tokens/s and accept_length per run (pipeline/figures.py)

A Hydra sweep ends with the same report over its jobs (pipeline/sweep.py: `Comparison.from_runs`).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from engine.errors import ConfigError
from engine.speculative.timing import decimals_for
from pipeline.compose_check import override_key
from pipeline.paths import outputs_dir, outputs_problem
from pipeline.store import sqlite_path, store_problem
from pipeline.tracking import default_tracking_uri

KEY_METRICS = (
    "tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "generated_tokens",
    "peak_mem_mb",
    "accept_length",
    "baseline_tokens_per_s",
    "speedup",
    "match_baseline",
    "capture_s",
    "graph_mem_mb",
    "graph_replays",
    "graph_fallbacks",
)
INFO_ROWS = ("experiment", "status", "run_id", "git_sha", "device_name")  # rows of run info above the params
REPORT_FILES = ("compare.csv", "compare.md", "compare.png")
# what a run measured: runs that differ here did not do the same work (tokens/s and acceptance are not comparable)
WORK_KEYS = (
    "model.name",
    "eval.dataset",
    "eval.limit",
    "eval.max_new_tokens",
    "eval.temperature",
    "eval.top_p",
    "eval.ignore_eos",
)
NOT_A_LABEL = ("experiment_name", "tracking.", "aux_layer_ids.")  # keys that follow from others or change no result
CELL = 32  # the widest cell of the printed table


def _fmt(v, key: str = "") -> str:
    if isinstance(v, float):
        timed = key.endswith(("_ms", "_s", "tokens_per_s", "peak_mem_mb")) or key.startswith("ratio_vs.")
        return f"{v:.3g}" if timed else f"{v:.4g}"
    return "-" if v is None else str(v)


def shorten(text: str, width: int = CELL) -> str:
    """A path as its last component (`…/smollm2-135m-instruct-eagle3`); anything still too long cut in the middle."""
    if "/" in text and len(text) > width and " " not in text:
        text = "…/" + text.rstrip("/").rsplit("/", 1)[-1]
    if len(text) > width:
        half = (width - 1) // 2
        text = text[:half] + "…" + text[len(text) - (width - 1 - half) :]
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def _tables(header: list[str], rows: list[list[str]], width: int) -> str:
    """The table in as many side-by-side column groups as it takes to fit `width` characters."""
    first = max(len(r[0]) for r in [header, *rows])
    cols = [max(len(r[i]) for r in [header, *rows]) for i in range(1, len(header))]
    groups, cur, used = [], [], first
    for i, w in enumerate(cols, 1):
        if cur and used + 2 + w > width:
            groups.append(cur)
            cur, used = [], first
        cur.append(i)
        used += 2 + w
    groups.append(cur)
    pick = lambda r, g: [r[0], *(r[i] for i in g)]  # noqa: E731
    return "\n\n".join(_table(pick(header, g), [pick(r, g) for r in rows]) for g in groups)


def run_labels(runs: list[Any], experiments: list[str]) -> list[str]:
    """Each run named by what sets it apart: its experiment when there are several, then the values of the
    keys that differ among that experiment's runs (a sweep job's overrides first: the swept keys), else
    its start time; a label still shared gets the run id's first characters."""
    several = len(set(experiments)) > 1
    labels = []
    for r, e in zip(runs, experiments):
        peers = [x for x, xe in zip(runs, experiments) if xe == e]
        keys = sorted({k for x in peers for k in x.data.params if not k.startswith(NOT_A_LABEL)})
        apart = [k for k in keys if len({x.data.params.get(k) for x in peers}) > 1]
        swept = r.data.tags.get("sweep.job_overrides", "").split()
        swept = [override_key(o) for o in swept]
        apart.sort(key=lambda k: (k not in swept, k))
        parts = [e] if several or not apart else []
        for k in apart:  # as many as fit a column
            part = f"{k.rsplit('.', 1)[-1]}={shorten(str(r.data.params.get(k)), 16)}"
            if parts and len(" ".join([*parts, part])) > CELL:
                break
            parts.append(part)
        if len(peers) > 1 and not apart:
            parts.append(time.strftime("%H:%M:%S", time.localtime(r.info.start_time / 1000)))
        labels.append(" ".join(parts))
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label} {runs[i].info.run_id[:6]}"
    return labels


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


@dataclass
class Comparison:
    """Runs (mlflow `Run`s) and what to show of them; `labels[i]` names column i."""

    title: str
    runs: list[Any]
    labels: list[str]
    experiments: list[str]  # per run
    differ: list[str] = field(default_factory=list)  # params whose values differ between the runs
    metrics: list[str] = field(default_factory=list)
    shared: dict[str, str] = field(default_factory=dict)  # the model/eval/draft/graph params every run shares

    @classmethod
    def from_runs(
        cls,
        title: str,
        runs: list[Any],
        experiments: list[str],
        labels: Optional[list[str]] = None,
        metrics: Optional[list[str]] = None,
    ) -> "Comparison":
        labels = labels or run_labels(runs, experiments)
        keys = sorted(set().union(*(r.data.params for r in runs)))
        differ = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
        if len(set(experiments)) > 1:  # the experiment row says it
            differ = [k for k in differ if k != "experiment_name"]
        wanted = list(metrics or [m for m in KEY_METRICS if any(m in r.data.metrics for r in runs)])
        if not metrics:
            wanted += [
                m
                for m in sorted(set().union(*(r.data.metrics for r in runs)))
                if m.startswith(("ratio_vs.", "peer_tokens_per_s."))
            ]
        random_target = runs[0].data.params.get("model.source") == "random"
        shared = {
            k: runs[0].data.params[k]
            for k in keys
            if k not in differ
            and k.split(".")[0] in ("model", "eval", "draft", "graph")
            and (random_target or not k.startswith("model.random."))
            and runs[0].data.params[k] not in ("None", "[]")
        }
        return cls(title, runs, labels, experiments, differ, wanted, shared)

    def shared_lines(self, width: int = 100) -> list[str]:
        """The params every run shares, one group per line (wrapped to `width`), paths shortened."""
        if not self.shared:
            return []
        out = ["shared by every run:"]
        for group in ("model", "draft", "graph", "eval"):
            own = {k.split(".", 1)[1]: v for k, v in self.shared.items() if k.startswith(group + ".")}
            items = [f"{k}={shorten(v, 40)}" for k, v in own.items()]
            if items:
                out += textwrap.wrap(" ".join(items), width, initial_indent=f"  {group:<6}", subsequent_indent=" " * 8)
        return out

    def warnings(self) -> list[str]:
        """One line when the runs did different work (WORK_KEYS, the device)."""
        keys = [k for k in WORK_KEYS if len({r.data.params.get(k) for r in self.runs}) > 1]
        if len({r.data.tags.get("device") for r in self.runs}) > 1:
            keys.append("device")
        if not keys:
            return []
        return [
            f"WARNING: the runs differ in {', '.join(keys)}: they measured different work, so their tokens/s "
            "and accept_length do not compare as they stand"
        ]

    def _info(self, name: str, i: int) -> str:
        r = self.runs[i]
        return {
            "experiment": self.experiments[i],
            "status": r.info.status,
            "run_id": r.info.run_id[:8],
            "git_sha": r.data.tags.get("git_sha", "-")[:10],
            "device_name": r.data.tags.get("device", "-"),
        }[name]

    def _grid(self) -> list[list[str]]:
        """Rows of the printed / Markdown table: [field, value per run]."""
        idx = range(len(self.runs))
        info = [n for n in INFO_ROWS if n != "experiment" or len(set(self.experiments)) > 1]
        rows = [[n, *(self._info(n, i) for i in idx)] for n in info]
        rows += [[k, *(_fmt(r.data.params.get(k)) for r in self.runs)] for k in self.differ]
        rows += [[m, *(self._metric(r, m) for r in self.runs)] for m in self.metrics]
        return rows

    @staticmethod
    def _metric(r, m: str) -> str:
        v = r.data.metrics.get(m)
        if m == "speedup" and v is not None and "speedup_min" in r.data.metrics:  # with its per-batch range
            lo, hi = r.data.metrics["speedup_min"], r.data.metrics["speedup_max"]
            d = decimals_for((hi - lo) / 2)
            return f"{v:.{d}f} ({lo:.{d}f}-{hi:.{d}f})"
        return _fmt(v, m)

    def text(self, width: Optional[int] = None) -> str:
        """The table for a terminal of `width` columns (None: this terminal's, 100 when not one)."""
        width = width or shutil.get_terminal_size((100, 24)).columns
        grid = [[c if i == 0 else shorten(c) for i, c in enumerate(row)] for row in self._grid()]
        header = ["", *(shorten(label) for label in self.labels)]
        lines = [f"{self.title}: {len(self.runs)} run(s)", _tables(header, grid, width), *self.shared_lines(width)]
        lines += [wrapped for w in self.warnings() for wrapped in textwrap.wrap(w, width, subsequent_indent="  ")]
        return "\n".join(lines)

    def markdown(self) -> str:
        head = ["", *self.labels]
        lines = [
            f"# {self.title}: {len(self.runs)} run(s)",
            "",
            "| " + " | ".join(_md_cell(h) for h in head) + " |",
            "|" + "---|" * len(head),
            *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in self._grid()),
        ]
        if self.shared:
            lines += ["", "shared by every run: " + ", ".join(f"`{k}={v}`" for k, v in self.shared.items())]
        lines += ["", *self.warnings()] if self.warnings() else []
        return "\n".join(lines) + "\n"

    def records(self) -> list[dict[str, Any]]:
        """One dict per run: the CSV rows."""
        out = []
        for i, r in enumerate(self.runs):
            row: dict[str, Any] = {
                "label": self.labels[i],
                "experiment": self.experiments[i],
                "run_id": r.info.run_id,
                "run_name": r.info.run_name,
                "status": r.info.status,
                "git_sha": r.data.tags.get("git_sha", ""),
                "device": r.data.tags.get("device", ""),
            }
            row.update({k: r.data.params.get(k, "") for k in self.differ})
            row.update({m: r.data.metrics.get(m, "") for m in self.metrics})
            out.append(row)
        return out

    def write(self, folder: Path) -> list[Path]:
        """compare.csv, compare.md and compare.png in `folder` -> their paths."""
        from pipeline.figures import comparison_figure, save

        folder.mkdir(parents=True, exist_ok=True)
        csv_path, md_path, png_path = (folder / n for n in REPORT_FILES)
        records = self.records()
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
        md_path.write_text(self.markdown())
        metric = lambda name: [r.data.metrics.get(name) for r in self.runs]  # noqa: E731
        save(comparison_figure(self.labels, metric("tokens_per_s"), metric("accept_length")), png_path)
        return [csv_path, md_path, png_path]


def find_runs(client, experiments: list[str], last: int, include_failed: bool) -> tuple[list[Any], list[str]]:
    """The newest `last` runs of each experiment (sweep parents left out: they hold no results) -> runs,
    and the experiment of each. Unknown names are one ConfigError naming them and the experiments that exist."""
    found = {name: client.get_experiment_by_name(name) for name in experiments}
    unknown = [name for name, exp in found.items() if exp is None]
    if unknown:
        names = sorted(e.name for e in client.search_experiments())
        raise ConfigError(
            "--experiment",
            ",".join(experiments),
            f"no such experiment: {', '.join(unknown)}",
            ", ".join(names) or "none yet: run `python -m pipeline` first",
        )
    status = "" if include_failed else "attributes.status = 'FINISHED'"
    runs, owners = [], []
    for name, exp in found.items():
        got = client.search_runs(
            [exp.experiment_id], filter_string=status, order_by=["attributes.start_time DESC"], max_results=last
        )
        got = [r for r in got if "sweep.overrides" not in r.data.tags]
        runs += got
        owners += [name] * len(got)
    return runs, owners


def compare(
    experiment: str | list[str],
    tracking_uri: Optional[str] = None,
    last: int = 10,
    metrics: Optional[list[str]] = None,
    include_failed: bool = False,
    out: Optional[Path] = None,
) -> str:
    """The table of the runs of `experiment` (a name, "a,b" or a list); with `out`, also the report files."""
    from mlflow.tracking import MlflowClient

    names = [n for n in (experiment.split(",") if isinstance(experiment, str) else experiment) if n]
    if not names:
        raise ConfigError("--experiment", experiment, "no experiment named", "NAME or NAME,NAME,...")
    if last < 1:
        raise ConfigError("--last", last, "out of range", ">= 1")
    uri = tracking_uri or default_tracking_uri(outputs_dir())
    if (problem := store_problem(uri)) is None and (db := sqlite_path(uri)) is not None and not db.is_file():
        problem = "no such file: no run has logged there yet"
    if problem is not None:
        raise ConfigError("--tracking-uri", uri, problem, "sqlite:///<path> or http(s)://<server>")
    client = MlflowClient(tracking_uri=uri)
    runs, owners = find_runs(client, names, last, include_failed)
    title = f"experiment {names[0]!r}" if len(names) == 1 else f"experiments {', '.join(names)}"
    if not runs:
        return f"{title}: no {'' if include_failed else 'finished '}runs"
    cmp = Comparison.from_runs(title, runs, owners, metrics=metrics)
    text = cmp.text()
    if out is not None:
        if (bad := outputs_problem(Path(out))) is not None:
            raise ConfigError("--out", str(out), f"the folder {bad}", "a writable directory")
        paths = cmp.write(Path(out))
        text += f"\nwritten to {Path(out)}: " + ", ".join(p.name for p in paths)
    return text


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.compare", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--experiment", required=True, help="MLflow experiment name(s), comma-separated (the configs' experiment_name)"
    )
    ap.add_argument("--tracking-uri", default=None, help="default: sqlite:///<repo>/outputs/mlflow.db")
    ap.add_argument("--last", type=int, default=10, help="newest N runs of each experiment (default 10)")
    ap.add_argument("--metrics", default=None, help="comma-separated metric names (default: the key metrics)")
    ap.add_argument("--include-failed", action="store_true", help="show FAILED and RUNNING runs too")
    ap.add_argument("--out", default=None, help="also write compare.csv, compare.md and compare.png here")
    a = ap.parse_args(argv)
    try:
        text = compare(
            a.experiment,
            a.tracking_uri,
            a.last,
            a.metrics.split(",") if a.metrics else None,
            a.include_failed,
            Path(a.out) if a.out else None,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
