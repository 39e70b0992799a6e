"""Stage `serve`: a real uvicorn server on a loopback port, driven by the official `openai` client.

Servers run in-process (a background thread runs the whole plan, `execute(plan)`) on the tiny random
model, and are stopped the way Ctrl-C stops them; one test runs the CLI in a subprocess and sends it
a real SIGINT mid-request. Served outputs at temperature 0 are checked against `Generator` and the
eval stage on the same prompts, with and without a draft, sequential and concurrent.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers.runs import benchmark_module, compose_cfg
from helpers.serve import Served, ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from engine.drafts.registry import load_head, make_draft
from engine.loading import load_model
from engine.sampling import SamplingParams
from engine.serve.detokenize import TextStream
from engine.speculative.generate import Generator
from engine.tokenizer import ByteTokenizer
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.paths import REPO
from pipeline.plan import PlanError, build_plan

BASE = ("model=tiny", "device=cpu", "tracking=off", "serve.port=0", "model.random.init_std=0.15")
EAGLE3 = ("draft.init=random", "draft.aux_layer_ids=[1,2,3]", "draft.num_steps=3")
CONFIGS = {
    "plain": ("+experiment=serve", *BASE, "model.max_seq_len=256", "serve.max_batch_size=3", "serve.stream_interval=3"),
    "eagle3_debug": (
        "+experiment=serve_eagle3_bcg",
        *BASE,
        *EAGLE3,
        "graph=debug",
        "model.max_seq_len=256",
        "serve.max_batch_size=4",
    ),
    "mtp_debug": (
        "+experiment=serve_eagle3_bcg",
        *BASE,
        "draft=multi_layer_eagle",
        "draft.init=random",
        "draft.num_steps=3",
        "graph=debug",
        "model.max_seq_len=256",
        "serve.max_batch_size=4",
    ),
    "dflash_debug": (
        "+experiment=serve_eagle3_bcg",
        *BASE,
        "draft=dflash",
        "draft.init=random",
        "draft.num_steps=3",
        "draft.block_size=4",
        "draft.aux_layer_ids=[1,2,3]",
        "draft.num_layers=1",
        "graph=debug",
        "model.max_seq_len=256",
        "serve.max_batch_size=4",
    ),
    # k = 3 every round (no adaptive k): a request's draft tokens are known
    "eagle3_k3": (
        "+experiment=serve_eagle3_bcg",
        *BASE,
        *EAGLE3,
        "graph=debug",
        "model.max_seq_len=256",
        "serve.max_batch_size=2",
        "serve.adaptive_k=false",
    ),
    # one slot, one waiting request: queue-full and disconnect tests; long generations
    "tight": ("+experiment=serve", *BASE, "serve.max_batch_size=1", "serve.max_queue=1"),
}
PROMPTS = ["def add(a, b):", "Hello there", "The quick brown fox", "1, 2, 3, 4,", "Once upon a time", "import torch"]
N = 12  # max_tokens of the equality checks


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("serve_outputs")
    started: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in started:
            started[name] = Served(CONFIGS[name], outputs)
        return started[name]

    yield get
    for s in started.values():
        s.close()


def eval_reference(served: Served, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What eval's generator emits for these prompts, one at a time, on a fresh copy of the weights."""
    cfg, env = served.cfg, served.plan.env
    loaded = load_model(cfg.model, env.weights_dir, env.device, env.dtype)
    plan = env.draft_plan
    if plan is not None and plan.aux is not None:
        loaded.model.set_aux_layers(plan.aux.input_of)
    head = load_head(plan, loaded.model, getattr(cfg.draft, "init_seed", 0), env.device, env.dtype)  # as stage load
    params = SamplingParams(max_new_tokens=max_tokens)
    draft = make_draft(plan, head, loaded.model, 1, cfg.draft.k, cfg=cfg.draft)
    gen = Generator(loaded.model, 1, draft, cfg.draft.k)
    return [gen.generate([p], params, loaded.tokenizer.eos_token_ids)[0].tokens for p in prompts]


