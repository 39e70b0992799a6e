"""Where a round's time goes: `python benchmarks/profile_step.py [--prompts N] [--out DIR] [overrides...]`.

Composes the pipeline config exactly as `python -m pipeline` does (same overrides, tracking off), runs
the plan's stages before the last (load, aux capture, graph capture), then generates on the first N
prompts of the eval set twice under torch.profiler: without the draft (the decode step) and with it.
The table splits a round into its phases (engine/speculative/round.py) and the host's share:

    phase     kernels / round    kernel us / round    stream us / round
    draft     the k-step chain (device drafts; a host draft's proposal)
    verify    the target's forward over k + 1 tokens and the acceptance
    extend    the draft extend and the state's advance
    host      the stream idle between rounds (the round's sync, the host's bookkeeping)

Kernels come from CUPTI (graph replays included: each phase is its own replay, inside a profiler
range of its name, and a kernel counts for the range whose device-side span it starts in); stream
time from CUDA events at the phase boundaries (engine/speculative/phase_clock.py).
On a CPU host the kernel columns count CPU operator calls and their time instead. Also printed: the
accept length, the projected tokens/s (tokens per round over round time) and, with --kernels, the
kernels by total time. Writes the table (and, with PROFILE_TRACE=1, a Chrome trace) to --out.

`--joins` (a serve config, e.g. `+experiment=serve_eagle3_bcg eval=mt_bench`): where a server's join goes
instead. Builds the serve stage's scheduler (no HTTP) and joins each of the N prompts alone into slot 0,
then releases it, in passes: greedy with each prompt length new to the process (after the server's
warm-up), greedy again (warm), sampled at temperature 1, and greedy under the profiler. Per pass: wall ms
a join and the decoder clock's stream ms of its two phases, `prefill` (the target's) and `start` (the
first draw and the draft's prefill); then kernels and kernel us a join per phase.
"""

from __future__ import annotations

import argparse
import bisect
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from engine.drafts.registry import make_draft
from engine.prompts import load_prompts
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator, check_capacity
from engine.speculative.round import PHASES
from pipeline.config import register_configs, to_run_config
from pipeline.paths import REPO
from pipeline.plan import build_plan


class PhaseRanges:
    """A generator's phase hook: each phase of a round inside a profiler range `phase:<name>`."""

    def __init__(self):
        self.open = None

    def __call__(self, phase) -> None:
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None
        if phase is not None:
            self.open = record_function(f"phase:{phase}")
            self.open.__enter__()


