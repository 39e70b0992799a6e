"""Reliability: what a run does with input it cannot serve, where it writes, and how it stops.

Plan time: a prompt that does not fit the KV cache with eval.max_new_tokens and the draft's tokens fails
the plan through the tokenizer alone (no weights), with the other bad values, exit 2 and no MLflow run.
Hydra's run directories follow SPECPIPE_OUTPUTS.

Server: a real server (a `python -m pipeline` subprocess, or the plan executed in a thread) on 127.0.0.1
with the tiny model, driven by httpx and the `openai` client. The first SIGINT drains (new requests: 503
with Retry-After, an OpenAI error body), a second one aborts what is in flight and ends the process
cleanly; tokens_per_s counts busy time only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers.runs import benchmark_module, cli, compose_cfg
from helpers.serve import Served, ServerProcess

from engine.tokenizer import ByteTokenizer
from pipeline.config import to_run_config
from pipeline.paths import REPO
from pipeline.plan import PlanError, build_plan

TINY = ("model=tiny", "device=cpu", "model.max_seq_len=128", "eval.max_new_tokens=16")


def question_jsonl(path: Path, turns: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question_id": 100 + i, "turns": [t]}) + "\n" for i, t in enumerate(turns)))
    return path


def test_a_prompt_beyond_the_kv_cache_fails_the_plan_naming_its_record(tmp_path, outputs):
    long_ = "why is the sky blue? " * 5  # about 124 tokens: beyond 128 slots with 16 new tokens and 3 drafted
    data = question_jsonl(tmp_path / "question.jsonl", ["short one", long_, "another short one"])
    tokens = len(ByteTokenizer().encode_chat(long_))  # the tiny model's tokenizer, chat template on
    cfg = to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", "draft=ngram", "draft.num_steps=3"))
    with pytest.raises(PlanError) as err:
        build_plan(cfg, outputs)
    text = str(err.value)
    assert f"eval.dataset='{data}'" in text and "record 2 (question_id '101')" in text, text
    assert f"has {tokens} prompt tokens" in text and "draft.num_steps=3" in text, text
    assert f"= {tokens + 16 + 3} KV slots, beyond model.max_seq_len=128" in text, text
    assert f"eval.max_new_tokens <= {128 - tokens - 3}" in text and f"model.max_seq_len >= {tokens + 19}" in text
    # the same prompts fit once the cache holds them, and the short records alone fit as they are
    build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", f"model.max_seq_len={tokens + 19}")), outputs)
    build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", "eval.limit=1")), outputs)


def test_token_ids_outside_the_vocabulary_are_reported_with_a_prompt_too_long(tmp_path, outputs):
    data = tmp_path / "question.jsonl"
    records = [
        {"question_id": "ids", "prompt_token_ids": [256, 72, 999]},
        {"question_id": "long", "turns": ["x" * 200]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(PlanError) as err:
        build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={data}")), outputs)
    text = str(err.value)
    assert "record 1 (question_id 'ids'): prompt_token_ids [999] outside the target's vocabulary" in text, text
    assert "(valid: ids in [0, 320))" in text and "record 2 (question_id 'long') has" in text, text


def test_a_tokenizer_that_does_not_load_fails_the_plan_naming_model_path(tmp_path, outputs):
    from helpers.models import tiny_hf_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config().to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")  # the plan reads no weights
    (tmp_path / "tokenizer.json").write_text("{not json")
    cfg = to_run_config(compose_cfg("model=hf", f"model.path={tmp_path}", "device=cpu"))
    with pytest.raises(PlanError, match=r"model.path='.*': its tokenizer does not load"):
        build_plan(cfg, outputs)


@pytest.mark.fresh_store
def test_prompt_lengths_are_reported_with_the_other_plan_errors_exit_2_and_no_run(tmp_path, outputs):
    data = question_jsonl(tmp_path / "question.jsonl", ["x" * 200])
    run = cli(*TINY, f"eval.dataset={data}", "eval.batch_size=0", "tracking=mlflow", outputs=outputs, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    err = run.stderr + run.stdout
    assert "eval.batch_size=0" in err and "record 1 (question_id '100')" in err, err[-2000:]
    assert "Traceback" not in err
    assert not (outputs / "mlflow.db").exists() or _run_count(outputs) == 0


def _run_count(outputs: Path) -> int:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    return sum(len(c.search_runs([e.experiment_id])) for e in c.search_experiments())


def test_hydra_run_directories_follow_specpipe_outputs(tmp_path):
    """A run under SPECPIPE_OUTPUTS writes its Hydra directory there; nothing under the repository's outputs/."""
    marker = f"outputs_follow_{os.getpid()}_{tmp_path.name}"  # finds this run's directory wherever it went
    out = tmp_path / "elsewhere"
    args = ("model=tiny", "device=cpu", "eval.limit=1", "eval.max_new_tokens=2", "tracking=off")  # (dry runs: none)
    run = cli(*args, f"experiment_name={marker}", outputs=out, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    mine = [p for p in out.glob("runs/*/*/.hydra/overrides.yaml") if marker in p.read_text()]
    assert len(mine) == 1, sorted(out.rglob("*"))
    in_repo = [p for p in (REPO / "outputs").glob("*/*/*/.hydra/overrides.yaml") if marker in p.read_text()]
    assert in_repo == []


def test_hydra_run_directories_default_to_the_repositorys_outputs_whatever_the_cwd(tmp_path, monkeypatch):
    """Without SPECPIPE_OUTPUTS, a run or a sweep started elsewhere keeps its Hydra folder beside the
    MLflow store and the weights cache (<repo>/outputs), not in an outputs/ of the cwd."""
    from hydra import compose, initialize_config_dir

    from pipeline.config import register_configs

    monkeypatch.delenv("SPECPIPE_OUTPUTS", raising=False)
    monkeypatch.chdir(tmp_path)
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        hydra = compose(config_name="config", return_hydra_config=True).hydra
    for folder in (hydra.run.dir, hydra.sweep.dir):
        assert Path(folder).parent.parent.parent == REPO / "outputs", folder


def test_draining_answers_503_with_retry_after_and_a_second_ctrl_c_stops_cleanly(outputs):
    server = ServerProcess(outputs, "experiment_name=serve_drain")
    try:
        body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        answers: list[httpx.Response] = []  # a non-streaming request in flight beside the stream
        waiting = threading.Thread(
            target=lambda: answers.append(
                httpx.post(server.root + "/v1/completions", json={**body, "stream": False}, timeout=60)
            )
        )
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            waiting.start()
            t0 = time.monotonic()
            while httpx.get(server.root + "/health", timeout=10).json()["running"] < 2:
                assert time.monotonic() - t0 < 10, "the second request did not start"
                time.sleep(0.05)
            server.p.send_signal(signal.SIGINT)  # Ctrl-C while both generate: drain
            server.wait_for(r"\[serve\] draining: 2 requests in flight", 10)

            client = openai.OpenAI(base_url=server.root + "/v1", api_key="unused", max_retries=0, timeout=10)
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4)
            assert refused.value.status_code == 503
            assert int(refused.value.response.headers["Retry-After"]) > 0
            assert refused.value.response.json()["error"]["code"] == "shutting_down"
            health = httpx.get(server.root + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "draining"

            t_stop = time.monotonic()
            server.p.send_signal(signal.SIGINT)  # again: stop now
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last["error"]["code"] == "abort" and last["error"]["type"] == "server_error", last
        waiting.join(15)
        (answer,) = answers
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "abort", answer.text
        assert "Retry-After" in answer.headers
        server.p.wait(15)
        assert time.monotonic() - t_stop < 10, "the second Ctrl-C did not stop the server quickly"
        assert server.p.returncode == 0, server.text()
        time.sleep(0.2)  # the reader threads take the last lines
        assert "Traceback" not in "".join(server.err) + "".join(server.out), server.text()
        assert "aborting 2 in-flight requests" in "".join(server.out), server.text()
    finally:
        server.kill()


def test_tokens_per_s_counts_busy_time_not_idle_time(outputs):
    draft = ("draft.init=random", "draft.aux_layer_ids=[1,2,3]", "draft.num_steps=3", "graph=debug")
    s = Served(
        ("+experiment=serve_eagle3_bcg", "model=tiny", "device=cpu", "tracking=off", "serve.port=0", *draft), outputs
    )
    t0 = time.perf_counter()
    time.sleep(3.0)  # idle: no request in flight
    outs = [
        s.client.completions.create(
            model=s.model, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in ("Hello", "The quick brown fox")
    ]
    time.sleep(2.0)
    s.close()
    wall = time.perf_counter() - t0
    m = s.result["serve_results"]
    tokens = sum(o.usage.completion_tokens for o in outs)
    assert m["generated_tokens"] == tokens == 48
    assert m["busy_s"] < wall - 4.5  # the 5 s of sleep are not busy time
    assert m["tokens_per_s"] == pytest.approx(tokens / m["busy_s"])
    assert m["tokens_per_s"] > 2 * tokens / wall  # what the whole wall time would have said
    # where the time went (on CPU the phase marks read the host clock: each phase within its wall time;
    # a draft prefill put off to a later round is a join's time, prefill_s's, not round_s's)
    assert m["prefills"] == 2 and 0 < m["prefill_target_s"] and 0 < m["prefill_draft_s"]
    assert m["prefill_target_s"] + m["prefill_draft_s"] <= m["prefill_s"]
    assert 0 < m["verify_s"] and 0 < m["draft_s"] and m["draft_s"] + m["extend_s"] + m["verify_s"] <= m["round_s"]
    assert 0 < m["emit_s"] < m["busy_s"] - m["round_s"] - m["prefill_s"] + m["emit_s"]
    # each thread's CPU time: the engine's covers its rounds' host work and not the 5 idle seconds
    assert 0.25 * (m["round_s"] + m["prefill_s"]) < m["engine_cpu_s"] < wall - 4.5
    assert 0 < m["http_cpu_s"] < wall - 4.5


def test_requests_generated_from_the_openapi_schema_get_no_server_error(outputs):
    """Schemathesis writes requests from the server's own /openapi.json, valid ones and ones that break it
    (positive and negative modes): none gets a 5xx, some are served, and the server is healthy after."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    s = Served(
        (
            "+experiment=serve",
            "model=tiny",
            "device=cpu",
            "tracking=off",
            "serve.port=0",
            "model.max_seq_len=160",
            "serve.max_tokens_limit=8",
            "serve.default_max_tokens=8",
        ),
        outputs,
    )
    try:
        schema = schemathesis.openapi.from_dict(httpx.get(s.root + "/openapi.json", timeout=10).json())
        ops = [schema["/v1/completions"]["POST"], schema["/v1/chat/completions"]["POST"]]
        cases = st.one_of([op.as_strategy(mode) for op in ops for mode in schemathesis.GenerationMode])
        statuses: list[int] = []

        @settings(
            max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(case=cases)
        def fuzz(case):
            r = case.call(base_url=s.root, timeout=30)
            statuses.append(r.status_code)
            assert r.status_code < 500, (case.as_curl_command(), r.status_code, r.text[:500])
            (kind,) = r.headers["content-type"]  # schemathesis: each header's values
            assert kind.startswith(("application/json", "text/event-stream")), kind
            if r.status_code >= 400:
                assert set(json.loads(r.text)["error"]) == {"message", "type", "param", "code"}, r.text

        t0 = time.monotonic()
        fuzz()
        assert time.monotonic() - t0 < 60
        assert len(statuses) >= 50 and 200 in statuses and any(400 <= x < 500 for x in statuses), statuses
        health = httpx.get(s.root + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        s.close()


# ------------------------------------------------------------------------------------------ load
def test_load_test_counts_requests_failures_by_kind_and_the_server_rss(outputs, tmp_path, capsys):
    lt = benchmark_module("load_test")
    s = Served(("+experiment=serve", "model=tiny", "device=cpu", "tracking=off", "serve.port=0"), outputs)
    try:
        common = ["--url", s.root, "--clients", "4", "--duration", "120", "--max-tokens", "4", "--ignore-eos"]
        rows = tmp_path / "rows.json"
        pid = ["--server-pid", str(os.getpid())]  # the server runs in this process
        assert lt.main([*common, "--requests", "40", *pid, "--json", str(rows)]) == 0
        (row,) = json.loads(rows.read_text())
        assert row["requests"] == 40 and row["failures"] == 0 and row["failure_kinds"] == {}
        out = capsys.readouterr().out
        assert re.search(r"server RSS at start: \d+\.\d MiB", out) and "server RSS after:" in out, out
        assert row["server_rss_mb"] > 0

        assert lt.main([*common, "--requests", "8", "--model", "not-served", "--json", str(rows)]) == 1
        (row,) = json.loads(rows.read_text())
        assert row["failures"] == 8 and row["failure_kinds"] == {"HTTP 404": 8}
        out = capsys.readouterr().out
        assert "8 failed: HTTP 404 x8" in out and out.count("first of its kind") == 1, out
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SPECPIPE_SOAK"), reason="five minutes of load: SPECPIPE_SOAK=1 runs it")
def test_soak_16_clients_for_5_minutes_on_cpu(outputs):
    """The documented soak (docs/performance.md, Reliability): no failed request, a healthy server after,
    and its resident memory not growing without bound."""
    server = ServerProcess(outputs, "serve.max_batch_size=16", "tracking=off")
    try:
        run = subprocess.run(
            [sys.executable, "benchmarks/load_test.py", "--url", server.root, "--clients", "16", "--duration", "300"]
            + ["--max-tokens", "64", "--server-pid", str(server.p.pid), "--json", str(outputs / "soak.json")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        print(run.stdout)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (row,) = json.loads((outputs / "soak.json").read_text())
        start = float(re.search(r"server RSS at start: ([\d.]+) MiB", run.stdout).group(1))
        assert row["failures"] == 0 and row["requests"] > 0
        assert row["server_rss_mb"] < 1.5 * start, (start, row["server_rss_mb"])
        assert httpx.get(server.root + "/health", timeout=10).json()["status"] == "ok"
    finally:
        server.p.send_signal(signal.SIGINT)
        try:
            server.p.wait(60)
        finally:
            server.kill()