def no_draft_reference(served: Served, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the same target emits without a draft, one prompt at a time."""
    cfg, env = served.cfg, served.plan.env
    loaded = load_model(cfg.model, env.weights_dir, env.device, env.dtype)
    gen, params = Generator(loaded.model, 1), SamplingParams(max_new_tokens=max_tokens)
    return [gen.generate([p], params, loaded.tokenizer.eos_token_ids)[0].tokens for p in prompts]


def complete(s: Served, prompt: str, **kw):
    return s.client.completions.create(
        model=s.model, prompt=prompt, max_tokens=kw.pop("max_tokens", N), temperature=kw.pop("temperature", 0), **kw
    )


def chat(s: Served, content: str, **kw):
    return s.client.chat.completions.create(
        model=s.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=kw.pop("max_tokens", N),
        temperature=kw.pop("temperature", 0),
        **kw,
    )


# ------------------------------------------------------------------------------------------ outputs
@pytest.mark.parametrize("name", ["plain", "eagle3_debug", "mtp_debug", "dflash_debug"])
def test_served_outputs_equal_eval_sequential_and_concurrent(servers, name):
    s, tok = servers(name), ByteTokenizer()
    ref = eval_reference(s, [tok.encode(p) for p in PROMPTS], N)
    want = [tok.decode(r) for r in ref]
    assert len(set(want)) > 1  # varied outputs: the comparison can fail

    seq = [complete(s, p) for p in PROMPTS]
    assert [r.choices[0].text for r in seq] == want
    assert [r.usage.completion_tokens for r in seq] == [len(r) for r in ref]
    assert [r.choices[0].finish_reason for r in seq] == [
        "stop" if r[-1] in tok.eos_token_ids else "length" for r in ref
    ]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more requests than slots: they queue, join, leave
        conc = list(pool.map(lambda p: complete(s, p), PROMPTS))
    assert [r.choices[0].text for r in conc] == want

    # chat: the chat template, as eval applies it
    ref_chat = eval_reference(s, [tok.encode_chat(p) for p in PROMPTS[:3]], N)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: chat(s, p), PROMPTS[:3]))
    assert [r.choices[0].message.content for r in got] == [tok.decode(r) for r in ref_chat]
    assert all(r.choices[0].message.role == "assistant" and r.object == "chat.completion" for r in got)


def test_served_chat_equals_the_eval_stage(servers, tmp_path, outputs):
    """The eval stage (eagle3, graph=debug) on a question.jsonl vs the server on the same prompts."""
    s = servers("eagle3_debug")
    qs = tmp_path / "question.jsonl"
    qs.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS[:4])))
    ctx = run(
        compose_cfg(
            "+experiment=eagle3_bcg",
            *BASE,
            *EAGLE3,
            "graph=debug",
            "model.max_seq_len=256",
            f"eval.dataset={qs}",
            f"eval.max_new_tokens={N}",
            "eval.batch_size=2",
            "eval.baseline=false",
            "eval.warmup=false",
        )
    )
    records = ctx["eval_results"]["records"]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: chat(s, p), PROMPTS[:4]))
    assert [r.choices[0].message.content for r in got] == [r.text for r in records]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_equals_non_streaming(servers, kind):
    s = servers("eagle3_debug")
    call = complete if kind == "completion" else chat
    whole = call(s, PROMPTS[0])
    chunks = list(call(s, PROMPTS[0], stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    if kind == "completion":
        text = "".join(c.choices[0].text for c in body)
        assert text == whole.choices[0].text
    else:
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == whole.choices[0].message.content and body[0].object == "chat.completion.chunk"
    assert len(body) > 2  # it streamed, token by token
    assert [c.choices[0].finish_reason for c in body][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_and_seeds(servers):
    s = servers("plain")
    full = complete(s, PROMPTS[1], max_tokens=24).choices[0].text
    stop = full[5:7]
    counts = lambda: {r: s.metrics().get(f"specpipe_requests_total{{finish_reason={r}}}", 0) for r in ("stop", "abort")}  # noqa: E731
    before = counts()
    cut = complete(s, PROMPTS[1], max_tokens=24, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in complete(s, PROMPTS[1], max_tokens=24, stop=stop, stream=True))
    assert streamed == cut.choices[0].text
    deadline = time.monotonic() + 10  # the engine releases a stopped request at its next step
    while counts()["stop"] < before["stop"] + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts() == {"stop": before["stop"] + 2, "abort": before["abort"]}  # counted as the client was told
    # A stop string that only the last token completes: the engine ended the request at max_tokens first.
    last = next(full[-n:] for n in range(1, len(full)) if full.index(full[-n:]) == len(full) - n)
    cut = complete(s, PROMPTS[1], max_tokens=24, stop=[last]).choices[0]
    assert cut.text == full[: -len(last)] and cut.finish_reason == "stop"
    deadline = time.monotonic() + 10
    while counts()["stop"] < before["stop"] + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts() == {"stop": before["stop"] + 3, "abort": before["abort"]}

    # A seeded sampled request gives the same output alone and among other sampled requests.
    alone = complete(s, PROMPTS[2], temperature=0.9, seed=7, max_tokens=16).choices[0].text
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(complete, s, PROMPTS[2], temperature=0.9, seed=7, max_tokens=16)]
        jobs += [pool.submit(complete, s, p, temperature=1.0, max_tokens=16) for p in PROMPTS[3:5]]
        assert jobs[0].result().choices[0].text == alone
    others = {complete(s, PROMPTS[2], temperature=0.9, seed=seed, max_tokens=16).choices[0].text for seed in (1, 2, 3)}
    assert len(others | {alone}) > 1


# ------------------------------------------------------------------------------------------ errors
def test_stop_strings_racing_max_tokens_are_counted_as_the_clients_were_told(servers):
    """Stop strings ending within the first characters, max_tokens 2..6, 8 clients at once: the front's stop
    and the engine's length cross each other, and /metrics counts each request as its client was told."""
    s = servers("plain")
    fulls = {p: complete(s, p, max_tokens=6).choices[0].text for p in PROMPTS}
    reasons = ("stop", "length", "abort", "error")
    counts = lambda: {r: s.metrics().get(f"specpipe_requests_total{{finish_reason={r}}}", 0) for r in reasons}  # noqa: E731

    def one(i: int) -> str:
        p = PROMPTS[i % len(PROMPTS)]
        n = 1 + i % 5
        return complete(s, p, max_tokens=2 + i % 5, stop=[fulls[p][max(0, n - 2) : n]]).choices[0].finish_reason

    before = counts()
    with ThreadPoolExecutor(8) as pool:
        told = list(pool.map(one, range(120)))
    deadline = time.monotonic() + 10  # a recount crosses the pipe after the answer
    while counts()["stop"] < before["stop"] + told.count("stop") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {r: counts()[r] - before[r] for r in reasons} == {r: told.count(r) for r in reasons}


def test_bad_inputs_get_their_status(servers):
    s = servers("plain")
    url = s.root + "/v1/completions"

    def post(body, raw=None):
        r = (
            httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
            if raw
            else httpx.post(url, json=body, timeout=30)
        )
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return r.status_code, err

    ok = {"model": s.model, "prompt": "hi", "max_tokens": 4}
    assert post(None, raw=b'{"model": "tiny-random", "prompt": ')[0] == 400
    code, err = post({**ok, "model": "gpt-4"})
    assert code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    for bad in (-1, 0, 10**12):
        code, err = post({**ok, "max_tokens": bad})
        assert code == 400 and err["param"] == "max_tokens", bad
    code, err = post({**ok, "prompt": "x" * 300})  # model.max_seq_len=256
    assert code == 400 and err["code"] == "context_length_exceeded"
    code, err = post({**ok, "max_tokens": 254})  # 3 prompt tokens + 254 > 256
    assert code == 400 and err["code"] == "context_length_exceeded" and "256" in err["message"]
    code, err = post({**ok, "temperature": "hot"})
    assert code == 422 and err["param"] == "temperature"
    assert post({"model": s.model})[0] == 422  # no prompt
    assert post({**ok, "n": 3})[0] == 400
    code, err = post({**ok, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert code == 400 and err["param"] == "tools" and err["code"] == "unsupported_parameter"
    code, err = post({**ok, "stop": [f"s{i}" for i in range(1000)]})
    assert code == 400 and err["param"] == "stop" and "1000 strings" in err["message"] and len(err["message"]) < 80
    code, err = post({**ok, "stop": ["a", ""]})
    assert code == 400 and err["param"] == "stop" and "empty" in err["message"]
    code, err = post({**ok, "stream_options": {"include_usage": True}})  # as OpenAI: only with stream=true
    assert code == 400 and err["param"] == "stream_options"
    code, err = post({**ok, "max_tokenz": 4})  # a typo is not silently ignored
    assert code == 400 and err["param"] == "max_tokenz" and err["code"] == "unknown_parameter"
    assert complete(s, "hi", max_tokens=2, user="u1", frequency_penalty=0).choices  # fields that change nothing
    assert post({**ok, "prompt": [1, 2, 99999]})[1]["param"] == "prompt"  # token ids beyond the vocabulary
    assert complete(s, [72, 105], max_tokens=2).usage.prompt_tokens == 2  # token ids are a prompt too
    # The official client maps them to its exceptions.
    with pytest.raises(openai.NotFoundError):
        s.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "hi"}], max_tokens=-5)
    assert httpx.get(s.root + "/v1/nothing", timeout=10).status_code == 404
    assert s.metrics()["specpipe_requests_rejected_total{status=400}"] >= 8


