"""Edge-value fuzzing of an OpenAI-compatible server: no request may get a 5xx or a malformed error.

    python benchmarks/fuzz_server.py --url http://127.0.0.1:8000 --requests 5000 [--api-key KEY]

Each request is a valid completion or chat body (the served model, a short prompt, max_tokens 1-4) with
one to three fields replaced by an edge value: integers at and beyond 64 bits, negative and huge
numbers, NaN and infinities (as JSON tokens), booleans and floats where integers go, lone surrogates,
NUL and long strings, empty and nested lists, nulls, and fields no API has. Requests are seeded
(`--seed`) and sent `--concurrency` at a time. Every answer must be a 2xx, or a 4xx whose body is
OpenAI's `{"error": {"message", "type", "param", "code"}}`; the server's /health must be "ok" at the
end. Prints the statuses seen and the first failure of each kind; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from typing import Optional

import httpx

BIG = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63) - 1, -(2**64), 10**30]
EDGES = [
    0,
    -1,
    1,
    *BIG,
    True,
    False,
    0.5,
    -0.0,
    1e308,
    -1e308,
    1e-320,
    1e-46,
    "NaN",  # sent as a bare JSON token (json.dumps(float("nan"))): not JSON, a 400
    "Infinity",
    "",
    "\ud800",
    "a\x00b",
    "x" * 5000,
    None,
    [],
    [[]],
    [1, [2]],
    {},
    {"a": 1},
    ["\ud800"],
]
FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "stream",
    "ignore_eos",
    "model",
    "stream_options",
    "max_completion_tokens",
    "logit_bias",
    "frequency_penalty",
    "no_such_field",
]
PROMPT_FIELDS = {"completion": "prompt", "chat": "messages"}


def body(rng: random.Random, model: str) -> tuple[str, dict]:
    kind = rng.choice(("completion", "chat"))
    base: dict = {"model": model, "max_tokens": rng.randint(1, 4), "temperature": rng.choice((0, 0.7))}
    if kind == "completion":
        base["prompt"] = rng.choice(("Hello", [72, 101, 108], ["Hi"]))
    else:
        base["messages"] = [{"role": "user", "content": "Hello"}]
    for _ in range(rng.randint(1, 3)):
        field = rng.choice([*FIELDS, PROMPT_FIELDS[kind]])
        value = rng.choice(EDGES)
        if field == "messages" and rng.random() < 0.5:  # inside a message: content, role
            value = [{"role": rng.choice(("user", "tool", 3)), "content": value}]
        elif field == "prompt" and rng.random() < 0.5:  # token ids with an edge inside
            value = [1, value]
        base[field] = value
    return kind, base


def encode(b: dict) -> bytes:
    text = json.dumps(b, ensure_ascii=True)  # lone surrogates travel as \\ud800 escapes
    return text.replace('"NaN"', "NaN").replace('"Infinity"', "Infinity").encode()


def problem(r: httpx.Response) -> Optional[str]:
    """Why an answer is wrong (None: it is fine)."""
    if r.status_code >= 500:
        return f"HTTP {r.status_code}"
    if r.status_code < 400:
        return None
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code} without OpenAI's error shape"
    if set(err) != {"message", "type", "param", "code"}:
        return f"HTTP {r.status_code} error fields {sorted(err)}"
    return None


async def run(url: str, requests: int, concurrency: int, seed: int, api_key: Optional[str]) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)
        cases = [body(rng, model) for _ in range(requests)]
        statuses: Counter = Counter()
        failures: Counter = Counter()
        first: dict[str, str] = {}
        queue = iter(cases)

        async def worker() -> None:
            for kind, b in queue:
                path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
                r = await client.post(path, content=encode(b), headers={"content-type": "application/json"})
                statuses[r.status_code] += 1
                if (why := problem(r)) is not None:
                    failures[why] += 1
                    first.setdefault(why, f"{encode(b)[:300]!r} -> {r.text[:300]}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        health = (await client.get("/health")).json().get("status")
    print(f"{requests} requests: statuses {dict(sorted(statuses.items()))}; /health {health!r}")
    for why, n in failures.items():
        print(f"  FAILED {why} x{n}, first: {first[why]}")
    return 1 if failures or health != "ok" else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args(argv)
    return asyncio.run(run(a.url, a.requests, a.concurrency, a.seed, a.api_key))


if __name__ == "__main__":
    sys.exit(main())
