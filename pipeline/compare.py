"""`python -m pipeline.compare --experiment NAME`: an experiment's runs side by side, from MLflow.

One column per run (newest first), rows for the params whose values differ between the runs, then
the key metrics. Params that every run shares are summarised in one line, so a sweep's table shows
exactly what was swept and what it did.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from pipeline.paths import outputs_dir
from pipeline.tracking import default_tracking_uri

KEY_METRICS = (
    "tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "generated_tokens",
    "peak_mem_mb",
    "accept_length",
    "speedup",
    "match_baseline",
    "capture_s",
    "graph_mem_mb",
    "graph_replays",
    "graph_fallbacks",
)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def compare(
    experiment: str,
    tracking_uri: Optional[str] = None,
    last: int = 10,
    metrics: Optional[list[str]] = None,
    include_failed: bool = False,
) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri or default_tracking_uri(outputs_dir()))
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise SystemExit(
            f"error: --experiment={experiment!r}: no such experiment (valid: {', '.join(names) or 'none yet'})"
        )
    status = "" if include_failed else "attributes.status = 'FINISHED'"
    runs = client.search_runs(
        [exp.experiment_id], filter_string=status, order_by=["attributes.start_time DESC"], max_results=last
    )
    runs = [r for r in runs if "sweep.overrides" not in r.data.tags]  # sweep parents hold no results
    if not runs:
        return f"experiment {experiment!r}: no {'' if include_failed else 'finished '}runs"

    header = ["", *(f"{r.info.run_name or r.info.run_id[:8]}" for r in runs)]
    keys = sorted(set().union(*(r.data.params for r in runs)))
    differ = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
    same = [k for k in keys if k not in differ]
    rows = [
        ["status", *(r.info.status for r in runs)],
        ["run_id", *(r.info.run_id[:8] for r in runs)],
        ["git_sha", *(r.data.tags.get("git_sha", "-")[:10] for r in runs)],
        ["device_name", *(r.data.tags.get("device", "-") for r in runs)],
    ]
    rows += [[k, *(_fmt(r.data.params.get(k)) for r in runs)] for k in differ]
    wanted = metrics or [m for m in KEY_METRICS if any(m in r.data.metrics for r in runs)]
    wanted += [
        m
        for m in sorted(set().union(*(r.data.metrics for r in runs)))
        if not metrics and (m.startswith("ratio_vs.") or m.startswith("peer_tokens_per_s."))
    ]
    rows += [[m, *(_fmt(r.data.metrics.get(m)) for r in runs)] for m in wanted]
    random_target = runs[0].data.params.get("model.source") == "random"
    shared = ", ".join(
        f"{k}={runs[0].data.params[k]}"
        for k in same
        if k.split(".")[0] in ("model", "eval", "draft", "graph")
        and (random_target or not k.startswith("model.random."))
    )
    return (
        f"experiment {experiment!r}: {len(runs)} run(s)\n"
        + _table(header, rows)
        + (f"\nshared: {shared}" if shared else "")
    )


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", required=True, help="MLflow experiment name (the config's experiment_name)")
    ap.add_argument("--tracking-uri", default=None, help="default: sqlite:///<repo>/outputs/mlflow.db")
    ap.add_argument("--last", type=int, default=10, help="newest N runs (default 10)")
    ap.add_argument("--metrics", default=None, help="comma-separated metric names (default: the key metrics)")
    ap.add_argument("--include-failed", action="store_true", help="show FAILED and RUNNING runs too")
    a = ap.parse_args(argv)
    print(compare(a.experiment, a.tracking_uri, a.last, a.metrics.split(",") if a.metrics else None, a.include_failed))


if __name__ == "__main__":
    main(sys.argv[1:])