def _open_stream(s: Served, prompt: str, max_tokens: int):
    """A streaming request whose first token has arrived: (response, its context manager, line iterator)."""
    cm = httpx.stream(
        "POST",
        s.root + "/v1/completions",
        timeout=60,
        json={"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
    )
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    return r, cm, lines


def _wait(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_queue_full_answers_429_and_a_disconnect_frees_the_slot(servers):
    s = servers("tight")  # 1 slot, 1 waiting
    aborts0 = s.metrics().get("specpipe_requests_total{finish_reason=abort}", 0)
    a, a_cm, a_lines = _open_stream(s, PROMPTS[0], 1500)
    next(line for line in a_lines if line.startswith("data: {"))  # A holds the slot, generating
    b, b_cm, _ = _open_stream(s, PROMPTS[1], 1500)  # B waits
    _wait(lambda: s.metrics()["specpipe_queue_depth"] == 1)
    with pytest.raises(openai.RateLimitError) as e:
        complete(s, PROMPTS[2], max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"

    a_cm.__exit__(None, None, None)  # A's client goes away mid-stream: its slot goes to B
    _wait(lambda: s.metrics()["specpipe_queue_depth"] == 0)
    b_cm.__exit__(None, None, None)  # and B's
    _wait(lambda: s.metrics()["specpipe_running_requests"] == 0)
    m = s.metrics()
    assert m["specpipe_requests_total{finish_reason=abort}"] == aborts0 + 2
    assert m["specpipe_generation_tokens_total"] < 2 * 1500  # neither ran to the end
    r = complete(s, PROMPTS[3], max_tokens=3)  # the slot is free again
    assert r.usage.completion_tokens == 3

    # A non-streaming client that gives up frees its slot too (the handler polls for it).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            s.root + "/v1/completions",
            timeout=1.0,
            json={"model": s.model, "prompt": PROMPTS[4], "max_tokens": 1800, "temperature": 0},
        )
    _wait(lambda: s.metrics()["specpipe_running_requests"] == 0)
    assert s.metrics()["specpipe_requests_total{finish_reason=abort}"] == aborts0 + 3


def test_models_health_and_metrics(servers):
    s = servers("eagle3_debug")
    complete(s, PROMPTS[0])
    models = s.client.models.list()
    assert [m.id for m in models.data] == [s.model]
    assert httpx.get(s.root + "/health", timeout=10).json()["status"] == "ok"
    text = httpx.get(s.root + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses as Prometheus text
    for name in (
        "specpipe_requests",
        "specpipe_generation_tokens",
        "specpipe_accept_length",
        "specpipe_accept_rate",
        "specpipe_graph_replays",
        "specpipe_graph_fallbacks",
        "specpipe_queue_depth",
        "specpipe_request_latency_seconds",
        "specpipe_time_to_first_token_seconds",
    ):
        assert name in families, name
    m = s.metrics()
    assert m["specpipe_generation_tokens_total"] > 0 and m["specpipe_accept_length"] >= 1.0
    assert {k for k in m if k.startswith("specpipe_accept_rate{")} == {
        f"specpipe_accept_rate{{position={i}}}" for i in range(3)
    }
    # every round replayed, whatever k adaptive k chose from this host's timings; none ran eagerly
    replays = [v for key, v in m.items() if key.startswith("specpipe_graph_replays_total{phase=round_k")]
    assert sum(replays) == m["specpipe_rounds_total"] > 0
    assert m["specpipe_graph_replays_total{phase=prefill}"] > 0  # a join prefills through the staging rows' graphs
    assert gc.get_freeze_count() > 0  # the engine's process froze its startup heap before serving
    fallbacks = [v for key, v in m.items() if key.startswith("specpipe_graph_fallbacks_total{phase=round_k")]
    assert len(fallbacks) == len(replays) and not any(fallbacks)


def test_a_request_turns_speculation_off_and_its_usage_and_metrics_say_so(servers):
    """`"speculative": false` (the openai client's extra_body): no draft token kept, the output of the
    server without a draft; every response's usage carries its speculation figures (the streamed one in
    its final chunk) and /metrics adds them up."""
    s, tok = servers("eagle3_k3"), ByteTokenizer()
    want = [tok.decode(r) for r in no_draft_reference(s, [tok.encode(PROMPTS[0]), tok.encode_chat(PROMPTS[1])], N)]
    before = s.metrics()
    on = complete(s, PROMPTS[0])
    off = complete(s, PROMPTS[0], extra_body={"speculative": False})
    chunks = list(
        chat(s, PROMPTS[1], stream=True, stream_options={"include_usage": True}, extra_body={"speculative": False})
    )
    after = s.metrics()
    assert on.choices[0].text == off.choices[0].text == want[0]  # lossless either way
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[1]

    spec_on, spec_off, spec_stream = on.usage.speculation, off.usage.speculation, chunks[-1].usage.speculation
    rounds = spec_on["verify_rounds"]
    assert rounds > 0 and spec_on["draft_tokens"] == 3 * rounds and spec_on["mean_k"] == 3.0  # k = 3 every round
    assert spec_on["accept_length"] == (spec_on["accepted_tokens"] + rounds) / rounds
    assert on.usage.completion_tokens <= 1 + rounds + spec_on["accepted_tokens"]  # the prefill's token, then rounds
    for spec, usage in ((spec_off, off.usage), (spec_stream, chunks[-1].usage)):
        assert spec["draft_tokens"] == spec["accepted_tokens"] == 0 and spec["mean_k"] == 0.0
        assert spec["accept_length"] == 1.0 and usage.completion_tokens == 1 + spec["verify_rounds"]

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    specs = (spec_on, spec_off, spec_stream)
    assert delta("specpipe_draft_tokens_proposed_total") == sum(x["draft_tokens"] for x in specs)
    assert delta("specpipe_draft_tokens_accepted_total") == sum(x["accepted_tokens"] for x in specs)
    assert delta("specpipe_requests_not_speculative_total") == 2
    assert delta("specpipe_request_accept_length_count") == 3
    assert delta("specpipe_request_accept_length_sum") == pytest.approx(sum(x["accept_length"] for x in specs))
    assert delta("specpipe_request_draft_tokens_per_round_sum") == pytest.approx(3.0)
    assert delta("specpipe_request_draft_tokens_per_round_bucket{le=0.0}") == 2  # the two that turned it off


# ------------------------------------------------------------------------------------------ load
def test_load_test_spreads_a_levels_clients_over_processes(servers, tmp_path):
    """`load_test.py --procs 2`: two forked client processes, each with half the clients and half of
    `--requests`, their rows merged (requests, tokens, streams' first tokens and speculation)."""
    import subprocess

    s, rows = servers("eagle3_debug"), tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "load_test.py"), "--url", s.root, "--clients", "4"]
    cmd += ["--procs", "2", "--requests", "10", "--duration", "60", "--max-tokens", "8", "--ignore-eos"]
    cmd += ["--stream", "--chat", "--json", str(rows)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (row,) = json.loads(rows.read_text())
    assert row["clients"] == 4 and row["requests"] == 10 and row["failures"] == 0, row
    assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0 and row["accept_length"] >= 1.0, row


def test_bounded_load_has_no_failed_request(servers):
    import asyncio

    lt, s = benchmark_module("load_test"), servers("eagle3_debug")
    res = asyncio.run(
        lt.run_level(
            s.root,
            s.model,
            clients=4,
            duration_s=3.0,
            max_tokens=16,
            prompts=PROMPTS,
            stream=True,
            chat=True,
            ignore_eos=True,
        )
    )
    print("\n" + lt.table([res]))
    assert res.failures == 0, res.errors
    assert res.requests >= 4 and res.pct(50) <= res.pct(99) and len(res.ttfts) == res.requests
    assert res.tokens == 16 * res.requests  # ignore_eos: exactly max_tokens each
    row = res.row()  # the streamed usages' speculation, added up
    assert res.verify_rounds >= 15 * res.requests / 4 and row["accept_length"] >= 1.0 and row["k_mean"] >= 0


def test_serve_levels_ratio_table(tmp_path):
    """benchmarks/serve_levels.sh's table: draft / no draft per level and temperature from the --json rows,
    a level measured on one side only left out."""
    lt = benchmark_module("load_test")

    def rows(side: str, n: int, t: float, tok_s: float, **extra):
        path = tmp_path / f"{side}_n{n}_t{t}.json"
        path.write_text(json.dumps([{"clients": n, "temperature": t, "tokens_per_s": tok_s, "failures": 0, **extra}]))

    rows("draft", 1, 0.0, 300.0, accept_length=2.5, k_mean=4.0)
    rows("none", 1, 0.0, 200.0)
    rows("draft", 8, 1.0, 900.0, accept_length=1.2, k_mean=0.5)
    rows("none", 8, 1.0, 1000.0)
    rows("draft", 32, 0.0, 1.0)  # no baseline: not in the table
    lines = lt.ratio_table(str(tmp_path)).splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["clients", "temp"]
    assert lines[1].split()[:5] == ["1", "0", "300.0", "200.0", "1.50x"] and "2.50" in lines[1]
    assert lines[2].split()[:5] == ["8", "1", "900.0", "1000.0", "0.90x"]
    assert "no level measured" in lt.ratio_table(str(tmp_path / "empty"))


def test_load_test_waits_for_a_ready_server_and_names_a_dead_one(servers):
    import socket

    lt, s = benchmark_module("load_test"), servers("eagle3_debug")
    lt.wait_ready(s.root, 10.0)  # a running server: returns at once
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SystemExit, match=re.escape(f"{dead}/health did not answer 200 within 1 s")):
        lt.wait_ready(dead, 1.0)


# ------------------------------------------------------------------------------------------ plan, Ctrl-C
def test_plan_ends_in_serve_and_checks_its_keys(outputs):
    cfg = to_run_config(
        compose_cfg("+experiment=serve_eagle3_bcg", *BASE, *EAGLE3, "graph=debug", "serve.max_batch_size=6")
    )
    plan = build_plan(cfg, outputs)
    assert plan.names == ["load", "configure_aux_capture", "capture_graphs", "serve"]
    text = plan.describe()
    assert "capture sizes [1, 2, 4, 6]" in text and "6 slots" in text
    assert "http://127.0.0.1:<a free port, printed when up>/v1" in text  # serve.port=0
    assert "rounds of k in [0, 1, 2, 3] (adaptive k)" in text  # serve.adaptive_k: every k captured
    for override, key in [
        ("draft=oracle", "draft.algorithm='oracle'"),
        ("serve.max_batch_size=0", "serve.max_batch_size=0"),
        ("serve.port=70000", "serve.port=70000"),
        ("serve.default_max_tokens=9999", "serve.default_max_tokens=9999"),
    ]:
        with pytest.raises(PlanError, match=re.escape(key)):
            build_plan(to_run_config(compose_cfg("+experiment=serve", *BASE, override)), outputs)
    small = to_run_config(compose_cfg("+experiment=serve", *BASE, "graph=debug", "graph.capture_sizes=[1,2]"))
    assert "exceed the largest capture size 2: they run eagerly" in build_plan(small, outputs).describe()


def test_ctrl_c_drains_in_flight_requests_and_closes_the_run(outputs):
    server = ServerProcess(outputs, "experiment_name=serve_sigint")
    try:
        body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.p.send_signal(signal.SIGINT)  # Ctrl-C while the request generates
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(x[6:]) for x in rest if x != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.finish(60) == 0, server.text()
        out = "".join(server.out + server.err)
        assert "[serve] stopped (Ctrl-C)" in out and "Traceback" not in out
        summary = out[out.index("[serve] stopped") :].splitlines()[1:]  # on short lines, nothing unmeasured
        assert "requests 1" in summary[0] and all(len(x) <= 100 for x in summary) and " nan" not in out
        assert "[serve] draining: 1 request in flight" in out and "[serve] draining: 0 left" in out, out[-2000:]
    finally:
        server.kill()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    (run_,) = c.search_runs([c.get_experiment_by_name("serve_sigint").experiment_id])
    assert run_.info.status == "FINISHED"
    assert run_.data.metrics["requests_length"] == 1 and run_.data.metrics["generated_tokens"] == 300


def test_a_killed_engine_takes_its_http_front_with_it(outputs):
    """The front sits in its own process group, so a SIGKILL to the engine does not reach it: it sees
    the pipe close, fails its in-flight request and exits, and the port is free again."""
    from pathlib import Path

    server = ServerProcess(outputs, "tracking=off")
    try:
        kids = [int(st.parent.name) for st in Path("/proc").glob("[0-9]*/stat") if _parent(st) == server.p.pid]
        assert kids, "no child process"
        body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.p.kill()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"code":"error"' in rest[-2], rest[-3:]
        t0 = time.monotonic()
        while any(Path(f"/proc/{k}").exists() and _state(k) != "Z" for k in kids) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert not any(Path(f"/proc/{k}").exists() and _state(k) != "Z" for k in kids)
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.root + "/health", timeout=5)
    finally:
        server.kill()


