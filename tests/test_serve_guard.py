"""A server safe to expose (engine/serve/guard.py): a real server (the plan executed in a thread) on the
tiny model, driven by httpx, raw sockets and the `openai` client.

Authentication (serve.api_key / SPECPIPE_API_KEY) on every endpoint but /health, Host checked on
loopback, a body beyond the limit refused before it is read (Content-Length or chunked), connections
capped and idle or slowly-sent request heads closed, every error in OpenAI's shape and counted,
edge values fuzzed (benchmarks/fuzz_server.py) with no 5xx.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import openai
import pytest
from helpers.runs import benchmark_module
from helpers.serve import Served

from engine.serve import guard

SERVE = ("+experiment=serve", "model=tiny", "device=cpu", "tracking=off", "serve.port=0", "model.max_seq_len=160")
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = Served(
        (*SERVE, f"serve.api_key={KEY}", "serve.max_tokens_limit=8", "serve.default_max_tokens=8"),
        tmp_path_factory.mktemp("keyed"),
    )
    yield s
    s.close()


def rejected(s: Served, status: int) -> float:
    return s.metrics().get(f"specpipe_requests_rejected_total{{status={status}}}", 0.0)


def test_the_api_key_guards_every_endpoint_but_health(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(keyed.root + "/metrics", headers=auth).text
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("GET", "/nope")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, keyed.root + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(keyed.root + "/health").status_code == 200
    client = openai.OpenAI(base_url=keyed.root + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url=keyed.root + "/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model=keyed.model, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert "specpipe_requests_rejected_total" in before
    m = httpx.get(keyed.root + "/metrics", headers=auth).text
    assert 'specpipe_requests_rejected_total{status="401"} 13.0' in m, m  # every refusal counted


def test_a_loopback_server_refuses_other_host_names(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    for host in ("evil.example", "evil.example:80", "10.0.0.1"):  # DNS rebinding: a page's own host name
        r = httpx.get(keyed.root + "/v1/models", headers={**auth, "Host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
    for host in ("localhost", "127.0.0.1:1234", "[::1]:8000"):
        assert httpx.get(keyed.root + "/v1/models", headers={**auth, "Host": host}).status_code == 200


def test_a_body_beyond_the_limit_is_refused_before_it_is_read(keyed):
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    limit = guard.body_limit(160)
    big = b'{"model": "x", "prompt": [' + b"1," * (30 << 20) + b"1]}"  # 60 MB of token ids
    t0 = time.monotonic()
    r = httpx.post(keyed.root + "/v1/completions", content=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert str(limit) in r.json()["error"]["message"] and time.monotonic() - t0 < 5

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b" " * (64 << 10)

    r = httpx.post(keyed.root + "/v1/completions", content=chunks(), headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # a large body within the limit (parsed off the event loop) is served
    body = {"model": keyed.model, "prompt": "Hi" + " " * (200 << 10), "max_tokens": 2}
    r = httpx.post(keyed.root + "/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert httpx.get(keyed.root + "/health").json()["status"] == "ok"


def test_requests_with_edge_values_get_no_server_error(keyed):
    """A seed beyond 64 bits with temperature > 0, a lone surrogate, NUL: 4xx in OpenAI's shape or served;
    then benchmarks/fuzz_server.py's edge values (its long run: docs/reliability.md)."""
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    base = {"model": keyed.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0.7}
    for extra, status in (({"seed": 2**64}, 422), ({"seed": 2**64 - 1}, 200), ({"prompt": "a\x00b"}, 200)):
        r = httpx.post(keyed.root + "/v1/completions", json={**base, **extra}, headers=auth, timeout=30)
        assert r.status_code == status, (extra, r.text)
    raw = json.dumps({**base, "prompt": "x"}).replace('"x"', '"\\ud800"').encode()
    r = httpx.post(keyed.root + "/v1/completions", content=raw, headers=auth, timeout=30)
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text
    chat = {"model": keyed.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    raw = json.dumps(chat).replace('"x"', '"\\ud800"').encode()
    assert httpx.post(keyed.root + "/v1/chat/completions", content=raw, headers=auth).status_code == 400
    fuzz = benchmark_module("fuzz_server")
    assert fuzz.main(["--url", keyed.root, "--requests", "300", "--api-key", KEY]) == 0


def test_a_vanishing_top_p_keeps_the_greedy_token_and_a_429_says_when_to_retry(outputs):
    s = Served((*SERVE[:-1], "serve.max_batch_size=1", "serve.max_queue=0"), outputs)  # a context of 2048
    try:
        greedy = s.client.completions.create(model=s.model, prompt="Hello", max_tokens=6, temperature=0)
        tiny = s.client.completions.create(model=s.model, prompt="Hello", max_tokens=6, temperature=1, top_p=1e-46)
        assert tiny.choices[0].text == greedy.choices[0].text
        body = {"model": s.model, "prompt": "Hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.root + "/v1/completions", json=body, timeout=60) as held:  # the one slot
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream, and frees the slot
            next(line for line in lines if line.startswith("data: {"))
            r = httpx.post(s.root + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0, r.text
            assert r.json()["error"]["code"] == "queue_full"
    finally:
        s.close()


def test_idle_connections_are_capped_and_slow_heads_closed(outputs, monkeypatch):
    """20 connections at most (a 21st gets a 503 with Retry-After and is closed); a connection that sends
    no whole request head within the deadline is closed, and the server answers again."""
    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 20)
    monkeypatch.setattr(guard, "HEAD_TIMEOUT_S", 1.0)
    s = Served(SERVE, outputs)
    port = s.server.port
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(19)]
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = extra.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 503") and "retry-after: 5" in answer, answer
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        time.sleep(1.5)  # past the head deadline: every idle and slow connection closed by the server
        for c in (*idle, slow):
            c.settimeout(2)
            assert c.recv(16) == b""
        r = httpx.get(s.root + "/health", timeout=5)
        assert r.status_code == 200
        assert s.metrics()["specpipe_requests_rejected_total{status=503}"] >= 1
    finally:
        for c in (*idle, slow, extra):
            c.close()
        s.close()


def test_event_loop_errors_are_logged_at_a_bounded_rate(caplog, monkeypatch):
    handler = guard.RateLimitedErrors()
    with caplog.at_level(logging.ERROR, logger=guard.log.name):
        for _ in range(10_000):  # descriptors exhausted: asyncio reports each failed accept()
            handler(
                None,
                {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")},
            )
        handler(None, {"message": "another kind"})
        assert len(caplog.records) == 2
        monkeypatch.setattr(guard, "LOG_EVERY_S", 0.0)
        handler(None, {"message": "socket.accept() out of system resource"})
    assert "(and 9999 more in the last" in caplog.records[-1].getMessage()


def test_a_non_loopback_host_without_a_key_warns_loudly(outputs, capfd):
    s = Served(
        ("+experiment=serve", "model=tiny", "device=cpu", "tracking=off", "serve.port=0", "serve.host=0.0.0.0"), outputs
    )
    s.close()
    err = capfd.readouterr().err
    assert "WARNING: serve.host=0.0.0.0 exposes the server beyond this machine and no API key is set" in err
