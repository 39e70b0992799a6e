"""Stage `serve` (task=serve): the validated plan ends in an OpenAI-compatible server instead of an eval.

    load -> configure_aux_capture -> capture_graphs -> serve

The stage builds the draft for `serve.max_batch_size` slots (over the graphs' caches when there are
graphs), the continuous-batching scheduler (engine/serve/scheduler.py: the same draft-and-verify round as
eval) in this process and the HTTP app (engine/serve/openai_server.py, under uvicorn) in a child process
(engine/serve/http.py; the two joined by engine/serve/link.py: they share no GIL), and serves
on `serve.host:serve.port` (checked free at plan time; `serve.api_key` or $SPECPIPE_API_KEY: Bearer
authentication; a loud warning when a non-loopback host has no key) until Ctrl-C, which drains (new
requests get 503 with Retry-After, in-flight ones finish; a second Ctrl-C aborts them) before the stage
returns and the MLflow run closes normally.

Each request samples with its own temperature, top-p and seed (the draft under them too, lossless: see
engine/serve/scheduler.py), and may opt out of speculation; the oracle draft replays an eval baseline's
outputs and has no place here.

Logs at the end: `requests`, `requests_<finish_reason>`, `prompt_tokens`, `generated_tokens`,
`tokens_per_s` (generated over `busy_s`, the time with at least one request in flight: idle time between
requests left out), `accept_length`,
`accept_rate_pos_<i>`, `rounds`, `graph_replays` / `graph_fallbacks` (totals and `.<phase>`).
Provides `serve_results` (those metrics).
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from engine.drafts.registry import ALGORITHMS, DRAFTS, make_draft
from engine.errors import ConfigError, check_values
from engine.loading import LoadedModel
from engine.serve.scheduler import Scheduler, ServeStats
from engine.speculative.generate import SpecDecoder
from stages.base import Stage, StageEnv, register_stage

if TYPE_CHECKING:  # the HTTP side (fastapi, uvicorn) is imported when a server is built: every run imports stages
    from engine.serve.http import OpenAIServer

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def address(s) -> str:
    """Where the server listens; port 0 is any free one, printed once the server is up."""
    return f"http://{s.host}:{s.port}/v1" if s.port else f"http://{s.host}:<a free port, printed when up>/v1"


def model_name(cfg) -> str:
    return cfg.serve.model_name or cfg.model.name


API_KEY_ENV = "SPECPIPE_API_KEY"


def api_key(cfg) -> Optional[str]:
    """serve.api_key, else $SPECPIPE_API_KEY, else None (no authentication)."""
    return cfg.serve.api_key if cfg.serve.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def listen_error(host: str, port: int) -> Optional[ConfigError]:
    """Why the server could not listen on host:port (None: it can), found by binding it for a moment: the
    host's (it does not resolve, or is no address of this machine) or the port's (in use, privileged)."""
    import errno
    import socket

    where = "an address of this host: 127.0.0.1, or 0.0.0.0 for every interface"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return ConfigError("serve.host", host, f"does not resolve ({e.strerror or e})", where)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return ConfigError("serve.host", host, f"cannot listen there ({e.strerror})", where)
            return ConfigError(
                "serve.port", port, f"cannot listen on {host}:{port} ({e.strerror or e})", "a free port, or 0 (any)"
            )
    return None


# the decoder's phase clock (stream time between CUDA events) -> the summary's names
STREAM_PHASES = {
    "join_target": "prefill_target_s",
    "join_draft": "prefill_draft_s",
    "draft": "draft_s",
    "extend": "extend_s",
    "verify": "verify_s",
    "host": "host_gap_s",
}


def serve_metrics(
    stats: ServeStats, graphs, phases: Optional[dict[str, float]] = None, http_cpu_s: Optional[float] = None
) -> dict[str, float]:
    """The served run's summary. phases: the decoder's clock totals (seconds of stream time by phase):
    where the joins' and rounds' host wall time (prefill_s, round_s, emit_s) went on the device.
    http_cpu_s: the HTTP front process's CPU time, beside the engine thread's."""
    out = {
        "requests": sum(stats.finished.values()),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "rounds": stats.rounds,
        "prefills": stats.prefills,  # joins: a group of requests joining together is one
        "prefill_s": stats.prefill_s,
        "round_s": stats.round_s,
        "emit_s": stats.emit_s,
        "engine_cpu_s": stats.engine_cpu_s,
        **({"http_cpu_s": http_cpu_s} if http_cpu_s is not None else {}),
    }
    out.update({name: phases[key] for key, name in STREAM_PHASES.items() if key in (phases or {})})
    out.update({f"requests_{reason}": n for reason, n in stats.finished.items()})
    busy = stats.busy_time(time.perf_counter())
    if busy > 0:  # over the time with a request in flight: an idle server does not dilute it
        out["busy_s"] = busy
        out["tokens_per_s"] = stats.generated_tokens / busy
    if stats.rounds:
        out["k_mean"] = sum(k * n for k, n in stats.rounds_by_k.items()) / stats.rounds
    if stats.row_rounds:
        out["accept_length"] = stats.accept_length
        out.update({f"accept_rate_pos_{i}": r for i, r in enumerate(stats.accept_rates())})
    if graphs is not None:
        out.update({k: v for k, v in graphs.metrics().items() if k.startswith(("graph_replays", "graph_fallbacks"))})
    return out


@register_stage
class ServeStage(Stage):
    name = "serve"
    requires = ("target", "draft_head")
    optional = ("graphs",)
    provides = ("serve_results",)
    final = True
    runs_target = True

    def kv_rows(self, cfg) -> tuple[str, int]:
        return "serve.max_batch_size", cfg.serve.max_batch_size

    def __init__(self):
        self.server: OpenAIServer | None = None  # set while serving (tests and embedders stop it)

    def check(self, cfg, env: StageEnv) -> None:
        s, k = cfg.serve, cfg.draft.k
        check_values(
            [
                ("serve.host", s.host, bool(s.host), "an address to bind, e.g. 127.0.0.1"),
                ("serve.port", s.port, 0 <= s.port <= 65535, "0..65535 (0: any free port)"),
                ("serve.max_batch_size", s.max_batch_size, s.max_batch_size >= 1, ">= 1"),
                ("serve.max_queue", s.max_queue, s.max_queue >= 0, ">= 0"),
                ("serve.max_prefill_tokens", s.max_prefill_tokens, s.max_prefill_tokens >= 1, ">= 1"),
                ("serve.join_rows", s.join_rows, s.join_rows >= 1, ">= 1 (prompts a prefill replay takes)"),
                ("serve.stream_interval", s.stream_interval, s.stream_interval >= 1, ">= 1 (tokens a chunk)"),
                ("serve.max_tokens_limit", s.max_tokens_limit, s.max_tokens_limit >= 1, ">= 1"),
                (
                    "serve.default_max_tokens",
                    s.default_max_tokens,
                    1 <= s.default_max_tokens <= s.max_tokens_limit,
                    f"1..serve.max_tokens_limit={s.max_tokens_limit}",
                ),
                (
                    "serve.default_temperature",
                    s.default_temperature,
                    0 <= s.default_temperature <= 2,
                    "in [0, 2] (0: greedy)",
                ),
                ("serve.drain_timeout_s", s.drain_timeout_s, s.drain_timeout_s >= 0, ">= 0"),
                ("serve.log_level", s.log_level, s.log_level in LOG_LEVELS, LOG_LEVELS, "unknown"),
                ("serve.api_key", "***", s.api_key != "", "a token, or null (none; or $SPECPIPE_API_KEY)", "empty"),
                ("serve.model_name", s.model_name, s.model_name != "", "a name, or null (model.name)", "empty"),
            ]
        )
        if (error := listen_error(s.host, s.port)) is not None:  # the values above are in range
            raise error
        if cfg.model.max_seq_len < k + 2:
            raise ConfigError(
                "model.max_seq_len",
                cfg.model.max_seq_len,
                f"leaves no room for a prompt and a token with draft.num_steps={k}",
                f">= {k + 2}",
            )
        spec = DRAFTS.get(cfg.draft.algorithm)
        if spec is not None and spec.needs_baseline:
            raise ConfigError(
                "draft.algorithm",
                cfg.draft.algorithm,
                "replays an eval baseline's outputs; a server has none",
                [a for a in ALGORITHMS if not (a in DRAFTS and DRAFTS[a].needs_baseline)],
            )

    def describe(self, cfg, env: StageEnv) -> str:
        s = cfg.serve
        draft = (
            f"draft {cfg.draft.algorithm} k={cfg.draft.k} (greedy proposals)"
            if env.draft_plan is not None
            else "no draft"
        )
        return (
            f"{address(s)} (OpenAI API) model {model_name(cfg)!r}; {s.max_batch_size} slots "
            f"(continuous batching), queue {s.max_queue}; max_tokens default {s.default_max_tokens}, limit "
            f"{s.max_tokens_limit}; context {cfg.model.max_seq_len}; {draft}"
        )

    def build(self, cfg, inputs, env: StageEnv) -> OpenAIServer:
        from engine.serve.guard import is_loopback
        from engine.serve.http import FrontSpec, OpenAIServer
        from engine.serve.protocol import ApiLimits

        target: LoadedModel = inputs["target"]
        s, graphs, plan = cfg.serve, inputs.get("graphs"), env.draft_plan
        rng = torch.Generator().manual_seed(cfg.seed)  # the seeds of requests without one (host-side)
        k = cfg.draft.k
        draft = make_draft(plan, inputs["draft_head"], target.model, s.max_batch_size, k, cfg=cfg.draft, graphs=graphs)
        decoder = SpecDecoder(target.model, s.max_batch_size, draft, k, graphs=graphs)
        if s.adaptive_k and k > 0:
            sizes = graphs.sizes if graphs is not None else [s.max_batch_size]
            policy = decoder.enable_adaptive_k(sizes, sampled=True)  # requests may sample: both variants
            table, sampled = policy.table(), policy.table(sampled=True)
            line = f"[serve] adaptive k at the start (rows -> draft tokens): greedy {table}, sampled {sampled}"
            print(line, flush=True)
            print(f"[serve] adaptive k at the start, {policy.describe(s.max_batch_size)}", flush=True)
            if env.tracker is not None:
                env.tracker.log_metrics({f"adaptive_k.b{size}": float(kk) for size, kk in table.items()})
                env.tracker.log_metrics({f"adaptive_k_sampled.b{size}": float(kk) for size, kk in sampled.items()})
        scheduler = Scheduler(decoder, s.max_batch_size, s.max_queue, rng, s.max_prefill_tokens, s.stream_interval)
        # the eager paths' kernels compile here, not under the first clients' requests
        print(f"[serve] warmed up in {scheduler.warm_up():.1f}s", flush=True)
        limits = ApiLimits(
            model_name(cfg),
            target.model.args.vocab_size,
            cfg.model.max_seq_len,
            k,
            s.default_max_tokens,
            s.max_tokens_limit,
            s.default_temperature,
        )
        key = api_key(cfg)
        if key is None and not is_loopback(s.host):
            print(
                f"[serve] WARNING: serve.host={s.host} exposes the server beyond this machine and no API key "
                f"is set: anyone who reaches the port can use it (set {API_KEY_ENV} or serve.api_key)",
                file=sys.stderr,
                flush=True,
            )
        front = FrontSpec(
            target.tokenizer, limits, key, is_loopback(s.host), s.host, s.port, s.drain_timeout_s, s.log_level
        )
        return OpenAIServer(front, scheduler, graphs)

    @staticmethod
    def _announce(server: OpenAIServer, host: str) -> None:
        if server.wait_ready(timeout=600):
            print(f"[serve] ready on http://{host}:{server.port}/v1", flush=True)

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        server = self.server = self.build(cfg, inputs, env)
        print(
            f"[serve] model {model_name(cfg)!r} on {address(cfg.serve)}, {cfg.serve.max_batch_size} slots; "
            "Ctrl-C drains and stops",
            flush=True,
        )
        threading.Thread(target=self._announce, args=(server, cfg.serve.host), daemon=True).start()
        try:
            server.run()
        finally:
            self.server = None
        sched = server.scheduler
        metrics = serve_metrics(sched.stats, inputs.get("graphs"), sched.dec.clock.totals(), server.http_cpu_s)
        policy = server.scheduler.dec.adaptive
        if policy is not None:  # what the served rounds taught it
            print(f"[serve] adaptive k at the end, {policy.describe(cfg.serve.max_batch_size)}", flush=True)
        if env.tracker is not None:
            env.tracker.log_metrics(metrics)
        head = (
            "[serve] stopped"
            + (" (Ctrl-C)" if server.interrupted else "")
            + (f", {server.aborted} in-flight requests aborted" if server.aborted else "")
            + ":"
        )
        shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if v == v]  # no nan
        print("\n".join([head, *textwrap.wrap(", ".join(shown), 100, initial_indent="  ", subsequent_indent="  ")]))
        return {"serve_results": metrics}
