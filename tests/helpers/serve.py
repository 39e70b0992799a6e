"""A server to drive with the openai client: the pipeline's plan ending in `serve`, in a thread of this
process or as `python -m pipeline` in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from helpers.runs import compose_cfg
from pipeline.config import to_run_config
from pipeline.execute import execute
from pipeline.paths import REPO
from pipeline.plan import build_plan


class Served:
    """The pipeline's plan ending in `serve`, executed in a background thread; `close()` is Ctrl-C."""

    def __init__(self, overrides, outputs: Path):
        self.cfg = to_run_config(compose_cfg(*overrides))
        self.plan = build_plan(self.cfg, outputs)
        assert self.plan.names[-1] == "serve"
        self.stage = self.plan.stages[-1]
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while self.stage.server is None or not self.stage.server.wait_ready(0.05):
            assert self.error is None and time.monotonic() - t0 < 60, f"server did not start: {self.error!r}"
            time.sleep(0.01)  # no busy wait: it would starve the engine thread of the GIL while it builds
        self.server = self.stage.server
        self.root = f"http://127.0.0.1:{self.server.port}"
        self.client = openai.OpenAI(base_url=self.root + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.model = self.cfg.model.name

    def _run(self):
        try:
            self.result = execute(self.plan)
        except BaseException as e:  # reported by the test that needs the server
            self.error = e

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.root + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (
                    "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""
                )
                out[key] = s.value
        return out

    def close(self):
        self.server.shutdown()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"
        assert self.error is None, self.error


class ServerProcess:
    """`python -m pipeline +experiment=serve` on the tiny model; stdout and stderr read as they come."""

    def __init__(self, outputs: Path, *overrides: str):
        self.p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline",
                "+experiment=serve",
                "model=tiny",
                "device=cpu",
                "serve.port=0",
                *overrides,
            ],
            cwd=REPO,
            env={**os.environ, "SPECPIPE_OUTPUTS": str(outputs)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=lambda f=stream, s=sink: s.extend(f), daemon=True)
            for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()
        port = self.wait_for(r"ready on http://127\.0\.0\.1:(\d+)/v1", 120)
        self.root = f"http://127.0.0.1:{port.group(1)}"

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for line in list(self.out):
                if m := re.search(pattern, line):
                    return m
            assert self.p.poll() is None or any(re.search(pattern, x) for x in self.out), self.text()
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text()}")

    def text(self) -> str:
        return "".join(self.out)[-3000:] + "\n--- stderr ---\n" + "".join(self.err)[-3000:]

    def finish(self, timeout: float) -> int:
        """Waits for the process to exit and for its output to be read to the end; its exit code."""
        code = self.p.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
