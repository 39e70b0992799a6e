"""The draft server at k = 0 against the server without a draft: `python benchmarks/serve_k0.py [overrides...]`.

Builds both servers' engines in this process from `+experiment=serve_eagle3_bcg` plus the overrides (the
draft's) and the same with `draft=none`, then drives each scheduler on this thread in a closed loop
(`--clients` requests in flight, a new one joins as one finishes, 0.5 to 1.5 x `--max-tokens`, temperature
`--temperature`), alternating the two `--repeats` times; prints each pass's tokens per second (wall
time on a GPU; CPU time of one torch thread on a CPU) and the median ratio.
The draft side runs with its k forced to 0 (`--k0 forced`: the policy's choice replaced, no probes),
or as adaptive k settles (`--k0 settled`: the policy's own probes included). `--profile` prints the top
cProfile entries of one pass per side. Engine only (no HTTP): what a round and a join cost on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

from engine.drafts.registry import make_draft
from engine.serve.scheduler import GenerationRequest, Scheduler
from engine.speculative.generate import SpecDecoder
from pipeline.config import register_configs, to_run_config
from pipeline.paths import REPO
from pipeline.plan import build_plan


def build(overrides: list[str], slots: int, k0: str) -> Scheduler:
    """The serve stage's scheduler for these overrides, without its HTTP side."""
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = to_run_config(compose(config_name="config", overrides=["tracking=off", *overrides]))
    plan = build_plan(cfg)
    env, context = plan.env, {}
    for stage in plan.stages[:-1]:  # load, aux capture, graph capture
        context.update(stage.run(cfg, stage.inputs(context), env))
    target, graphs, k = context["target"], context.get("graphs"), cfg.draft.k
    draft = make_draft(env.draft_plan, context.get("draft_head"), target.model, slots, k, cfg=cfg.draft, graphs=graphs)
    dec = SpecDecoder(target.model, slots, draft, k, graphs=graphs)
    if k > 0:
        policy = dec.enable_adaptive_k(graphs.sizes if graphs is not None else [slots], sampled=True)
        if k0 == "forced":  # k = 0 every round, never a probe (the policy still observes each round)
            policy.choose = lambda b, mix=None: 0
    sched = Scheduler(dec, slots, 1024, torch.Generator().manual_seed(0))
    sched.warm_up()
    return sched


class OpCount(TorchDispatchMode):
    """Counts the torch operators run under it (on a GPU: about the kernels a call launches)."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        OpCount.n += 1
        return func(*args, **(kwargs or {}))


OPS = OpCount()


def serve(
    sched: Scheduler, clients: int, requests: int, max_tokens: int, temperature: float, calls: dict, count=False
) -> float:
    """`requests` requests through the scheduler, `clients` at a time; -> generated tokens per second: of
    wall time on a GPU, of this process's CPU time on a CPU (one torch thread: a shared host's other
    load does not count). Each round's seconds go to calls[k], each join's to calls["join"] (count: the
    torch operators each ran instead of seconds)."""
    prompts = [[1 + (7 * i + j) % 250 for j in range(12 + 5 * (i % 4))] for i in range(requests)]
    lengths = [max_tokens // 2 + (7 * i) % max_tokens for i in range(requests)]  # staggered: requests join one by one
    reqs = [
        GenerationRequest(p, n, lambda e: None, temperature, seed=i) for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    todo = list(reversed(reqs))
    clock = time.perf_counter if sched.device.type == "cuda" else time.process_time
    t0 = clock()
    with torch.inference_mode():
        while any(r.finish_reason is None for r in reqs):
            while todo and sched.stats.in_flight < clients:
                sched.submit(todo.pop())
            t, joins, ops0 = clock(), sched.stats.prefills, OPS.n
            with OPS if count else contextlib.nullcontext():
                sched._admit()
            if sched.stats.prefills > joins:
                calls.setdefault("join", []).append(OPS.n - ops0 if count else clock() - t)
            if sched.running:
                t, ops0 = clock(), OPS.n
                with OPS if count else contextlib.nullcontext():
                    sched._step()
                calls.setdefault(sched.stats.last_k, []).append(OPS.n - ops0 if count else clock() - t)
    return sum(len(r.output) for r in reqs) / (clock() - t0)


def robust(calls: dict, tokens: int, ops: dict) -> str:
    """Each kind of call's count, median seconds and torch operators, and tokens over the sum of count x
    median (what the passes cost without the shared host's spikes)."""
    med = {key: statistics.median(v) for key, v in calls.items()}
    total = sum(len(calls[key]) * m for key, m in med.items())
    parts = [
        f"{key if key == 'join' else f'k={key}'}: {len(calls[key])} x {1e6 * m:.0f} us, "
        f"{statistics.mean(ops.get(key, [0])):.0f} ops"
        for key, m in sorted(med.items(), key=lambda x: str(x[0]))
    ]
    return f"{'; '.join(parts)}; {tokens / total:.0f} tokens/s at the medians"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k0", choices=("forced", "settled"), default="forced")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    register_configs()
    torch.set_num_threads(1)
    base = ["+experiment=serve_eagle3_bcg", f"serve.max_batch_size={args.clients}", *args.overrides]
    plain = [o for o in base if not o.startswith("draft.")] + ["draft=none"]  # the draft's keys go with it
    sides = {"draft": build(base, args.clients, args.k0), "none": build(plain, args.clients, args.k0)}
    calls: dict[str, dict] = {name: {} for name in sides}
    run = lambda name, c: serve(sides[name], args.clients, args.requests, args.max_tokens, args.temperature, c)  # noqa: E731
    for name in sides:
        run(name, {})  # warm-up pass
    got: dict[str, list[float]] = {name: [] for name in sides}
    tokens = {name: sides[name].stats.generated_tokens for name in sides}
    for _ in range(args.repeats):
        for name in sides:
            got[name].append(run(name, calls[name]))
    ratios = [d / n for d, n in zip(got["draft"], got["none"])]
    ks = dict(sides["draft"].stats.rounds_by_k)
    for name, tps in got.items():
        done = sides[name].stats.generated_tokens - tokens[name]
        ops: dict = {}
        serve(sides[name], args.clients, args.requests, args.max_tokens, args.temperature, ops, count=True)
        med, best = statistics.median(tps), max(tps)
        print(f"{name:>5}: tokens/s {' '.join(f'{t:.0f}' for t in tps)} (median {med:.0f}, best {best:.0f})")
        print(f"       {robust(calls[name], done, ops)}")
    best = max(got["draft"]) / max(got["none"])
    print(
        f"draft / none: {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}, best / best "
        f"{best:.2f}; rounds by k {dict(sorted(ks.items()))}"
    )
    if args.profile:
        for name in sides:
            prof = cProfile.Profile()
            prof.enable()
            run(name, {})
            prof.disable()
            st = pstats.Stats(prof)
            print(f"--- {name}: seconds in (cumulative; calls)")
            for (file, line, fn), (_, calls, _, cum, _) in sorted(st.stats.items(), key=lambda x: -x[1][3]):
                if "engine/" in file and cum > 0.002:
                    print(f"  {cum:7.3f} {calls:6d}  {file.split('wt/serve0/')[-1]}:{line} {fn}")


if __name__ == "__main__":
    main()
