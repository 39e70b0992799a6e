"""How many of the self-distilled user messages are cut at `max_prompt_tokens`:
`python benchmarks/prompt_cut.py [--n 80] [--limits 64,96,128] [--temperatures 1.0,0.85] [overrides...]`.

Magpie messages are sampled until the target ends its user turn; one that reaches the limit first is
answered as it is (`Sample.cut`; `train.data.drop_cut_prompts=true` draws it again instead). The messages
are written as the recipe (`+experiment=train_eagle3_smollm2`, its topic system messages) writes them,
on whatever device the load stage picks, answered by one token only; one row per temperature and limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from engine.train.selfdistill import cut_share
from pipeline.config import compose_run_config
from pipeline.plan import build_plan
from stages.train_draft import synthesize_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=80, help="messages per row (one generation batch)")
    ap.add_argument("--limits", default="64,96,128", help="max_prompt_tokens values")
    ap.add_argument("--temperatures", default="1.0,0.85", help="prompt_temperature values")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_run_config("+experiment=train_eagle3_smollm2", "tracking=off", *args.overrides)
    loaded = build_plan(cfg).set_up("load")["target"]
    d = cfg.train.data
    print(f"{'temperature':>11} {'limit':>5} {'cut':>5} {'median tokens':>13}")
    for temperature in map(float, args.temperatures.split(",")):
        for limit in map(int, args.limits.split(",")):
            samples = synthesize_data(
                loaded,
                dataclasses.replace(
                    d,
                    num_samples=args.n,
                    batch_size=args.n,
                    max_prompt_tokens=limit,
                    max_answer_tokens=1,
                    prompt_temperature=temperature,
                    sync_every=16,
                ),
            )
            tokens = statistics.median(len(loaded.tokenizer.encode(s.user)) for s in samples)
            print(f"{temperature:>11g} {limit:>5} {cut_share(samples):>5.2f} {tokens:>13g}", flush=True)


if __name__ == "__main__":
    main()
