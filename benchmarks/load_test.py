"""A bounded load test of an OpenAI-compatible server: N concurrent clients for a fixed time.

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --clients 1 8 32 --duration 30 --max-tokens 128 \
        --chat --ignore-eos --stream

Each client sends completions back to back (a new one as soon as the last is answered) until the
duration is up; a request in flight at the deadline finishes and counts. Prompts cycle through a
question.jsonl (`--prompts`, first turns) or a small built-in set. One row per concurrency level:

    clients  requests  failures  tokens/s  req/s  p50 s  p99 s  ttft p50 s

tokens/s is completion tokens (the server's `usage`) over the level's wall time; latency is per
request, send to last byte. `--stream` measures time to first token from the SSE stream instead
of usage counts (tokens are then counted from the final usage chunk). Where the usage carries
`speculation` (this project's server), the level's accept length (tokens per verify round) and mean
k are added up from it. Only asyncio and httpx: it runs wherever the server's clients would. A level's
clients spread over processes (`--procs`, by default one per 16 clients): one event loop parsing every
stream tops out near 15k tokens/s, below a loaded server.

`--ratios DIR` prints draft / no draft per level and temperature from the `--json` files
benchmarks/serve_levels.sh writes there (`draft_*.json` against `none_*.json`).

Reliability runs (docs/performance.md, "Reliability"): `--requests N` ends a level after N requests
(a long run: `--requests 2000`) instead of, or before, `--duration`; `--server-pid PID` prints the
server process's resident memory before the first level and after each (psutil), so a soak
(`--clients 16 --duration 300`) shows whether it grows. Failures are counted by kind (HTTP status or
exception) and the first of each printed; the exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What are the main causes of inflation?",
    "Write a haiku about the sea.",
    "How does a hash map work?",
    "Give three tips for writing clear documentation.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


@dataclass
class LevelResult:
    clients: int
    duration_s: float
    temperature: Optional[float] = None
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)
    failure_kinds: Counter = field(default_factory=Counter)  # "HTTP 503", "ReadTimeout", ...: how many
    rss_mb: Optional[float] = None  # the server's resident memory after the level (--server-pid)
    verify_rounds: int = 0  # usage.speculation, summed over requests
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def requests(self) -> int:
        return len(self.latencies)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s if self.duration_s else 0.0

    def pct(self, q: float, xs: Optional[list[float]] = None) -> float:
        xs = sorted(self.latencies if xs is None else xs)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]  # nearest rank

    def fail(self, kind: str, message: str) -> None:
        self.failures += 1
        if not self.failure_kinds[kind]:  # the first failure of each kind, in full
            self.errors.append(message[:300])
        self.failure_kinds[kind] += 1

    def count(self, usage: dict) -> None:
        """A finished request's usage: its completion tokens and speculation figures."""
        self.tokens += usage["completion_tokens"]
        spec = usage.get("speculation") or {}
        self.verify_rounds += spec.get("verify_rounds", 0)
        self.draft_tokens += spec.get("draft_tokens", 0)
        self.accepted_tokens += spec.get("accepted_tokens", 0)

    def row(self) -> dict:
        n = self.verify_rounds
        return {
            "clients": self.clients,
            "temperature": self.temperature,
            "requests": self.requests,
            "failures": self.failures,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "req_per_s": round(self.requests / self.duration_s, 2),
            "p50_s": round(self.pct(50), 3),
            "p99_s": round(self.pct(99), 3),
            "ttft_p50_s": round(self.pct(50, self.ttfts), 3) if self.ttfts else None,
            "failure_kinds": dict(self.failure_kinds),
            "server_rss_mb": round(self.rss_mb, 1) if self.rss_mb is not None else None,
            "accept_length": round((self.accepted_tokens + n) / n, 3) if n else None,
            "k_mean": round(self.draft_tokens / n, 3) if n else None,
        }


def load_prompts(path: Optional[str]) -> list[str]:
    if not path:
        return PROMPTS
    out = [json.loads(line)["turns"][0] for line in Path(path).read_text().splitlines() if line.strip()]
    return out or PROMPTS


class HTTPFailure(RuntimeError):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.kind = f"HTTP {status}"


