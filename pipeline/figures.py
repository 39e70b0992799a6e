"""Figures of a run and of a comparison, drawn with matplotlib (Agg: no display needed).

A run's figures are drawn from its metrics dict alone (the names of DESIGN.md section 8), so the eval
stage and a later look at an MLflow run draw the same thing. `RUN_FIGURES` maps a file name to a
function `metrics -> Figure | None`; None means the run did not measure that figure's data (a baseline
run has no acceptance or phases, a run without peers or baseline has one throughput bar), and the file
is skipped, not drawn empty.

    accept_rate_per_position.png   accept_rate_pos_<i> per draft position i (0-based)
    round_phases.png               mean ms per round: draft chain, draft extend, verify, host idle,
                                   beside the baseline's decode step and its host idle
    tokens_per_s.png               tokens/s of this run, its no-draft baseline and each peer

`comparison_figure(names, tokens_per_s, accept_length)` is the chart of `python -m pipeline.compare`
and of a sweep's summary: one bar per run in each panel that has data (no accept_length panel when no
run drafted). A run's figures carry its name, dataset, device and date above them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on a GPU host or in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

Metrics = dict[str, float]


def _ok(v: Optional[float]) -> bool:
    return v is not None and not math.isnan(v)


def _bar_labels(ax, bars, fmt: str = "{:.3g}") -> None:
    ax.margins(y=0.12)  # headroom for the value above the tallest bar
    for b in bars:
        ax.annotate(
            fmt.format(b.get_height()), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom"
        )


def accept_rate_figure(m: Metrics) -> Optional[Figure]:
    pos = sorted(int(k.rsplit("_", 1)[1]) for k in m if re.fullmatch(r"accept_rate_pos_\d+", k))
    rates = [m[f"accept_rate_pos_{i}"] for i in pos]
    if not pos or not any(_ok(r) for r in rates):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    _bar_labels(ax, ax.bar(pos, rates, color="tab:blue"), "{:.2f}")
    ax.set(xlabel="draft position i", ylabel="accepted fraction of rounds", ylim=(0, 1.1), xticks=pos)
    title = "acceptance per draft position"
    if _ok(m.get("accept_length")):
        title += f" (accept_length {m['accept_length']:.2f})"
    ax.set_title(title)
    fig.tight_layout()
    return fig


def phases_figure(m: Metrics) -> Optional[Figure]:
    # draft_ms holds the chain and the extend (engine/speculative/generate.py RoundStats): split so the stack adds up.
    draft, extend = m.get("draft_ms"), m.get("extend_ms") or 0.0
    spec = [
        ("draft chain", draft - extend if _ok(draft) else None, "tab:orange"),
        ("draft extend", extend if _ok(draft) else None, "tab:red"),
        ("verify", m.get("verify_ms"), "tab:blue"),
        ("host idle", m.get("host_ms"), "tab:gray"),
    ]
    base = [
        ("decode step", m.get("baseline_step_ms"), "tab:cyan"),
        ("host idle", m.get("baseline_host_ms"), "tab:gray"),
    ]
    columns = [(label, [p for p in parts if _ok(p[1])]) for label, parts in (("round", spec), ("baseline", base))]
    columns = [(label, parts) for label, parts in columns if parts]
    if not any(label == "round" for label, _ in columns):  # no draft: no round to break down
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    seen: set[str] = set()
    for x, (_, parts) in enumerate(columns):
        bottom = 0.0
        for name, ms, color in parts:
            ax.bar(x, ms, bottom=bottom, color=color, label=None if name in seen else name, edgecolor="white")
            seen.add(name)
            bottom += ms
        ax.annotate(f"{bottom:.3g} ms", (x, bottom), ha="center", va="bottom")
    ax.set_xticks(range(len(columns)), [label for label, _ in columns])
    ax.set(ylabel="ms per round (stream time)", title="time per phase of a round")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def throughput_figure(m: Metrics) -> Optional[Figure]:
    bars = [("this run", m.get("tokens_per_s")), ("no-draft baseline", m.get("baseline_tokens_per_s"))]
    bars += [(k.split(".", 1)[1], v) for k, v in sorted(m.items()) if k.startswith("peer_tokens_per_s.")]
    bars = [(name, v) for name, v in bars if _ok(v)]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(bars) + 1), 3.5))
    colors = ["tab:green"] + ["tab:gray"] * (len(bars) - 1)
    _bar_labels(ax, ax.bar(range(len(bars)), [v for _, v in bars], color=colors), "{:.4g}")
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=15)
    ax.set(ylabel="generated tokens / s", title="throughput, same prompts")
    fig.tight_layout()
    return fig


RUN_FIGURES: dict[str, Callable[[Metrics], Optional[Figure]]] = {
    "accept_rate_per_position.png": accept_rate_figure,
    "round_phases.png": phases_figure,
    "tokens_per_s.png": throughput_figure,
}


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_run_figures(metrics: Metrics, folder: Path, title: str = "") -> list[Path]:
    """Every figure whose data the run measured, as PNG files in `folder` -> their paths. `title`: the run,
    dataset, device and date, above each figure."""
    out = []
    for name, draw in RUN_FIGURES.items():
        fig = draw(metrics)
        if fig is not None:
            if title:
                fig.suptitle(title, fontsize="small", color="dimgray")
                fig.tight_layout()
            out.append(save(fig, folder / name))
    return out


def comparison_figure(names: list[str], tokens_per_s: list[Optional[float]], accept_length: list[Optional[float]]):
    """A panel per measure some run has, one bar per run: tokens/s, and accept_length where a run drafted."""
    measures = ((tokens_per_s, "tokens/s"), (accept_length, "accept_length"))
    panels = [(values, label) for values, label in measures if any(map(_ok, values))]
    panels = panels or [(tokens_per_s, "tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.5, 1.1 * len(names) + 2) * len(panels), 4), squeeze=False)
    for ax, (values, label) in zip(axes[0], panels):
        xs = [i for i, v in enumerate(values) if _ok(v)]
        _bar_labels(ax, ax.bar(xs, [values[i] for i in xs], color="tab:blue"))
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
        ax.set(title=label, xlim=(-0.6, len(names) - 0.4))
    fig.tight_layout()
    return fig