def test_a_port_taken_after_the_plan_fails_the_serve_stage_with_the_address(tmp_path):
    """The plan checks the port; if another program takes it before the front binds, the stage fails
    with the address and the way out, and the engine's thread and the front are stopped."""
    import socket

    from pipeline.execute import execute

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    plan = build_plan(to_run_config(compose_cfg(*CONFIGS["tight"], f"serve.port={port}")), tmp_path)
    before = threading.active_count()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"could not start on 127.0.0.1:{port}.*serve.port=0"):
            execute(plan)
    assert time.monotonic() - t0 < 60 and threading.active_count() == before
    assert plan.stages[-1].server is None


def _parent(stat) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ------------------------------------------------------------------------------------------ units
@pytest.mark.parametrize("by_bytes", [True, False])
def test_text_stream_holds_partial_characters_and_stop_strings(by_bytes):
    """A token at a time through the byte pieces, or re-reading a window through decode: the same text."""
    tok = ByteTokenizer()
    if not by_bytes:
        tok.byte_pieces = None
    ids = list("héllo wörld END tail".encode())
    ts = TextStream(tok, stop=["END"])
    sent = [ts.push([i]) for i in ids]
    assert "".join(sent) + ts.finish() == "héllo wörld " and ts.stopped
    assert all("\ufffd" not in d for d in sent)  # a 2-byte character is sent whole
    assert "END" not in "".join(sent)
    plain = TextStream(tok)
    assert "".join(plain.push([i]) for i in ids) + plain.finish() == "héllo wörld END tail"


