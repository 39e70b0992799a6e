"""`python -m pipeline.compare --experiment NAME[,NAME...] [--out DIR]`: runs side by side, from MLflow.

One column per run (newest first within each experiment, experiments in the order given), rows for
the params whose values differ between the runs, then the key metrics. Params that every run shares
are summarised in one line, so a sweep's table shows exactly what was swept and what it did.

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
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from engine.errors import ConfigError
from pipeline.paths import outputs_dir
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


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


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
    shared: str = ""  # the model/eval/draft/graph params every run shares, one line

    @classmethod
    def from_runs(
        cls,
        title: str,
        runs: list[Any],
        experiments: list[str],
        labels: Optional[list[str]] = None,
        metrics: Optional[list[str]] = None,
    ) -> "Comparison":
        labels = labels or [r.info.run_name or r.info.run_id[:8] for r in runs]
        keys = sorted(set().union(*(r.data.params for r in runs)))
        differ = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
        wanted = list(metrics or [m for m in KEY_METRICS if any(m in r.data.metrics for r in runs)])
        if not metrics:
            wanted += [
                m
                for m in sorted(set().union(*(r.data.metrics for r in runs)))
                if m.startswith(("ratio_vs.", "peer_tokens_per_s."))
            ]
        random_target = runs[0].data.params.get("model.source") == "random"
        shared = ", ".join(
            f"{k}={runs[0].data.params[k]}"
            for k in keys
            if k not in differ
            and k.split(".")[0] in ("model", "eval", "draft", "graph")
            and (random_target or not k.startswith("model.random."))
        )
        return cls(title, runs, labels, experiments, differ, wanted, shared)

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
        rows += [[m, *(_fmt(r.data.metrics.get(m)) for r in self.runs)] for m in self.metrics]
        return rows

    def text(self) -> str:
        return (
            f"{self.title}: {len(self.runs)} run(s)\n"
            + _table(["", *self.labels], self._grid())
            + (f"\nshared: {self.shared}" if self.shared else "")
        )

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
            lines += ["", f"shared: {self.shared}"]
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
    client = MlflowClient(tracking_uri=tracking_uri or default_tracking_uri(outputs_dir()))
    runs, owners = find_runs(client, names, last, include_failed)
    title = f"experiment {names[0]!r}" if len(names) == 1 else f"experiments {', '.join(names)}"
    if not runs:
        return f"{title}: no {'' if include_failed else 'finished '}runs"
    several = len(names) > 1
    labels = [(f"{e}/" if several else "") + (r.info.run_name or r.info.run_id[:8]) for r, e in zip(runs, owners)]
    cmp = Comparison.from_runs(title, runs, owners, labels, metrics)
    text = cmp.text()
    if out is not None:
        paths = cmp.write(Path(out))
        text += "\nwritten: " + ", ".join(str(p) for p in paths)
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