async def _one(client: httpx.AsyncClient, url: str, body: dict, res: LevelResult) -> None:
    t0 = time.perf_counter()
    try:
        if body.get("stream"):
            usage, first = None, None
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    raise HTTPFailure(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    choice = (chunk.get("choices") or [{}])[0]
                    if first is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                        first = time.perf_counter() - t0  # the first text (chat's first chunk is the role)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            if first is not None:
                res.ttfts.append(first)
        else:
            r = await client.post(url, json=body)
            if r.status_code != 200:
                raise HTTPFailure(r.status_code, r.text)
            usage = r.json()["usage"]
        res.latencies.append(time.perf_counter() - t0)
        res.count(usage or {"completion_tokens": 0})
    except Exception as e:  # counted by kind, the run goes on
        res.fail(getattr(e, "kind", type(e).__name__), repr(e))


async def run_level(
    base_url: str,
    model: str,
    clients: int,
    duration_s: float,
    max_tokens: int,
    prompts: list[str],
    temperature: float = 0.0,
    stream: bool = False,
    timeout_s: float = 600.0,
    chat: bool = False,
    ignore_eos: bool = False,
    max_requests: Optional[int] = None,
    shard: tuple[int, int] = (0, 1),
) -> LevelResult:
    """`clients` loops sending completions until `duration_s` is up (or `max_requests` were sent);
    in-flight requests finish. shard (j, n): only clients j, j + n, ... (one of n processes)."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    res = LevelResult(clients, duration_s, temperature)
    deadline = time.perf_counter() + duration_s
    sent = 0
    mine = range(shard[0], clients, shard[1])
    limits = httpx.Limits(max_connections=len(mine), max_keepalive_connections=len(mine))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def loop(c: int) -> None:
            nonlocal sent
            i = c
            while time.perf_counter() < deadline and (max_requests is None or sent < max_requests):
                sent += 1  # one event loop: no lock needed
                text = prompts[i % len(prompts)]
                body = {
                    "model": model,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "stream": stream,
                    **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}),
                }
                if ignore_eos:
                    body["ignore_eos"] = True
                if stream:
                    body["stream_options"] = {"include_usage": True}
                await _one(client, url, body, res)
                i += clients

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(c) for c in mine))
        res.duration_s = time.perf_counter() - t0
    return res


def _run_shard(kw: dict) -> LevelResult:
    return asyncio.run(run_level(**kw))


def run_level_procs(procs: int, clients: int, max_requests: Optional[int] = None, **kw) -> LevelResult:
    """`run_level` with its clients spread over `procs` forked processes (one event loop parsing every
    stream is what saturates first at tens of clients), their results merged; `max_requests` split
    among them (ceil), so a level may send up to procs - 1 more. procs 1: in this process."""
    procs = max(1, min(procs, clients))
    if procs == 1:
        return asyncio.run(run_level(clients=clients, max_requests=max_requests, **kw))
    share = None if max_requests is None else -(-max_requests // procs)
    ctx = multiprocessing.get_context("fork")  # the workers need nothing but this module's functions
    with ctx.Pool(procs) as pool:
        parts = pool.map(_run_shard, [{**kw, "clients": clients, "max_requests": share, "shard": (j, procs)}
                                      for j in range(procs)])  # fmt: skip
    res = LevelResult(clients, max(r.duration_s for r in parts), kw.get("temperature", 0.0))
    for r in parts:
        res.latencies += r.latencies
        res.ttfts += r.ttfts
        res.failures += r.failures
        res.errors += [e for kind, e in zip(r.failure_kinds, r.errors) if not res.failure_kinds[kind]]  # same order
        res.failure_kinds += r.failure_kinds
        res.tokens += r.tokens
        res.verify_rounds += r.verify_rounds
        res.draft_tokens += r.draft_tokens
        res.accepted_tokens += r.accepted_tokens
    return res


def wait_ready(base_url: str, timeout_s: float) -> None:
    """Poll GET /health until the server answers 200 (a server still loading or capturing graphs
    refuses connections); SystemExit naming the URL after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"--wait-s: {base_url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


def served_model(base_url: str) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB."""
    try:
        import psutil
    except ImportError:
        raise SystemExit("--server-pid needs psutil (pip install psutil)") from None
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        raise SystemExit(f"--server-pid {pid}: no such process") from None


def table(results: list[LevelResult]) -> str:
    head = f"{'clients':>7} {'requests':>8} {'failures':>8} {'tokens/s':>9} {'req/s':>7} {'p50 s':>7} {'p99 s':>7}"
    if any(r.ttfts for r in results):
        head += f" {'ttft p50 s':>10}"
    lines = [head]
    for r in results:
        x = r.row()
        line = (
            f"{x['clients']:>7} {x['requests']:>8} {x['failures']:>8} {x['tokens_per_s']:>9.1f} "
            f"{x['req_per_s']:>7.2f} {x['p50_s']:>7.3f} {x['p99_s']:>7.3f}"
        )
        if x["ttft_p50_s"] is not None:
            line += f" {x['ttft_p50_s']:>10.3f}"
        if x["k_mean"] is not None:
            line += f" {x['accept_length']:>10.2f} {x['k_mean']:>6.2f}"
        lines.append(line)
    if any(r.verify_rounds for r in results):
        lines[0] += f" {'accept len':>10} {'k mean':>6}"
    return "\n".join(lines)


def ratio_table(folder: str) -> str:
    """Draft / no draft tokens/s per level and temperature, from `draft_*.json` and `none_*.json` rows
    (`--json` files of the same levels against a server with and without its draft)."""
    rows: dict[tuple[str, int, float], dict] = {}
    for path in sorted(Path(folder).glob("*.json")):
        side = path.name.split("_")[0]
        for x in json.loads(path.read_text()):
            rows[side, x["clients"], x["temperature"]] = x
    keys = sorted({(n, t) for side, n, t in rows if side == "draft" and ("none", n, t) in rows})
    if not keys:
        return f"--ratios {folder}: no level measured both with (draft_*.json) and without (none_*.json) a draft"
    head = (
        f"{'clients':>7} {'temp':>5} {'draft tok/s':>11} {'no draft':>9} {'ratio':>6} "
        f"{'accept len':>10} {'k mean':>6} {'failures':>9}"
    )
    lines = [head]
    for n, t in keys:
        d, b = rows["draft", n, t], rows["none", n, t]
        ratio = d["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else float("nan")
        acc, k = d.get("accept_length"), d.get("k_mean")
        lines.append(
            f"{n:>7} {t:>5g} {d['tokens_per_s']:>11.1f} {b['tokens_per_s']:>9.1f} {ratio:>5.2f}x "
            f"{acc if acc is not None else float('nan'):>10.2f} {k if k is not None else float('nan'):>6.2f} "
            f"{d['failures']:>4} / {b['failures']:<3}"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    ap.add_argument("--model", default=None, help="model id (default: the server's /v1/models)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--procs",
        type=int,
        default=0,
        help="client processes a level (0: one per 16 clients, up to the CPUs; streams parsed in one "
        "process cap a level near 15k tokens/s)",
    )
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per concurrency level")
    ap.add_argument(
        "--requests", type=int, default=None, help="end a level after this many requests (a long run: 2000)"
    )
    ap.add_argument(
        "--server-pid", type=int, default=None, help="print this server process's RSS at the start and after each level"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default=None, help="a question.jsonl (first turns); default: built-in")
    ap.add_argument("--stream", action="store_true", help="stream (SSE) and report time to first token")
    ap.add_argument(
        "--chat", action="store_true", help="/v1/chat/completions (the chat template) instead of /v1/completions"
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates exactly --max-tokens (the server's ignore_eos extension, as vLLM's)",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--label", default="", help="a label printed above the table (e.g. the server's config)")
    ap.add_argument(
        "--ratios",
        default=None,
        metavar="DIR",
        help="print draft / no draft per level and temperature from DIR's --json files, and exit",
    )
    ap.add_argument(
        "--wait-s",
        type=float,
        default=0.0,
        help="first wait up to this long for GET /health to answer 200 (a server just started)",
    )
    a = ap.parse_args(argv)
    if a.ratios:
        print(ratio_table(a.ratios))
        return 0
    if a.wait_s > 0:
        wait_ready(a.url, a.wait_s)
    model, prompts = a.model or served_model(a.url), load_prompts(a.prompts)
    rss0 = rss_mb(a.server_pid) if a.server_pid else None
    if rss0 is not None:
        print(f"server RSS at start: {rss0:.1f} MiB (pid {a.server_pid})")
    results = []
    for n in a.clients:
        procs = a.procs or min(os.cpu_count() or 1, -(-n // 16))
        r = run_level_procs(
            procs,
            n,
            a.requests,
            base_url=a.url,
            model=model,
            duration_s=a.duration,
            max_tokens=a.max_tokens,
            prompts=prompts,
            temperature=a.temperature,
            stream=a.stream,
            chat=a.chat,
            ignore_eos=a.ignore_eos,
        )
        results.append(r)
        if r.failures:
            kinds = ", ".join(f"{k} x{v}" for k, v in r.failure_kinds.most_common())
            print(f"  [{n} clients] {r.failures} failed: {kinds}")
        for e in r.errors:
            print(f"  [{n} clients] first of its kind: {e}")
        if rss0 is not None:
            r.rss_mb = rss_mb(a.server_pid)
            print(f"  [{n} clients] server RSS after: {r.rss_mb:.1f} MiB ({r.rss_mb - rss0:+.1f} since the start)")
    if a.label:
        print(a.label)
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps([r.row() for r in results], indent=1))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
