"""Stage `eval`: generate over a prompt set, measure, and log per-prompt results and metrics.

Prompts go through the tokenizer's chat template, are checked against the KV cache length before any
generation, and run in batches of `eval.batch_size` in dataset order. Timings come from
`engine.generate` (host wall clock at each step's device->host copy), so they include everything a
user waits for. Metrics (names from the design):

    tokens_per_s      generated tokens / generation wall time, whole prompt set
    ttft_ms, tpot_ms  mean time to first token; mean time per output token after the first
    generated_tokens, peak_mem_mb
    peer_tokens_per_s.<peer>, ratio_vs.<peer>, peer_match.<peer>   with eval.peers

Artifacts: `results.jsonl` (one line per prompt) and the summary printed at the end.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.errors import ConfigError
from engine.generate import Generator, SequenceResult, check_capacity
from engine.loading import LoadedModel
from engine.peers import PEERS
from engine.prompts import Prompt, check_dataset, load_prompts
from engine.sampling import SamplingParams
from stages.base import Stage, StageEnv, register_stage


@dataclass
class EvalRecord:
    prompt: Prompt
    prompt_tokens: int
    result: SequenceResult
    text: str

    def to_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "id": self.prompt.id, "category": self.prompt.category, "prompt_tokens": self.prompt_tokens,
            "output": self.text, "tokens": len(r.tokens), "finish_reason": r.finish_reason,
            "ttft_ms": 1e3 * r.ttft_s, "time_s": r.ttft_s + r.decode_s, "token_ids": r.tokens,
        }


def sampling_params(e) -> SamplingParams:
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens,
                          ignore_eos=e.ignore_eos)


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


@register_stage
class EvalStage(Stage):
    name = "eval"
    requires = ("target",)
    provides = ("eval_results",)
    final = True

    def check(self, cfg, env: StageEnv) -> None:
        e = cfg.eval
        check_dataset(e.dataset)
        for key, value, ok, valid in [
            ("eval.limit", e.limit, e.limit is None or e.limit >= 1, ">= 1, or null for all"),
            ("eval.max_new_tokens", e.max_new_tokens, e.max_new_tokens >= 1, ">= 1"),
            ("eval.batch_size", e.batch_size, e.batch_size >= 1, ">= 1"),
            ("eval.temperature", e.temperature, e.temperature >= 0, ">= 0 (0: greedy)"),
            ("eval.top_p", e.top_p, 0 < e.top_p <= 1, "in (0, 1]"),
        ]:
            if not ok:
                raise ConfigError(key, value, "out of range", valid)
        if e.max_new_tokens >= cfg.model.max_seq_len:
            raise ConfigError("eval.max_new_tokens", e.max_new_tokens,
                              f"leaves no room for a prompt in model.max_seq_len={cfg.model.max_seq_len}",
                              f"< {cfg.model.max_seq_len}, or a larger model.max_seq_len")
        for peer in e.peers:
            if peer not in PEERS:
                raise ConfigError("eval.peers", peer, "unknown peer", sorted(PEERS))

    def describe(self, cfg, env: StageEnv) -> str:
        e = cfg.eval
        mode = "greedy" if e.temperature == 0 else f"temperature {e.temperature}, top_p {e.top_p}"
        peers = f", peers {list(e.peers)}" if e.peers else ""
        return (f"{e.dataset} (limit {e.limit}), batch {e.batch_size}, {e.max_new_tokens} new tokens, "
                f"{mode}{', ignore_eos' if e.ignore_eos else ''}{peers}")

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        target: LoadedModel = inputs["target"]
        e, tok = cfg.eval, target.tokenizer
        prompts = load_prompts(e.dataset, e.limit)
        encoded = [tok.encode_chat(p.text, e.system_prompt) if e.chat_template else tok.encode(p.text)
                   for p in prompts]
        check_capacity([len(x) for x in encoded], e.max_new_tokens, cfg.model.max_seq_len)
        params = sampling_params(e)
        gen = Generator(target.model, e.batch_size)
        rng = torch.Generator(device=env.device).manual_seed(cfg.seed)
        if e.warmup:
            gen.generate(encoded[: e.batch_size], SamplingParams(max_new_tokens=4), tok.eos_token_ids, rng)
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)

        records: list[EvalRecord] = []
        wall = 0.0
        bar = tqdm(total=len(prompts), desc="eval", unit="prompt", dynamic_ncols=True)
        for i in range(0, len(prompts), e.batch_size):
            batch = encoded[i: i + e.batch_size]
            t0 = time.perf_counter()
            results = gen.generate(batch, params, tok.eos_token_ids, rng)
            wall += time.perf_counter() - t0
            for p, x, r in zip(prompts[i: i + e.batch_size], batch, results):
                records.append(EvalRecord(p, len(x), r, tok.decode(r.tokens)))
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{sum(len(r.result.tokens) for r in records) / wall:.1f}")
        bar.close()

        generated = sum(len(r.result.tokens) for r in records)
        metrics = {
            "tokens_per_s": generated / wall,
            "ttft_ms": 1e3 * _mean([r.result.ttft_s for r in records]),
            "tpot_ms": 1e3 * _mean([r.result.tpot_s for r in records if r.result.tpot_s is not None]),
            "generated_tokens": generated,
            "peak_mem_mb": _peak_mem_mb(env.device),
            "num_prompts": len(records),
            "generation_s": wall,
        }
        for name in e.peers:
            metrics.update(self._run_peer(name, target, encoded, params, records, e.batch_size, env, cfg.seed))
            metrics[f"ratio_vs.{name}"] = metrics["tokens_per_s"] / metrics[f"peer_tokens_per_s.{name}"]

        tracker = env.tracker
        if tracker is not None:
            tracker.log_metrics(metrics)
            tracker.log_text("\n".join(json.dumps(r.to_json()) for r in records) + "\n", "results.jsonl")
        print(summary_table(cfg, env, metrics))
        return {"eval_results": {"metrics": metrics, "records": records}}

    @staticmethod
    def _run_peer(name, target, encoded, params, records, batch_size, env, seed) -> dict[str, float]:
        print(f"[eval] peer {name} on the same {len(encoded)} prompts...", flush=True)
        res = PEERS[name](target, encoded, params, batch_size, target.tokenizer.eos_token_ids,
                          env.device, env.dtype, seed)
        peer_tps = res.generated_tokens / res.wall_s
        out = {f"peer_tokens_per_s.{name}": peer_tps, f"peer_generated_tokens.{name}": res.generated_tokens}
        if params.greedy:
            same = sum(r.result.tokens == o for r, o in zip(records, res.outputs))
            out[f"peer_match.{name}"] = same / len(records)
        return out


def summary_table(cfg, env: StageEnv, metrics: dict[str, float]) -> str:
    rows = [("model", cfg.model.name), ("device", f"{env.device} {str(env.dtype).removeprefix('torch.')}"),
            ("dataset", f"{cfg.eval.dataset} x{metrics['num_prompts']}"), ("batch size", cfg.eval.batch_size)]
    rows += [(k, f"{v:.4g}" if isinstance(v, float) else v) for k, v in metrics.items() if k != "num_prompts"]
    width = max(len(str(k)) for k, _ in rows)
    line = "-" * (width + 24)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])
