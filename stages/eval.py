"""Stage `eval`: generate over a prompt set, with the configured draft, and measure against peers.

Prompts go through the tokenizer's chat template (or come as token ids, optionally with input
embeddings), are checked against the KV cache and the vocabulary at plan time (`check`: the tokenizer
alone, before any weight loads; again before generating), and run in batches of
`eval.batch_size` in dataset order. With a draft, `eval.baseline` (default on) also runs the no-draft
baseline on the same prompts, batch by batch beside the draft pass (alternating which goes first), so the
job reports its own speedup, with its spread, and whether the output is unchanged.

Metrics (names from the design):

    tokens_per_s, ttft_ms, tpot_ms, generated_tokens, peak_mem_mb
    accept_length            mean tokens emitted per verify round, bonus included
    accept_rate_pos_<i>      fraction of verify rounds whose draft token i was accepted
    draft_ms, verify_ms      mean time per round of the draft (chain + extend) and of the verify (forward +
                             accept): stream time between CUDA events at the phase boundaries, read at the
                             round's own sync (engine/speculative/phase_clock.py); extend_ms: the extend alone
    host_ms                  mean stream idle between two rounds of a batch (the host's sync and bookkeeping)
    k_mean                   mean draft tokens per round (draft.num_steps, or with eval.adaptive_k what
                             the load chose; adaptive_k.b<rows>: its choice per capture size at the start)
    baseline_tokens_per_s, speedup, match_baseline      with eval.baseline
    speedup_min, speedup_max, round_cost_spread         per batch (engine/speculative/timing.py), from two batches
    host_other_cores         CPU cores other processes kept busy during the passes (a WARNING when noisy)
    baseline_step_ms, baseline_host_ms                  its decode step and the idle between steps
    peer_tokens_per_s.<peer>, ratio_vs.<peer>, peer_match.<peer>   with eval.peers

Artifacts: `results.jsonl` (one line per prompt), `figures/*.png` (pipeline/figures.py: acceptance per
position, time per phase of a round, tokens/s against the baseline and peers, each where measured) and
the summary printed at the end, followed by where the artifacts went.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from engine.drafts.registry import DRAFTS, make_draft
from engine.errors import ConfigError, ConfigErrors, check_values, raised
from engine.loading import LoadedModel, load_tokenizer
from engine.peers.hf import GREEDY_PEERS, PEERS
from engine.prompts import Prompt, check_dataset, load_prompts
from engine.sampling import SamplingParams, row_seed
from engine.speculative.generate import Generator, SequenceResult, check_capacity
from engine.speculative.timing import (
    BatchTiming,
    HostLoad,
    fmt_range,
    noise_warning,
    per_batch_speedups,
    unit_cost_spread,
)
from engine.tokenizer import Tokenizer
from stages.base import Stage, StageEnv, register_stage


@dataclass
class EvalRecord:
    prompt: Prompt
    prompt_tokens: int
    result: SequenceResult
    text: str

    def to_json(self) -> dict[str, Any]:
        r = self.result
        out = {
            "id": self.prompt.id,
            "category": self.prompt.category,
            "prompt_tokens": self.prompt_tokens,
            "output": self.text,
            "tokens": len(r.tokens),
            "finish_reason": r.finish_reason,
            "ttft_ms": 1e3 * r.ttft_s,
            "time_s": r.ttft_s + r.decode_s,
            "token_ids": r.tokens,
        }
        if r.accepts:
            out["accept_length"] = statistics.fmean(a + 1 for a in r.accepts)
        return out


@dataclass
class EvalPrompts:
    prompts: list[Prompt]
    encoded: list[list[int]]
    embeds: Optional[list[Optional[torch.Tensor]]]  # per prompt [len, hidden], or None for all


def sampling_params(e) -> SamplingParams:
    return SamplingParams(
        temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens, ignore_eos=e.ignore_eos
    )


def baseline_on(cfg) -> bool:
    return cfg.eval.baseline if cfg.eval.baseline is not None else cfg.draft.algorithm != "none"


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def encode_prompt(p: Prompt, tok: Tokenizer, e) -> list[int]:
    if p.token_ids is not None:
        return list(p.token_ids)
    return tok.encode_chat(p.text, e.system_prompt) if e.chat_template else tok.encode(p.text)


def prompt_errors(cfg, tok: Tokenizer, vocab_size: int, hidden: int = 0) -> list[ConfigError]:
    """Plan time, through the tokenizer alone: given token ids inside the target's vocabulary, and every
    prompt + eval.max_new_tokens + k draft tokens (the last verify writes k slots past the last token)
    within model.max_seq_len. At most one error of each kind, naming the dataset's first bad record or
    its longest prompt, the tokens, the limit and what would fit."""
    e, limit, k = cfg.eval, cfg.model.max_seq_len, cfg.draft.k
    prompts = load_prompts(e.dataset, e.limit)
    encoded = [encode_prompt(p, tok, e) for p in prompts]
    errors = []
    bad_ids = [i for i, x in enumerate(encoded) if any(not 0 <= t < vocab_size for t in x)]
    if bad_ids:
        i = bad_ids[0]
        errors.append(
            ConfigError(
                "eval.dataset",
                e.dataset,
                f"record {i + 1} (question_id {prompts[i].id!r}): prompt_token_ids "
                f"{[t for t in encoded[i] if not 0 <= t < vocab_size][:5]} outside the target's vocabulary"
                + (f"; {len(bad_ids) - 1} more records too" if len(bad_ids) > 1 else ""),
                f"ids in [0, {vocab_size})",
            )
        )
    embeds = [(p, why) for p in prompts if (why := p.embeds_problem(hidden)) is not None]
    if embeds:
        errors.append(ConfigError("eval.dataset", e.dataset, f"question_id {embeds[0][0].id!r}: {embeds[0][1]}"))
    lens = [len(x) for x in encoded]
    over = [i for i, n in enumerate(lens) if n + e.max_new_tokens + k > limit]
    if not over:
        return errors
    worst = max(over, key=lambda i: lens[i])
    others = f"; {len(over) - 1} more records do not fit either" if len(over) > 1 else ""
    need, room = lens[worst] + e.max_new_tokens + k, limit - e.max_new_tokens - k
    fixes = [f"eval.max_new_tokens <= {limit - lens[worst] - k}"] if limit - lens[worst] - k >= 1 else []
    fixes += [f"model.max_seq_len >= {need}"]
    if room >= 1:
        fixes.append(f"prompts of at most {room} tokens (a shorter prompt, or eval.limit to leave it out)")
    return errors + [
        ConfigError(
            "eval.dataset",
            e.dataset,
            f"record {worst + 1} (question_id {prompts[worst].id!r}) has {lens[worst]} prompt tokens: + "
            f"eval.max_new_tokens={e.max_new_tokens}"
            + (f" + draft.num_steps={k}" if k else "")
            + f" = {need} KV slots, beyond model.max_seq_len={limit}{others}",
            " or ".join(fixes),
        )
    ]


def encode_prompts(cfg, target: LoadedModel) -> EvalPrompts:
    e, tok = cfg.eval, target.tokenizer
    prompts = load_prompts(e.dataset, e.limit)
    encoded, embeds = [], []
    hidden = target.model.args.hidden_size
    for p in prompts:
        encoded.append(encode_prompt(p, tok, e))
        x = p.load_embeds()
        if x is not None and tuple(x.shape) != (len(encoded[-1]), hidden):
            raise ConfigError(
                "eval.dataset",
                e.dataset,
                f"prompt {p.id}: input_embeds of shape {tuple(x.shape)}",
                f"[{len(encoded[-1])}, {hidden}] (prompt_token_ids x target hidden)",
            )
        embeds.append(x)
    check_capacity(
        [len(x) for x in encoded],
        e.max_new_tokens,
        cfg.model.max_seq_len,
        cfg.draft.k,
    )
    return EvalPrompts(prompts, encoded, embeds if any(x is not None for x in embeds) else None)


@dataclass
class Pass:
    """One generator over the prompt set: its records, each batch's timing, and its outputs by prompt
    index (filled batch by batch: the oracle draft replays the baseline's)."""

    name: str
    gen: Generator
    outputs: list[Optional[list[int]]]
    records: list[EvalRecord] = field(default_factory=list)
    batches: list[BatchTiming] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return sum(b.seconds for b in self.batches)


def generate_all(
    passes: list[Pass],
    data: EvalPrompts,
    params: SamplingParams,
    target: LoadedModel,
    seed: int,
    batch_size: int,
    alternate: bool = False,
) -> None:
    """Every prompt through each pass, batch by batch (with `alternate`, odd batches run the passes in
    reverse order: drift and load hit both alike); prompt i samples with `row_seed(seed, i)`, so its
    output does not depend on the batch size. Ctrl-C or an error leaves the last pass's records
    finished so far on the exception (`partial_records`, with the pass's name) for the stage to keep."""
    tok, main = target.tokenizer, passes[-1]
    bar = tqdm(total=len(data.prompts), desc=main.name, unit="prompt", dynamic_ncols=True)
    try:
        for j, i in enumerate(range(0, len(data.prompts), batch_size)):
            batch = data.encoded[i : i + batch_size]
            embeds = data.embeds[i : i + batch_size] if data.embeds is not None else None
            for p in reversed(passes) if alternate and j % 2 else passes:
                rounds0, t0 = p.gen.rounds, time.perf_counter()
                ids = list(range(i, i + len(batch)))
                seeds = [row_seed(seed, r) for r in ids]
                results = p.gen.generate(
                    batch, params, tok.eos_token_ids, prompt_embeds=embeds, row_ids=ids, seeds=seeds
                )
                wall = time.perf_counter() - t0
                p.batches.append(BatchTiming(sum(len(r.tokens) for r in results), wall, p.gen.rounds - rounds0))
                p.outputs[i : i + len(batch)] = [r.tokens for r in results]
                for prompt, x, r in zip(data.prompts[i : i + batch_size], batch, results):
                    p.records.append(EvalRecord(prompt, len(x), r, tok.decode(r.tokens)))
            bar.update(len(batch))
            bar.set_postfix(
                {f"{p.name} tok/s": f"{sum(b.tokens for b in p.batches) / p.wall:.3g}" for p in reversed(passes)}
            )
    except BaseException as e:
        e.partial_records = (main.records, main.name)
        raise
    finally:
        bar.close()


def throughput_metrics(records: list[EvalRecord], wall: float) -> dict[str, float]:
    generated = sum(len(r.result.tokens) for r in records)
    return {
        "tokens_per_s": generated / wall,
        "ttft_ms": 1e3 * _mean(r.result.ttft_s for r in records),
        "tpot_ms": 1e3 * _mean(r.result.tpot_s for r in records if r.result.tpot_s is not None),
        "generated_tokens": generated,
        "num_prompts": len(records),
        "generation_s": wall,
    }


def draft_metrics(records: list[EvalRecord], gen: Generator, k: int) -> dict[str, float]:
    accepts = [a for r in records for a in r.result.accepts]
    stats = gen.stats
    rounds = max(stats.rounds, 1)
    out = {
        "accept_length": _mean(a + 1 for a in accepts),
        "verify_rounds": len(accepts),
        "k_mean": sum(kk * n for kk, n in gen.ks_used.items()) / max(sum(gen.ks_used.values()), 1),
        "draft_ms": 1e3 * stats.draft_s / rounds,
        "verify_ms": 1e3 * stats.verify_s / rounds,
        "extend_ms": 1e3 * stats.extend_s / rounds,
        "host_ms": 1e3 * stats.host_s / rounds,
    }
    out.update({f"accept_rate_pos_{i}": _mean(a > i for a in accepts) for i in range(k)})
    return out


@register_stage
class EvalStage(Stage):
    name = "eval"
    requires = ("target", "draft_head")
    optional = ("graphs",)
    provides = ("eval_results",)
    final = True
    runs_target = True

    def kv_rows(self, cfg) -> tuple[str, int]:
        return "eval.batch_size", cfg.eval.batch_size

    def check(self, cfg, env: StageEnv) -> None:
        """Every bad value together; then, when the values hold, the prompts against the KV cache."""
        e = cfg.eval
        check_dataset(e.dataset)  # a dataset that cannot be read stops here
        errors = raised(self._check_values, cfg, env)
        measurable = not {x.key for x in errors} & {"eval.limit", "eval.max_new_tokens"}  # what the check reads
        if measurable and 1 <= e.max_new_tokens < cfg.model.max_seq_len:
            tok = load_tokenizer(cfg.model, env.weights_dir, env.target_args)
            errors += prompt_errors(cfg, tok, env.target_args.vocab_size, env.target_args.hidden_size)
        if len(errors) > 1:
            raise ConfigErrors(errors)
        if errors:
            raise errors[0]

    @staticmethod
    def _check_values(cfg, env: StageEnv) -> None:
        e = cfg.eval
        check_values(
            [
                ("eval.limit", e.limit, e.limit is None or e.limit >= 1, ">= 1, or null for all"),
                ("eval.max_new_tokens", e.max_new_tokens, e.max_new_tokens >= 1, ">= 1"),
                ("eval.batch_size", e.batch_size, e.batch_size >= 1, ">= 1"),
                ("eval.temperature", e.temperature, 0 <= e.temperature < math.inf, ">= 0 and finite (0: greedy)"),
                ("eval.top_p", e.top_p, 0 < e.top_p <= 1, "in (0, 1]"),
                (
                    "eval.adaptive_k",
                    e.adaptive_k,
                    not e.adaptive_k or env.draft_plan is not None,
                    "false without a draft (k is 0)",
                ),
            ]
        )
        if e.max_new_tokens >= cfg.model.max_seq_len:
            raise ConfigError(
                "eval.max_new_tokens",
                e.max_new_tokens,
                f"leaves no room for a prompt in model.max_seq_len={cfg.model.max_seq_len}",
                f"< {cfg.model.max_seq_len}, or a larger model.max_seq_len",
            )
        for peer in e.peers:
            if peer not in PEERS:
                raise ConfigError("eval.peers", peer, "unknown peer", sorted(PEERS))
            if peer in GREEDY_PEERS and e.temperature > 0:
                raise ConfigError(
                    "eval.peers", peer, f"decodes greedily, and eval.temperature={e.temperature}", "eval.temperature=0"
                )
        spec = DRAFTS.get(cfg.draft.algorithm)
        if spec is not None and spec.needs_baseline:
            if not baseline_on(cfg):
                raise ConfigError(
                    "eval.baseline",
                    e.baseline,
                    f"draft.algorithm={cfg.draft.algorithm} proposes the baseline's own outputs",
                    "true (or null)",
                )
            if e.temperature > 0:
                raise ConfigError(
                    "eval.temperature",
                    e.temperature,
                    f"draft.algorithm={cfg.draft.algorithm} replays greedy outputs",
                    "0",
                )

    def describe(self, cfg, env: StageEnv) -> str:
        e = cfg.eval
        mode = "greedy" if e.temperature == 0 else f"temperature {e.temperature}, top_p {e.top_p}"
        extra = [f"peers {list(e.peers)}"] if e.peers else []
        if env.draft_plan is not None:
            extra.append(
                f"draft {cfg.draft.algorithm} k={cfg.draft.k}" + (" + no-draft baseline" if baseline_on(cfg) else "")
            )
        total = len(load_prompts(e.dataset, None))
        prompts = f"the first {e.limit} of {total} prompts" if e.limit and e.limit < total else f"all {total} prompts"
        return (
            f"{e.dataset}: {prompts}, batch {e.batch_size}, {e.max_new_tokens} new tokens, "
            f"{mode}{', ignore_eos' if e.ignore_eos else ''}" + "".join(f", {x}" for x in extra)
        )

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        try:
            return self._run(cfg, inputs, env)
        except BaseException as e:  # Ctrl-C or a failure mid-pass: keep what finished (the run ends KILLED / FAILED)
            if getattr(e, "partial_records", None) is not None:
                self._keep_partial(
                    env, *e.partial_records, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                )
            raise

    @staticmethod
    def _keep_partial(env: StageEnv, records: list[EvalRecord], desc: str, how: str) -> None:
        where = "not tracked"
        if env.tracker is not None and records:
            env.tracker.log_text("\n".join(json.dumps(r.to_json()) for r in records) + "\n", "results.jsonl")
            where = f"kept in results.jsonl of MLflow run {env.tracker.run_id}"
        print(f"\n[eval] {how} during the {desc} pass: {len(records)} prompts had finished ({where})", flush=True)

    def _run(self, cfg, inputs, env: StageEnv) -> dict:
        target: LoadedModel = inputs["target"]
        e = cfg.eval
        data = encode_prompts(cfg, target)
        params = sampling_params(e)

        metrics: dict[str, float] = {}
        graphs, plan, k = inputs.get("graphs"), env.draft_plan, cfg.draft.k
        n = len(data.prompts)
        base = None
        if baseline_on(cfg):
            base = Pass("baseline", Generator(target.model, e.batch_size, graphs=graphs), [None] * n)
        draft = make_draft(
            plan,
            inputs["draft_head"],
            target.model,
            e.batch_size,
            k,
            references=base.outputs if base is not None else None,  # the oracle's, filled batch by batch
            prompt_lens=[len(x) for x in data.encoded],
            cfg=cfg.draft,
            graphs=graphs,
        )
        cache = base.gen.cache if base is not None and graphs is None else None  # one KV cache for both passes
        gen = Generator(target.model, e.batch_size, draft, k, graphs=graphs, cache=cache)
        main = Pass("eval" if plan is None else f"eval[{plan.algorithm}]", gen, [None] * n)
        if e.adaptive_k and plan is not None:
            sizes = graphs.sizes if graphs is not None else [e.batch_size]
            table = gen.enable_adaptive_k(sizes, sampled=e.temperature > 0).table(sampled=e.temperature > 0)
            metrics.update({f"adaptive_k.b{size}": float(kk) for size, kk in table.items()})
        passes = [base, main] if base is not None else [main]
        replays = plan is not None and plan.spec.needs_baseline  # the oracle replays the baseline: no warmup
        for p in passes:
            if not (replays and p is main):
                self._warmup(p.gen, data, target, e)
            p.gen.reset_stats()
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        counts0 = graphs.metrics() if graphs is not None else {}
        with HostLoad() as load:
            generate_all(passes, data, params, target, cfg.seed, e.batch_size, alternate=not replays)
        records = main.records

        metrics.update(throughput_metrics(records, main.wall))
        metrics["peak_mem_mb"] = _peak_mem_mb(env.device)
        if plan is not None:
            metrics.update(draft_metrics(records, gen, k))
        if graphs is not None:  # replays and fallbacks of both passes
            metrics.update(
                {
                    key: v - counts0[key]
                    for key, v in graphs.metrics().items()
                    if key.startswith(("graph_replays", "graph_fallbacks"))
                }
            )
        speedups: list[float] = []
        if base is not None:
            metrics["baseline_tokens_per_s"] = throughput_metrics(base.records, base.wall)["tokens_per_s"]
            steps = base.gen.stats
            metrics["baseline_step_ms"] = 1e3 * steps.verify_s / max(steps.rounds, 1)
            metrics["baseline_host_ms"] = 1e3 * steps.host_s / max(steps.rounds, 1)
            metrics["speedup"] = metrics["tokens_per_s"] / metrics["baseline_tokens_per_s"]
            speedups = per_batch_speedups(base.batches, main.batches)
            if len(speedups) >= 2:
                metrics["speedup_min"], metrics["speedup_max"] = min(speedups), max(speedups)
                metrics["round_cost_spread"] = unit_cost_spread(base.batches, main.batches)
            if params.greedy:
                same = sum(r.result.tokens == b.result.tokens for r, b in zip(records, base.records))
                metrics["match_baseline"] = same / len(records)
        for name in e.peers:
            metrics.update(self._run_peer(name, target, data.encoded, params, records, e.batch_size, env, cfg.seed))
            metrics[f"ratio_vs.{name}"] = metrics["tokens_per_s"] / metrics[f"peer_tokens_per_s.{name}"]
        if not math.isnan(load.other_cores):
            metrics["host_other_cores"] = load.other_cores
        warning = noise_warning(
            speedups,
            metrics.get("round_cost_spread", float("nan")),
            load.other_cores,
            load.cores,
            env.device.type == "cpu",
            torch.get_num_threads(),
        )

        where = None
        if env.tracker is not None:
            env.tracker.log_metrics(metrics)
            env.tracker.log_text("\n".join(json.dumps(r.to_json()) for r in records) + "\n", "results.jsonl")
            figures = env.tracker.log_figures(metrics)  # acceptance per position, round phases, tokens/s
            where = f"results.jsonl{''.join(', ' + f for f in figures)} in {env.tracker.artifact_dir}"
        print(summary_table(cfg, env, metrics, speedups, warning))
        print(f"[eval] {where or 'tracking off: no results.jsonl or figures written'}", flush=True)
        baseline = base.records if base is not None else None
        return {"eval_results": {"metrics": metrics, "records": records, "baseline": baseline}}

    @staticmethod
    def _warmup(gen: Generator, data: EvalPrompts, target: LoadedModel, e) -> None:
        if e.warmup:
            n = min(e.batch_size, len(data.encoded))
            gen.generate(  # the run's own sampling: its kernels are compiled before the clock starts
                data.encoded[:n],
                SamplingParams(e.temperature, e.top_p, max_new_tokens=4),
                target.tokenizer.eos_token_ids,
                prompt_embeds=data.embeds[:n] if data.embeds is not None else None,
                seeds=list(range(n)),
            )

    @staticmethod
    def _run_peer(name, target, encoded, params, records, batch_size, env, seed) -> dict[str, float]:
        print(f"[eval] peer {name} on the same {len(encoded)} prompts...", flush=True)
        res = PEERS[name](
            target, encoded, params, batch_size, target.tokenizer.eos_token_ids, env.device, env.dtype, seed
        )
        out = {
            f"peer_tokens_per_s.{name}": res.generated_tokens / res.wall_s,
            f"peer_generated_tokens.{name}": res.generated_tokens,
            f"peer_warmup_s.{name}": res.warmup_s,
        }
        if params.greedy:
            same = sum(r.result.tokens == o for r, o in zip(records, res.outputs))
            out[f"peer_match.{name}"] = same / len(records)
        return out


TIMED = ("_ms", "_s", "tokens_per_s", "peak_mem_mb", "host_other_cores", "speedup_min", "speedup_max")


def _fmt_metric(key: str, v, speedups: list[float]) -> str:
    """A figure to the digits it has: timings to 3 significant digits, the speedup to its spread's."""
    if key == "speedup":
        return fmt_range(v, speedups)
    if key == "round_cost_spread":
        return f"{v:.0%}"
    if isinstance(v, float):
        return f"{v:.3g}" if key.endswith(TIMED) or key.startswith(("ratio_vs.", "peer_tokens_per_s.")) else f"{v:.4g}"
    return str(v)


def summary_table(
    cfg, env: StageEnv, metrics: dict[str, float], speedups: list[float] = (), noise: Optional[str] = None
) -> str:
    rows = [
        ("model", cfg.model.name),
        ("device", f"{env.device} {str(env.dtype).removeprefix('torch.')}"),
        (
            "draft",
            f"{cfg.draft.algorithm}"
            + (f" k={cfg.draft.k}" if env.draft_plan else "")
            + (" (random weights)" if env.draft_plan is not None and env.draft_plan.random_weights else ""),
        ),
        ("dataset", f"{cfg.eval.dataset} x{metrics['num_prompts']}"),
        ("batch size", cfg.eval.batch_size),
    ]
    hidden = ("num_prompts", "speedup_min", "speedup_max")  # the last two: on the speedup's own row
    rows += [(k, _fmt_metric(k, v, list(speedups))) for k, v in metrics.items() if k not in hidden]
    width = max(len(str(k)) for k, _ in rows)
    line = "-" * (width + 24)
    plan = env.draft_plan
    notes = [f"WARNING: {plan.random_weights_warning()}"] if plan is not None and plan.random_weights else []
    notes += [noise] if noise else []
    if env.device.type == "cpu" and "speedup" in metrics:
        notes.append(
            "note: a CPU run shows acceptance and that the output is the target's; its speedup is not a GPU's "
            "(README, On a CPU)"
        )
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line, *notes])