@pytest.mark.slow
def test_a_byte_level_tokenizer_streams_a_token_at_a_time_as_decode_reads_it_all(outputs, tmp_path):
    """SmolLM2's byte-level BPE has byte pieces: any ids (multi-byte characters split across tokens, bytes
    that are no UTF-8, special tokens, ids past the vocabulary), pushed a few at a time, stream exactly
    the tokenizer's decode of them all. A tokenizer with another decoder has none (its streams re-read)."""
    import random

    from helpers.models import save_byte_tokenizer

    from engine.loading import convert_gguf, packaged_smollm2_gguf
    from engine.tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(str(convert_gguf(packaged_smollm2_gguf(), outputs / "weights")))
    assert tok.byte_pieces is not None and len(tok.byte_pieces) == 49152
    rng, text = random.Random(0), 'Ünïcödé 你好 🙂 café "q" \\ tab\t<|im_end|> end'
    known = tok.encode(text)
    for _ in range(200):
        ids = [rng.randrange(49160) if rng.random() < 0.4 else rng.choice(known) for _ in range(rng.randint(1, 30))]
        stream, i, sent = TextStream(tok), 0, []
        while i < len(ids):
            n = rng.randint(1, 3)
            sent.append(stream.push(ids[i : i + n]))
            i += n
        assert "".join(sent) + stream.finish() == tok.decode(ids)
    save_byte_tokenizer(tmp_path)
    assert HFTokenizer.from_dir(str(tmp_path)).byte_pieces is None  # WordLevel, no byte-level decoder


def test_a_fast_tokenizer_decodes_as_transformers_does_without_its_wrapping(tmp_path):
    """The tokenizers library's decode, where transformers' adds nothing to it, gives transformers' text
    (special tokens skipped); a tokenizer that cleans up spaces keeps transformers' decode."""
    from helpers.models import save_byte_tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import HFTokenizer

    save_byte_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path))
    assert tok.plain_decode
    ids = [256, *b'a "b" \\ c\n d', 257, *b" e"]
    for a in range(len(ids)):
        for b in range(a, len(ids) + 1):
            assert tok.decode(ids[a:b]) == tok.tok.decode(ids[a:b], skip_special_tokens=True)
    cleaning = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), clean_up_tokenization_spaces=True)
    assert not HFTokenizer(cleaning).plain_decode


def test_mixed_batch_greedy_rows_stay_greedy_and_seeded_rows_draw_their_own():
    import torch

    from engine.sampling import Draws
    from engine.speculative.verify import verify, verify_greedy

    g = torch.Generator().manual_seed(0)
    b, k, vocab = 4, 3, 16
    logits = torch.randn(b, k + 1, vocab, generator=g) * 2
    draft = torch.randint(0, vocab, (b, k), generator=g)
    draft[0, :2] = logits[0, :2].argmax(-1)  # row 0 accepts two greedily
    want_acc, want_bonus = verify_greedy(logits, draft)

    def once(other_seed):  # row 1 keeps seed 5, row 3's seed changes
        rows = Draws(
            torch.tensor([0.0, 1.0, 0.0, 0.7]), torch.tensor([1.0, 0.9, 1.0, 1.0]), torch.tensor([0, 5, 0, other_seed])
        )
        return verify(logits, draft, None, rows, torch.full((b,), 7))

    runs = [once(seed) for seed in range(6)]
    for acc, bonus in runs:
        assert acc[[0, 2]].tolist() == want_acc[[0, 2]].tolist() and acc[0] == 2
        assert bonus[[0, 2]].tolist() == want_bonus[[0, 2]].tolist()
        assert (acc[1], bonus[1]) == (runs[0][0][1], runs[0][1][1])  # row 1 draws from its own seed alone
    assert len({int(bonus[3]) for _, bonus in runs}) > 1  # row 3 with other seeds draws otherwise


