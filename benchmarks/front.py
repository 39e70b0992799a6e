"""The HTTP front's CPU per streamed token, without a model: `python benchmarks/front.py --clients 32 64`.

The real front process (engine/serve/http.py: uvicorn, the OpenAI app, detokenizing, SSE) runs over a
stand-in engine on the other end of its pipe. The stand-in answers each submit at once and, every
--pass-ms (0: as fast as it can), sends one ("events", ...) message with --tokens new tokens for every
live request, as the engine's loop does after a round; the tokens are the default model's tokenizer's ids
of an English text, so detokenizing costs what it costs in a server. N clients stream chat completions of
--max-tokens tokens back to back over keep-alive sockets, with usage (a client far cheaper than the front,
so the front is what is measured). One row per level, after --warmup s, over --duration s:

    clients  pass ms  tokens/s  front CPU s  front ms / 1000 tokens  first token p50 ms

The front saturates where its CPU seconds reach the window's: the engine's tokens then wait in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.loading import describe_model, load_tokenizer  # noqa: E402
from engine.serve.http import FrontSpec, front_main  # noqa: E402
from engine.serve.link import wire_event  # noqa: E402
from engine.serve.protocol import ApiLimits  # noqa: E402
from engine.serve.requests import TokenEvent  # noqa: E402
from pipeline.config import compose_run_config  # noqa: E402
from pipeline.paths import REPO  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens with a small "
    "model and verifies them with the large one in a single forward pass; every accepted token is one "
    'the large model did not have to produce alone. "Quotes", back\\slashes and accents: café, naïve.'
)


class StandInEngine(threading.Thread):
    """The engine's end of the pipe: submits answered at once, then `tokens` ids a pass for each live
    request until its max_tokens (the last event finishes it), one message a pass."""

    def __init__(self, conn, ids: list[int], tokens: int, pass_s: float):
        super().__init__(daemon=True)
        self.conn, self.ids, self.tokens, self.pass_s = conn, ids, tokens, pass_s
        self.live: dict[int, list[int]] = {}  # rid -> [tokens sent, max_tokens]
        self.stop = False

    def run(self) -> None:
        at = 0  # the next id of `ids` to send
        while not self.stop:
            t0 = time.perf_counter()
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == "submit":
                    self.live[msg[1]] = [0, msg[2].max_tokens]
                    self.conn.send(("submitted", msg[1], None))
                elif msg[0] == "cancel":
                    self.live.pop(msg[1], None)
            batch = []
            for rid, st in list(self.live.items()):
                n = min(self.tokens, st[1] - st[0])
                toks = [self.ids[(at + j) % len(self.ids)] for j in range(n)]
                at += n
                st[0] += n
                done = st[0] >= st[1]
                if done:
                    del self.live[rid]
                batch.append(wire_event(rid, TokenEvent(toks, "length" if done else None), (0, 0, 0)))  # no draft
            if batch:
                self.conn.send(("events", batch))
            wait = self.pass_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            elif not batch:
                self.conn.poll(0.001)


async def client(port: int, body: bytes, want: int, until: float, firsts: list[float], counts: list[int]) -> None:
    """Requests back to back on one keep-alive connection until `until`; each read to its [DONE], its
    usage `want` completion tokens."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        writer.write(head + body)
        buf, first = b"", None
        while not buf.endswith(b"0\r\n\r\n") or b"data: [DONE]" not in buf:
            part = await reader.read(65536)
            if not part:
                raise ConnectionError("the front closed the connection")
            buf += part
            if first is None and buf.count(b"data: ") >= 2:  # the chunk after chat's role chunk
                first = time.perf_counter() - t0
        firsts.append(first or 0.0)
        got = json.loads(buf.split(b"data: ")[-2].split(b"\r\n")[0])["usage"]["completion_tokens"]
        if got != want:
            raise RuntimeError(f"a response of {got} tokens, not {want}")
        counts.append(got)
    writer.close()


def level(port: int, pid: int, clients: int, body: bytes, want: int, warmup: float, duration: float) -> dict:
    proc = psutil.Process(pid)
    firsts: list[float] = []
    counts: list[int] = []

    async def run() -> tuple[float, float]:
        t_start = time.perf_counter()
        tasks = [asyncio.create_task(client(port, body, want, t_start + warmup + duration, firsts, counts))
                 for _ in range(clients)]  # fmt: skip
        await asyncio.sleep(warmup)
        n0, cpu0 = len(counts), sum(proc.cpu_times()[:2])
        done0 = sum(counts[:n0])
        await asyncio.sleep(duration)
        cpu, tokens = sum(proc.cpu_times()[:2]) - cpu0, sum(counts) - done0
        await asyncio.gather(*tasks)
        return cpu, tokens

    cpu, tokens = asyncio.run(run())
    return {"tokens_s": tokens / duration, "cpu_s": cpu, "ms_per_1k": 1e6 * cpu / max(tokens, 1),
            "first_ms": 1e3 * statistics.median(firsts) if firsts else float("nan")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--pass-ms", type=float, default=2.0, help="the stand-in engine's pass (0: unpaced)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a request gets a pass (2-3 with a draft)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("overrides", nargs="*", help="config overrides for the tokenizer (model.*)")
    args = ap.parse_args()
    cfg = compose_run_config(*args.overrides)
    weights = REPO / "outputs" / "weights"
    tok = load_tokenizer(cfg.model, weights, describe_model(cfg.model, weights))
    limits = ApiLimits("m", 1 << 30, 1 << 20, 0, args.max_tokens, args.max_tokens, 0.0)
    spec = FrontSpec(tok, limits, None, True, "127.0.0.1", 0, 5.0)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    front = ctx.Process(target=front_main, args=(there, spec), daemon=True)
    front.start()
    msg = here.recv()
    if msg[0] != "ready":
        raise SystemExit(f"the front did not start: {msg}")
    port = msg[1]
    engine = StandInEngine(here, tok.encode(TEXT * 4), args.tokens, args.pass_ms / 1e3)
    engine.start()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": args.max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    print("clients  pass ms  tokens/s  front CPU s  front ms / 1000 tokens  first token p50 ms")
    for n in args.clients:
        r = level(port, front.pid, n, body, args.max_tokens, args.warmup, args.duration)
        print(f"{n:7d}  {args.pass_ms:7.1f}  {r['tokens_s']:8.0f}  {r['cpu_s']:11.2f}  {r['ms_per_1k']:22.1f}  "
              f"{r['first_ms']:18.1f}", flush=True)  # fmt: skip
    engine.stop = True
    front.kill()


if __name__ == "__main__":
    main()
