"""Where a run's GPU time goes, kernel by kernel: `python benchmarks/profile_step.py [overrides...]`.

Composes the pipeline config exactly as `python -m pipeline` does (same overrides), runs it under
torch.profiler and prints the kernels by total device time with their call counts, so per-step costs
read as total / steps. Graph replays are included (CUPTI reports the kernels a graph launches).
Writes the table and a Chrome trace to `--out` (default: outputs/profile).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

from pipeline.__main__ import run
from pipeline.paths import REPO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "profile"))
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = compose(config_name="config", overrides=args.overrides)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        run(cfg)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=70)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.txt").write_text(table)
    if os.environ.get("PROFILE_TRACE"):
        prof.export_chrome_trace(str(out / "trace.json"))


if __name__ == "__main__":
    main()