def test_slots_beyond_the_largest_capture_size_run_eagerly_and_are_counted():
    """3 slots, graphs captured for 1 and 2 rows: every round over all 3 falls back to eager, is counted,
    and the outputs still equal the eager generator's (rounds over slots 0..1 alone replay). Requests
    waiting together join together, each prompt through the one staging row's prefill graph (a server's
    set-up). A warm-up before changes none of it."""
    from helpers.models import random_prompts
    from helpers.spec import build, setup

    from engine.drafts.registry import draft_config
    from engine.serve.scheduler import GenerationRequest, Scheduler
    from engine.speculative.generate import SpecDecoder
    from engine.speculative.graph_set import round_name

    target, plan, head, gs, k = setup("eagle3", sizes=(1, 2), batch=3, prefill_rows=1)
    draft = make_draft(plan, head, target, 3, draft_config("eagle3").num_steps, cfg=draft_config("eagle3"), graphs=gs)
    sched = Scheduler(SpecDecoder(target, 3, draft, k, graphs=gs), 3, 8)
    sched.warm_up()  # throwaway requests, greedy and sampled: they leave no trace in what follows
    assert sched.stats.rounds == sched.stats.submitted == 0 and not sched.waiting
    assert sched.slots == [None] * 3 and not any(sched.state.live)
    prompts, done = random_prompts(4, seed=31), threading.Semaphore(0)
    reqs = [GenerationRequest(p, 10 + i, lambda ev: ev.finish_reason and done.release()) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    prefill = gs.get("prefill").stats
    replays = prefill.replays
    sched.start()  # three join at once (one join over slots 0..2), the fourth when slot 0 frees
    assert all(done.acquire(timeout=30) for _ in reqs)
    assert prefill.replays - replays == 4 and prefill.fallbacks == 0  # a graph replay a prompt
    sched.close()
    assert sched.stats.prefills == 2 and [r.slot for r in reqs] == [0, 1, 2, 0]
    eager = build(target, "eagle3", 1, SamplingParams())
    want = [
        eager.generate([p], SamplingParams(max_new_tokens=10 + i, ignore_eos=True))[0].tokens
        for i, p in enumerate(prompts)
    ]
    assert [r.output for r in reqs] == want
    verify_stats = gs.get(round_name(k)).stats
    assert verify_stats.fallbacks > 0 and verify_stats.fallbacks + verify_stats.replays == sched.stats.rounds


def test_requests_join_together_at_free_slots_wherever_they_are():
    """With two staging rows, requests waiting together prefill in one graph replay, at the lowest free
    slots even where those are not contiguous (here 1 and 3, around two running requests); each run of
    slots then starts on its own. Every greedy output equals the eager generator's, and a seeded sampled
    request that joined with another draws what it draws joining alone."""
    import torch
    from helpers.models import random_prompts
    from helpers.spec import build, setup

    from engine.drafts.registry import draft_config
    from engine.serve.scheduler import GenerationRequest, Scheduler
    from engine.speculative.generate import SpecDecoder

    target, plan, head, gs, k = setup("eagle3", sizes=(1, 2, 4), batch=4, prefill=(32, 64), prefill_rows=2)
    assert (2, 32) in gs.get("prefill").buckets and (2, 64) not in gs.get("prefill").buckets
    draft = make_draft(plan, head, target, 4, draft_config("eagle3").num_steps, cfg=draft_config("eagle3"), graphs=gs)
    sched = Scheduler(SpecDecoder(target, 4, draft, k, graphs=gs), 4, 8)
    prompts = random_prompts(6, seed=41)
    lengths = [40, 6, 40, 6, 12, 12]  # the two short ones leave slots 1 and 3 free together
    reqs = [GenerationRequest(p, n, lambda e: None) for p, n in zip(prompts, lengths)]
    reqs[5].temperature, reqs[5].seed = 0.8, 7
    prefill = gs.get("prefill").stats

    def admit(batch: list) -> int:
        """Queue `batch`, admit it: -> the prefill graph replays it took."""
        replays = prefill.replays
        sched.waiting.extend(batch)
        sched._admit()
        return prefill.replays - replays

    with torch.inference_mode():
        assert admit(reqs[:2]) == 1 and admit(reqs[2:4]) == 1  # two prompts each: one replay each
        assert [r.slot for r in reqs[:4]] == [0, 1, 2, 3]
        while reqs[1].finish_reason is None or reqs[3].finish_reason is None:
            sched._step()
        assert sched.slots[1] is sched.slots[3] is None and None not in (sched.slots[0], sched.slots[2])
        assert admit(reqs[4:]) == 1 and (reqs[4].slot, reqs[5].slot) == (1, 3)
        while sched.running:
            sched._step()
        alone = GenerationRequest(prompts[5], 12, lambda e: None, 0.8, seed=7)
        assert admit([alone]) == 1 and alone.slot == 0
        while sched.running:
            sched._step()
    assert prefill.fallbacks == 0
    eager = build(target, "eagle3", 1, SamplingParams())
    want = [
        eager.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].tokens
        for p, n in zip(prompts[:5], lengths)
    ]
    assert [r.output for r in reqs[:5]] == want
    assert reqs[5].output == alone.output and len(alone.output) == 12


def test_warm_up_joins_prompts_of_every_projection_launch_rule():
    """Each launch rule of the projections (kernels/gemv.py: up to 16 rows; up to 64, one 64-row tile or a
    narrow weight's 16-row tiles of either width; several) is its own compiled kernel: the warm-up joins a
    prompt of each, greedy and sampled, so no client's first long prompt waits for a compile."""
    from helpers.spec import setup

    from engine.drafts.registry import draft_config
    from engine.serve.scheduler import Scheduler
    from engine.speculative.generate import SpecDecoder
    from kernels.gemv import FUSED_M, ONE_TILE_M, gemv_config

    target, plan, head, gs, k = setup("eagle3", sizes=(1, 2), batch=2, prefill_rows=1)
    draft = make_draft(plan, head, target, 2, draft_config("eagle3").num_steps, cfg=draft_config("eagle3"), graphs=gs)
    sched = Scheduler(SpecDecoder(target, 2, draft, k, graphs=gs), 2, 8)
    joined, prefill = [], sched.dec.prefill

    def recording(prompts, *args):
        joined.extend(len(p) for p in prompts)
        return prefill(prompts, *args)

    sched.dec.prefill = recording
    sched.warm_up()
    rules = {(n <= FUSED_M, n <= ONE_TILE_M) for n in joined}
    assert rules == {(True, True), (False, True), (False, False)}
    for n_out in (576, 960):  # SmolLM2's o and qkv weights: both widths of their 16-row tiles
        assert {gemv_config(n_out, 576, n).block_n for n in joined if FUSED_M < n <= ONE_TILE_M} == {16, 32}
    assert sched.stats.rounds == 0 and not any(sched.state.live)