def _phase_table(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """phase -> (kernels, microseconds) summed over the run. On CUDA: the device-side copy of each
    `phase:*` range (a GPU user annotation) and every kernel or copy that starts inside it; on CPU:
    the operators called inside each range."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    events = prof.events()
    if not cuda:
        for evt in events:
            if evt.name.startswith("phase:"):
                totals[evt.name.removeprefix("phase:")][0] += len(evt.cpu_children)
                totals[evt.name.removeprefix("phase:")][1] += sum(c.cpu_time_total for c in evt.cpu_children)
        return {k: (n, us) for k, (n, us) in totals.items()}
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name.removeprefix("phase:"))
        for e in on_device
        if e.name.startswith("phase:")
    )
    starts = [r[0] for r in ranges]
    for e in on_device:
        if e.name.startswith("phase:"):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start < ranges[i][1]:
            totals[ranges[i][2]][0] += 1
            totals[ranges[i][2]][1] += e.time_range.elapsed_us()
    return {k: (n, us) for k, (n, us) in totals.items()}


def _profile(gen: Generator, encoded: list[list[int]], params, target, rng, batch: int, n: int):
    """Generate over the first n prompts under the profiler; -> (profile, results, wall seconds)."""
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    gen.reset_stats()
    gen.phase_hook = PhaseRanges()
    results, t0 = [], time.perf_counter()
    with profile(activities=acts) as prof:
        for i in range(0, n, batch):
            results += gen.generate(encoded[i : min(i + batch, n)], params, target.tokenizer.eos_token_ids, rng)
    gen.phase_hook = None
    return prof, results, time.perf_counter() - t0


def report(name: str, gen: Generator, prof, results, wall: float, cuda: bool) -> str:
    stats, rounds = gen.stats, max(gen.stats.rounds, 1)
    table = _phase_table(prof, cuda)
    span = {
        "draft": stats.draft_s - stats.extend_s,
        "verify": stats.verify_s,
        "extend": stats.extend_s,
        "host": stats.host_s,
    }
    unit = "kernels" if cuda else "cpu ops"
    lines = [
        f"{name}: {rounds} rounds, {sum(len(r.tokens) for r in results)} tokens in {wall:.2f} s",
        f"  {'phase':<8} {unit + ' / round':>16} {'us / round':>12} {'stream us / round':>18}",
    ]
    for phase in (*PHASES, "host"):
        n, us = table.get(phase, (0, 0.0))
        if phase != "host" or stats.host_s:
            lines.append(f"  {phase:<8} {n / rounds:>16.1f} {us / rounds:>12.1f} {1e6 * span[phase] / rounds:>18.1f}")
    round_us = 1e6 * (stats.round_s + stats.host_s) / rounds
    accepts = [a for r in results for a in r.accepts]
    per_round = sum(a + 1 for a in accepts) / max(len(accepts), 1)
    lines.append(
        f"  round    {sum(table.get(p, (0, 0))[0] for p in PHASES) / rounds:>16.1f} "
        f"{sum(table.get(p, (0, 0.0))[1] for p in PHASES) / rounds:>12.1f} {round_us:>18.1f}"
    )
    lines.append(
        f"  tokens / round and row {per_round:.3f}: {1e6 * per_round / round_us:.0f} tokens/s per row "
        "at this round time"
    )
    return "\n".join(lines)


def encode_prompts(cfg, target) -> list[list[int]]:
    """The eval set's first `eval.limit` prompts as token ids, encoded as the eval encodes them."""
    e, tok = cfg.eval, target.tokenizer
    encoded = []
    for p in load_prompts(e.dataset, e.limit):
        if p.token_ids is not None:
            encoded.append(list(p.token_ids))
        else:
            encoded.append(tok.encode_chat(p.text, e.system_prompt) if e.chat_template else tok.encode(p.text))
    k = cfg.draft.k
    check_capacity([len(x) for x in encoded], e.max_new_tokens, cfg.model.max_seq_len, k)
    return encoded


class _Ranges:
    """Wraps the decoder's join phases (prefill, start) in profiler ranges `phase:<name>`."""

    def __init__(self, dec):
        self.dec, self.saved = dec, {name: getattr(dec, name) for name in ("prefill", "start")}

    def __enter__(self):
        for name, fn in self.saved.items():
            setattr(self.dec, name, self._wrap(name, fn))

    def __exit__(self, *exc):
        for name in self.saved:
            delattr(self.dec, name)  # the class's methods again

    @staticmethod
    def _wrap(name, fn):
        def ranged(*args, **kw):
            with record_function(f"phase:{name}"):
                return fn(*args, **kw)

        return ranged


def profile_joins(cfg, plan, context, n: int, kernels: int) -> str:
    """The `--joins` report: each of the first n prompts joins slot 0 alone and leaves, per pass."""
    from engine.serve.scheduler import GenerationRequest

    serve = plan.stages[-1]
    sched = serve.build(cfg, serve.inputs(context), plan.env).scheduler  # warmed up; nothing listens
    prompts = encode_prompts(cfg, context["target"])[:n]
    clock, cuda = sched.dec.clock, torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mean_len = sum(map(len, prompts)) / len(prompts)
    lines = [f"{len(prompts)} joins a pass into slot 0 of {cfg.serve.max_batch_size}, prompts of {mean_len:.0f} tokens"]

    def one_pass(name: str, temperature: float) -> None:
        clock.reset()
        walls = []
        for p in prompts:
            req = GenerationRequest(p, 4, lambda ev: None, temperature, 1.0, seed=1)
            sync()
            t0 = time.perf_counter()
            sched._join([req], [0])
            sync()
            walls.append(1e3 * (time.perf_counter() - t0))
            sched._release(0, req, "abort")
        ms = {key: 1e3 * v / len(prompts) for key, v in clock.totals().items()}
        walls.sort()
        lines.append(
            f"  {name:<16} wall ms {sum(walls) / len(walls):7.2f} (median {walls[len(walls) // 2]:.2f}, max "
            f"{walls[-1]:.2f}); stream ms prefill {ms.get('join_target', 0):.2f}, start {ms.get('join_draft', 0):.2f}"
        )

    with torch.inference_mode():
        one_pass("greedy, new", 0.0)
        one_pass("greedy, warm", 0.0)
        one_pass("temperature 1", 1.0)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with _Ranges(sched.dec), profile(activities=acts) as prof:
            one_pass("greedy, profiled", 0.0)
    unit = "kernels" if cuda else "cpu ops"
    for phase, (count, us) in sorted(_phase_table(prof, cuda).items()):
        lines.append(f"  {phase:<16} {unit} a join {count / len(prompts):7.1f}, us a join {us / len(prompts):9.1f}")
    if kernels:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        lines.append(prof.key_averages().table(sort_by=key, row_limit=kernels, max_name_column_width=70))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "profile"))
    ap.add_argument("--prompts", type=int, default=4, help="prompts profiled per generator (--joins: a pass)")
    ap.add_argument("--kernels", type=int, default=0, help="also print the N kernels with the most time")
    ap.add_argument("--joins", action="store_true", help="a serve config's joins instead of its rounds")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        fixed = ["tracking=off"] + (["serve.port=0"] if args.joins else [])  # nothing listens: any free port
        cfg = to_run_config(compose(config_name="config", overrides=[*fixed, *args.overrides]))
    plan = build_plan(cfg)
    env, context = plan.env, {}
    for stage in plan.stages[:-1]:  # load, aux capture, graph capture: what the final stage gets
        context.update(stage.run(cfg, stage.inputs(context), env))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.joins:
        text = profile_joins(cfg, plan, context, args.prompts, args.kernels)
        print(text, flush=True)
        (out / "joins.txt").write_text(text + "\n")
        return
    target, graphs, e = context["target"], context.get("graphs"), cfg.eval
    encoded = encode_prompts(cfg, target)
    params = SamplingParams(e.temperature, e.top_p, e.max_new_tokens, ignore_eos=e.ignore_eos)
    n, batch = min(args.prompts, len(encoded)), e.batch_size
    rng = torch.Generator(device=env.device).manual_seed(cfg.seed)
    k = cfg.draft.k
    runs = [("no draft", Generator(target.model, batch, graphs=graphs))]
    if env.draft_plan is not None:
        draft = make_draft(
            env.draft_plan, context.get("draft_head"), target.model, batch, k, cfg=cfg.draft, graphs=graphs
        )
        runs.append((f"{cfg.draft.algorithm} k={k}", Generator(target.model, batch, draft, k, graphs=graphs)))
    cuda = torch.cuda.is_available()
    text = [
        f"{cfg.experiment_name}: {e.dataset} x{n}, batch {batch}, {e.max_new_tokens} new tokens, graph "
        f"{cfg.graph.target}/{cfg.graph.draft}, {torch.cuda.get_device_name() if cuda else 'cpu'}"
    ]
    for name, gen in runs:
        gen.generate(encoded[:batch], params, target.tokenizer.eos_token_ids, rng)  # warm-up
        prof, results, wall = _profile(gen, encoded, params, target, rng, batch, n)
        text.append(report(name, gen, prof, results, wall, cuda))
        if args.kernels:
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            text.append(prof.key_averages().table(sort_by=key, row_limit=args.kernels, max_name_column_width=70))
        if os.environ.get("PROFILE_TRACE"):
            prof.export_chrome_trace(str(out / f"trace_{name.split()[0]}.json"))
    print("\n".join(text), flush=True)
    (out / "rounds.txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