def test_profile_joins_times_each_pass_and_both_phases(tmp_path):
    """`benchmarks/profile_step.py --joins`: a serve config's scheduler joins each prompt alone into slot 0
    (no HTTP), greedy cold and warm, sampled, then profiled: wall and stream ms a pass, operators per phase."""
    import subprocess

    cmd = [sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--joins", "--prompts", "3"]
    cmd += ["--out", str(tmp_path), "+experiment=serve_eagle3_bcg", *BASE[:2], *EAGLE3, "graph=debug", "eval=quick"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    report = (tmp_path / "joins.txt").read_text()
    assert report.startswith("3 joins a pass into slot 0 of ")
    for name in ("greedy, new", "greedy, warm", "temperature 1", "greedy, profiled"):
        line = next(x for x in report.splitlines() if x.strip().startswith(name))
        m = re.search(r"wall ms +([\d.]+) .*prefill ([\d.]+), start ([\d.]+)", line)
        assert m and all(float(v) > 0 for v in m.groups()), line
    ops = dict(re.findall(r"^  (prefill|start) +cpu ops a join +([\d.]+)", report, re.M))
    assert set(ops) == {"prefill", "start"} and all(float(v) > 0 for v in ops.values())


def test_front_benchmark_streams_the_stand_in_engines_tokens():
    """`benchmarks/front.py`: the real front process over the stand-in engine, 1 and 3 clients: every
    response carries its max_tokens (the bench checks each), and each row reports the tokens the clients
    got (no more than the stand-in emits: 2 a request every 2 ms) and the front's CPU."""
    import subprocess

    cmd = [sys.executable, str(REPO / "benchmarks" / "front.py"), "--clients", "1", "3", "--warmup", "0.5"]
    cmd += ["--duration", "1.5", "--max-tokens", "16", "--tokens", "2", "--pass-ms", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split() for line in p.stdout.splitlines()[1:]]
    assert [int(r[0]) for r in rows] == [1, 3]
    for r in rows:
        tokens_s, cpu_s, ms_per_1k = float(r[2]), float(r[3]), float(r[4])
        assert 0 < tokens_s <= int(r[0]) * 2 / 2e-3 and cpu_s > 0 and ms_per_1k > 0, r


def test_max_queue_counts_requests_beyond_the_free_slots():
    from helpers.models import pair

    from engine.serve.scheduler import GenerationRequest, QueueFull, Scheduler
    from engine.speculative.generate import SpecDecoder

    sched = Scheduler(SpecDecoder(pair()[1], 2), 2, max_queue=0)  # not started: both slots free
    for _ in range(2):  # they take the free slots: no queue
        sched.submit(GenerationRequest([1, 2, 3], 4, lambda ev: None))
    with pytest.raises(QueueFull, match="serve.max_queue=0"):
        sched.submit(GenerationRequest([1, 2, 3], 4, lambda ev: None))
    sched.close(drain=False)


@pytest.mark.parametrize("interval", [1, 3])
def test_a_stream_gets_the_first_token_at_once_then_every_stream_interval_tokens(interval):
    """serve.stream_interval: the engine hands a request its first token at once, then gathers its
    tokens until `interval` are pending (a round without a draft emits one), and the last ones go with
    the finish; the tokens are the same whatever the interval."""
    from helpers.models import pair

    from engine.serve.scheduler import GenerationRequest, Scheduler
    from engine.speculative.generate import SpecDecoder

    sched = Scheduler(SpecDecoder(pair()[1], 2), 2, 8, stream_interval=interval)
    events, done = [], threading.Event()
    req = GenerationRequest([1, 2, 3], 11, lambda ev: (events.append(ev), ev.finish_reason and done.set()))
    sched.submit(req)
    sched.start()
    assert done.wait(30)
    sched.close()
    sizes = [len(ev.tokens) for ev in events]
    assert [t for ev in events for t in ev.tokens] == req.output and len(req.output) == 11
    assert events[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in events[:-1])
    # tokens 2..10 go in chunks of `interval`; the 11th ends the request and takes what is pending
    assert sizes == [1] + [interval] * (9 // interval) + [10 - interval * (9 // interval)]


def test_a_passs_token_events_cross_the_pipe_in_one_message():
    """engine/serve/link.py over a real pipe and a real scheduler: three requests submitted through the
    front's end are answered once each, and their events come one message per engine pass (the first
    pass joins all three and runs a round), each with the request's counts so far."""
    import multiprocessing

    from helpers.models import pair

    from engine.serve.link import EngineLink, Submission
    from engine.serve.scheduler import Scheduler
    from engine.speculative.generate import SpecDecoder

    sched = Scheduler(SpecDecoder(pair()[1], 3), 3, 8)
    front, here = multiprocessing.Pipe()
    link = EngineLink(here, sched)
    pump = threading.Thread(target=link.pump, daemon=True)
    pump.start()
    for rid in range(3):
        front.send(("submit", rid, Submission([1, 2, 3 + rid], 6, 0.0, 1.0, None, frozenset(), True)))
    answers = [front.recv() for _ in range(3)]
    assert sorted(answers) == [("submitted", rid, None) for rid in range(3)]
    sched.start()
    messages, tokens, finished = [], {rid: [] for rid in range(3)}, set()
    while len(finished) < 3:
        kind, batch = front.recv()
        assert kind == "events"
        messages.append(batch)
        for rid, toks, finish, _, counts in batch:
            tokens[rid] += toks
            assert counts == (len(tokens[rid]) - 1, 0, 0)  # a round after the first token, no draft
            if finish is not None:
                finished.add(rid)
    assert [len(batch) for batch in messages] == [6, 3, 3, 3, 3]  # a pass: the join's + a round's, then rounds
    assert all(len(t) == 6 for t in tokens.values())
    front.send(("done", None))
    pump.join(10)
    sched.close()


def test_a_request_whose_events_overtake_its_answer_still_gets_them_all():
    """Under load the engine thread may run a request to its end before the link's thread answers its
    submit: the front keeps those events (the last one too) for the request it is about to start."""
    import multiprocessing

    from engine.serve.link import RemoteEngine, Submission, wire_event
    from engine.serve.scheduler import TokenEvent

    async def main():
        front, engine = multiprocessing.Pipe()
        remote = RemoteEngine(front)
        remote.attach(asyncio.get_running_loop())
        task = asyncio.ensure_future(remote.submit(Submission([1, 2], 3, 0.0, 1.0, None, frozenset(), True)))
        kind, rid, _ = await asyncio.get_running_loop().run_in_executor(None, engine.recv)
        assert kind == "submit"
        first = wire_event(rid, TokenEvent([5]), (0, 0, 0))
        engine.send(("events", [first, wire_event(rid, TokenEvent([6, 7], "length"), (1, 2, 1))]))
        await asyncio.sleep(0.05)  # the events arrive first
        engine.send(("submitted", rid, None))
        got_rid, queue = await task
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        return got_rid == rid, [(ev.tokens, ev.finish_reason, n) for ev, n in items], remote.in_flight

    same, items, in_flight = asyncio.run(main())
    assert same and items == [([5], None, (0, 0, 0)), ([6, 7], "length", (1, 2, 1))] and in_flight == 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_chunks_are_the_chunk_dicts_of_each_event(kind):
    """The front's SSE stream over a fake engine: each event's text delta (quotes, backslashes, newlines,
    control and multi-byte characters split across events; several passes' events read in one wake-up)
    is one chunk, and every chunk (chat's first with the role, the finish, the usage) is the JSON of the
    dict OpenAI's shape gives, byte for byte."""
    import multiprocessing

    from engine.serve.link import RemoteEngine, wire_event
    from engine.serve.openai_server import OpenAIApp
    from engine.serve.protocol import ApiLimits
    from engine.serve.scheduler import TokenEvent

    text = 'He said "hi" \\ back\\slash\n\ttab \x01 caf\u00e9 \u65e5\u672c \U0001f642 \u2028 </script> end'
    data = text.encode()
    cuts = [0, 1, 4, 5, 9, 12, 20, 27, 28, 29, 31, 36, 40, 41, 43, 47, 52, len(data)]
    tokens = [list(data[a:b]) for a, b in zip(cuts, cuts[1:])]
    n = len(tokens)
    events = [TokenEvent(t, "length" if i == n - 1 else None) for i, t in enumerate(tokens)]
    counts = [(i, 3 * i, 2 * i) for i in range(n)]

    def engine_side(conn):
        kind_, rid, sub = conn.recv()
        assert kind_ == "submit"
        conn.send(("submitted", rid, None))
        batch = [wire_event(rid, ev, c) for ev, c in zip(events, counts)]
        conn.send(("events", batch[:3]))  # one pass with three of them, then two passes sent together
        conn.send(("events", batch[3:5]))
        conn.send(("events", batch[5:7]))
        for item in batch[7:]:
            time.sleep(0.005)
            conn.send(("events", [item]))

    async def main():
        front, engine = multiprocessing.Pipe()
        threading.Thread(target=engine_side, args=(engine,), daemon=True).start()
        tok = ByteTokenizer()
        remote = RemoteEngine(front)
        remote.attach(asyncio.get_running_loop())
        api = OpenAIApp(remote, tok, ApiLimits("m", tok.vocab_size, 256, 0, 64, 64, 0.0))
        body = {"model": "m", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            r = await client.post(url, json=body)
        return r.status_code, r.text

    status, raw = asyncio.run(main())
    assert status == 200
    assert raw.endswith("data: [DONE]\n\n")
    sent = [e[len("data: ") :] for e in raw.split("\n\n")[:-2]]
    first = json.loads(sent[0])
    head = {"id": first["id"], "object": first["object"], "created": first["created"], "model": "m"}
    assert head["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")

    def chunk(delta, finish, role=False):
        if kind == "chat":
            d = {"role": "assistant", "content": delta} if role else ({"content": delta} if delta else {})
            return {**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
        return {**head, "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]}

    ts = TextStream(ByteTokenizer())
    deltas = [d for d in (ts.push(t) for t in tokens) if d]
    assert "".join(deltas) == text and len(deltas) < n  # a split character waits for the rest of it
    speculation = {"verify_rounds": n - 1, "draft_tokens": 3 * (n - 1), "accepted_tokens": 2 * (n - 1)}
    speculation |= {"accept_length": 3.0, "mean_k": 3.0}
    tok = ByteTokenizer()
    prompt = len(tok.encode_messages([{"role": "user", "content": "hi"}]) if kind == "chat" else tok.encode("hi"))
    usage = {"prompt_tokens": prompt, "completion_tokens": len(data), "total_tokens": prompt + len(data)}
    expected = [chunk("", None, role=True)] if kind == "chat" else []
    expected += [chunk(d, None) for d in deltas] + [chunk(None, "length")]
    expected.append({**head, "choices": [], "usage": {**usage, "speculation": speculation}})
    assert [json.loads(e) for e in sent] == expected
    assert sent == [json.dumps(e, separators=(",", ":")) for e in expected]


def test_the_http_front_is_a_process_of_its_own_and_its_death_stops_the_engine(tmp_path):
    """The front runs in a child process that never loads torch, in its own process group (a terminal's
    Ctrl-C reaches the engine, which forwards it); killed, it takes nothing down with it: the stage
    returns."""
    import os
    from pathlib import Path

    s = Served(CONFIGS["tight"], tmp_path)
    front = s.server.front
    assert front.pid != os.getpid() and front.is_alive()
    assert os.getpgid(front.pid) == front.pid != os.getpgid(0)
    assert "libtorch" not in Path(f"/proc/{front.pid}/maps").read_text()
    assert complete(s, PROMPTS[0], max_tokens=4).usage.completion_tokens == 4
    os.kill(front.pid, signal.SIGKILL)
    s.thread.join(30)
    assert not s.thread.is_alive() and s.error is None
    assert s.result is not None


def test_accept_rates_count_only_the_rounds_that_drafted_the_position():
    """With adaptive k a round drafts fewer positions than k: a position's rate is over the row rounds
    that drafted it (10 rounds of k = 1, then 10 of k = 3 accepting 2 each)."""
    from engine.serve.scheduler import ServeStats

    st = ServeStats(accepted_at=[0, 0, 0], drafted_at=[0, 0, 0])
    for k, a in [(1, 1)] * 10 + [(3, 2)] * 10:
        st.row_rounds += 1
        st.accepted_tokens += a
        for p in range(k):
            st.drafted_at[p] += 1
        for p in range(a):
            st.accepted_at[p] += 1
    assert st.accept_rates() == [1.0, 1.0, 0.0]  # over all row rounds: [1.0, 0.5, 0.0]


def test_the_engine_process_switches_the_gil_every_tenth_of_a_millisecond_while_serving(tmp_path):
    """The link's thread answers the front's submits in the engine process: the server shortens the
    switch interval while it runs (a submit waits at most that for the engine thread's GIL) and puts
    Python's back when it stops."""
    from engine.serve.http import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    s = Served(CONFIGS["tight"], tmp_path)
    try:
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert complete(s, PROMPTS[0], max_tokens=4).usage.completion_tokens == 4
    finally:
        s.close()
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)  # kept in whole microseconds
